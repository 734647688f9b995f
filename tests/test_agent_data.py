"""Training conversations that vary what users vary, and a held-out tool vocabulary training never uses."""

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from clover.evaluation.suites import suite_tasks
from clover.model.tokenizer import Tokenizer
from clover.training import agent_data as A
from clover.training import synthetic
from clover.training.data import TokenData, chat_example


def _replay(task):
    """Run the reference tool calls on a fresh world; return (calls, results that differ from the transcript)."""
    world, calls, differ = task.fresh_world(), 0, []
    for i, m in enumerate(task.messages):
        for c in m.get("tool_calls") or []:
            calls += 1
            got = world.call(c["function"]["name"], json.loads(c["function"]["arguments"]))
            if got != task.messages[i + 1]["content"]:
                differ.append((c["function"]["name"], got))
    return calls, differ


@pytest.mark.parametrize("pool", ["train", "heldout"])
def test_every_family_replays_on_its_fresh_world_and_checks_its_answer(pool):
    for family in A.FAMILY_WEIGHTS:
        for seed in range(12):
            task = A.make_training_task(family, seed, pool)
            calls, differ = _replay(task)
            if family == "calc_faulty":  # the transcript holds the injected wrong result once
                assert len(differ) == 1 and calls >= 3
            else:
                assert not differ, (family, seed, differ)
                assert calls >= (0 if family == "arith" else 1)
            final = [m for m in task.messages if m["role"] == "assistant"][-1]["content"]
            assert task.check(final) and not task.check("I do not know."), (family, seed)
            assert A.make_training_task(family, seed, pool).messages == task.messages  # seeded


def test_tools_are_renamed_offered_with_distractors_and_errors_are_recovered():
    tasks = A.training_tasks("train", 400)
    names = {t["function"]["name"] for task in tasks for t in task.tools}
    assert {"calculator", "note_set", "list_dir"} <= names and len(names) > 300  # harness names and coined ones
    unused = [task for task in tasks if len(task.tools) > len({c["function"]["name"] for m in task.messages
                                                               for c in m.get("tool_calls") or []})]
    assert len(unused) > 100                                                # distractor tools offered
    errors = [task for task in tasks if any(m["role"] == "tool" and m["content"].startswith("error")
                                            for m in task.messages)]
    assert errors and all(task.check([m for m in task.messages if m["role"] == "assistant"][-1]["content"])
                          for task in errors)
    assert any(sum(m["role"] == "user" for m in task.messages) > 1 for task in tasks)   # multi-turn
    steps = {sum(m["role"] == "tool" for m in task.messages) for task in tasks if task.family == "recall"}
    assert 32 in steps                                                      # as long as the memory suite's
    # a renamed tool answers under its new parameter names and refuses the old ones
    task = next(t for t in tasks if t.world.aliases)
    name, alias = next(iter(task.world.aliases.items()))
    world = task.fresh_world()
    assert world.call(name, {"nonsense": "1"}).startswith("error: unknown argument")


def test_tool_names_are_coined_per_conversation_so_none_can_be_recalled():
    tasks = A.training_tasks("train", 3000)
    offered = Counter(t["function"]["name"] for task in tasks for t in task.tools)
    harness = {"calculator", "note_set", "note_get", "list_dir", "read_file"}
    natural = set(A.EVERYDAY_STEMS) & {s.name for s in A.EVERYDAY["train"]}
    # the shared names (the harness's, kept for its suites; the everyday tools' natural ones) are each
    # under 7% of what is offered; no other name reaches 1%; the rest spread over thousands of names
    total = sum(offered.values())
    assert all(n / total < 0.07 for n in offered.values())
    assert all(n / total < 0.01 for name, n in offered.items() if name not in harness | natural)
    assert len(offered) > 2000
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name in offered)
    for task in tasks:
        # names distinct, and no two offered tools doing the same thing (then either would be right)
        names = [t["function"]["name"] for t in task.tools]
        does = [t["function"]["description"].split(", given")[0] for t in task.tools]
        assert len(names) == len(set(names)) and len(does) == len(set(does)), (task.family, task.seed)
        # every reference call names an offered tool with exactly its parameters (a clash of coined
        # parameter names would leave the tool one parameter short)
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in task.tools}
        for m in task.messages:
            for c in m.get("tool_calls") or []:
                f = c["function"]
                params = schema[f["name"]]
                assert set(json.loads(f["arguments"])) == set(params["properties"]) == set(params["required"])
    # the heldout pool is never coined: its suite offers its fixed vocabulary only
    p = A.LOOKUP_POOLS["heldout"]
    fixed = {s.name for s in A.EVERYDAY["heldout"]} | {f"{v}_{e}_{a}" for v in p["verbs"] for e in p["entities"]
                                                       for a in p["attributes"]}
    harness = {"calculator", "note_set", "note_get", "list_dir", "read_file"}
    for family in A.FAMILY_WEIGHTS:
        for seed in range(50):
            task = A.make_training_task(family, seed, "heldout")
            assert {t["function"]["name"] for t in task.tools} <= fixed | harness and not task.world.aliases


def test_heldout_vocabulary_never_occurs_in_training_conversations():
    def vocab(tasks):
        out = set()
        for task in tasks:
            for t in task.tools:
                f = t["function"]
                out |= {f["name"], f["description"], *f["parameters"]["properties"]}
        return out

    train = vocab(A.training_tasks("train", 3000))
    heldout_tasks = suite_tasks("heldout", 24)
    heldout = set()
    for ht in heldout_tasks:
        for t in ht.tools:
            f = t["function"]
            heldout |= {f["name"], f["description"], *f["parameters"]["properties"]}
    assert heldout and not heldout & train
    for ht in heldout_tasks:  # and the suite's reference solutions pass
        env = ht.open()
        for turn in ht.reference:
            for c in turn.get("tool_calls") or []:
                env.call(c["function"]["name"], json.loads(c["function"]["arguments"]))
        assert env.check(ht.reference[-1]["content"])


def test_history_turns_are_context_and_only_the_last_exchange_is_scored(tmp_path):
    tok = Tokenizer.train(["hello world " * 50, "def f(x):\n    return x\n" * 50], vocab_size=300)
    task = next(t for t in A.training_tasks("train", 200) if sum(m["role"] == "user" for m in t.messages) > 1)
    ids, mask = chat_example(tok, task.messages, task.tools, task.thinking)
    first = mask.index(1)
    last_user = max(i for i, m in enumerate(task.messages) if m["role"] == "user")
    assert task.messages[last_user]["content"] in tok.decode(ids[:first])   # history comes before any score
    runs = sum(1 for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
    assert runs == sum(m["role"] == "assistant" for m in task.messages[last_user:])


def test_packing_fills_chat_rows(tmp_path):
    (tmp_path / "tokens").mkdir()
    convs = [[5, 6, 7, 0], [8, 9, 0], [10, 11, 12, 13, 0]]
    ids = np.asarray([t for c in convs for t in c], dtype=np.uint16)
    offsets = np.cumsum([0] + [len(c) for c in convs])
    np.savez(tmp_path / "tokens" / "train_chat.npz", ids=ids, mask=np.ones_like(ids, dtype=np.uint8), offsets=offsets)
    single = TokenData(tmp_path, "train", {"chat": 1.0}, eos_id=0).batch(0, 1, 4, 16)
    packed = TokenData(tmp_path, "train", {"chat": 1.0}, eos_id=0, pack=True).batch(0, 1, 4, 16)
    assert single.lengths.max() <= 5 and packed.lengths.tolist() == [16] * 4
    for row in packed.ids.tolist():  # whole conversations one after another, the last one cut
        pieces, cur = [], []
        for t in row:
            cur.append(t)
            if t == 0:
                pieces.append(cur)
                cur = []
        assert len(pieces) >= 3 and all(p in convs for p in pieces)
        assert any(c[: len(cur)] == cur for c in convs)


def test_whole_packing_keeps_every_conversation_whole(tmp_path):
    """`pack_whole`: a row holds whole conversations only (its rest padded, not scored); only one longer than
    a row is cut, alone in its row. Split packing cuts the last conversation of most rows."""
    (tmp_path / "tokens").mkdir()
    convs = [[5, 6, 7, 0], [8, 9, 0], [10, 11, 12, 13, 14, 15, 0], [20 + i for i in range(20)] + [0]]
    ids = np.asarray([t for c in convs for t in c], dtype=np.uint16)
    offsets = np.cumsum([0] + [len(c) for c in convs])
    np.savez(tmp_path / "tokens" / "train_chat.npz", ids=ids, mask=np.ones_like(ids, dtype=np.uint8), offsets=offsets)
    with pytest.raises(ValueError, match="needs pack"):
        TokenData(tmp_path, "train", {"chat": 1.0}, eos_id=0, whole=True)
    data = TokenData(tmp_path, "train", {"chat": 1.0}, eos_id=0, pack=True, whole=True)
    cut = 0
    for step in range(20):
        b = data.batch(0, step, 4, 16)
        assert b.ids.shape == (4, 16)
        for row, n, scored in zip(b.ids.tolist(), b.lengths.tolist(), b.loss_mask.tolist(), strict=True):
            assert not any(scored[n:]) and all(t == 0 for t in row[n:])      # the padded rest: eos, not scored
            if row[0] == 20:                                                 # the 21-token one, cut alone
                assert n == 16 and row == convs[3][:16]
                cut += 1
                continue
            pieces, cur = [], []
            for t in row[:n]:
                cur.append(t)
                if t == 0:
                    pieces.append(cur)
                    cur = []
            assert cur == [] and pieces and all(p in convs[:3] for p in pieces)
            assert 16 - n < 7                                                # closed only when no whole one fits
    assert cut > 0
    assert data.batch(3, 7, 4, 16).ids.equal(data.batch(3, 7, 4, 16).ids)      # a pure function of (seed, step)
    split = TokenData(tmp_path, "train", {"chat": 1.0}, eos_id=0, pack=True).batch(0, 1, 4, 16)
    assert split.lengths.tolist() == [16] * 4


def test_synthetic_make_faulty_calc_is_the_harness_task():
    task = synthetic.make_faulty_calc(5)
    assert task.family == "calc_faulty" and sum(m["role"] == "tool" for m in task.messages) == 3


def _copied_values(task):
    """The words a task asks to copy: the recall code word, the note's value, the files' names, the word to
    reverse or count letters in (the task's own, not an earlier exchange's)."""
    text = "\n".join(m["content"] for m in task.messages if m["role"] in ("system", "user"))
    found = re.findall(r"code word ([A-Z]+)", text) + re.findall(r"'([a-z]+)\d+' in my notes", text)
    found += [p.split("/")[-1][:-4] for p in task.initial_files if p.startswith("/docs/")]
    if task.family == "arith":
        last_user = [m["content"] for m in task.messages if m["role"] == "user"][-1]
        found += re.findall(r"(?:word|in) '([a-z]+)'", last_user)
    return [w.lower() for w in found]


def test_coined_values_replace_the_harness_words_only_where_asked():
    families = ("recall", "notes", "files", "arith")
    words = set(synthetic.WORDS)
    for family in families:
        plain = [A.make_training_task(family, seed) for seed in range(40)]
        coined = [A.make_training_task(family, seed, coin_values=1.0) for seed in range(40)]
        assert sum(bool(_copied_values(t)) for t in plain) >= 10, family    # the probe finds the values
        assert all(set(_copied_values(t)) <= words for t in plain), family
        assert all(not set(_copied_values(t)) & words for t in coined), family
        for task in coined:   # still true transcripts with checkable answers
            calls, differ = _replay(task)
            assert not differ, (family, task.seed, differ)
            final = [m for m in task.messages if m["role"] == "assistant"][-1]["content"]
            assert task.check(final) and not task.check("I do not know."), (family, task.seed)
        # the held-out pool (the harness's held-out suite) is never coined, and the default draws nothing extra
        assert all(A.make_training_task(family, s, "heldout", coin_values=1.0).messages
                   == A.make_training_task(family, s, "heldout").messages for s in range(10))
    share = np.mean([bool(set(_copied_values(t)) - words)
                     for t in A.training_tasks("train", 600, coin_values=0.5) if _copied_values(t)])
    assert 0.39 < share < 0.61          # 186 tasks with values to copy: 0.5 +- 3 standard errors (0.037)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="coin_values"):
            A.training_tasks("train", 1, coin_values=bad)


def test_the_recall_ledger_says_what_is_added_and_what_is_left():
    """`recall_ledger`: each call of a running-total conversation says the number it adds and those left after it
    ("none" before the answer); the conversation is otherwise the one without it, and only recall changes."""
    with_ledger = A.training_tasks("train", 300, recall_ledger=1.0)
    plain = A.training_tasks("train", 300)
    recalls = 0
    for task, base in zip(with_ledger, plain, strict=True):
        if task.family != "recall":
            assert task.messages == base.messages
            continue
        recalls += 1
        strip = [{k: v for k, v in m.items() if not (k == "content" and m.get("tool_calls"))} for m in task.messages]
        assert strip == [{k: v for k, v in m.items() if not (k == "content" and m.get("tool_calls"))}
                         for m in base.messages]
        assert all(not m["content"] for m in base.messages if m.get("tool_calls"))
        user = [m["content"] for m in task.messages if m["role"] == "user"][-1]
        numbers = re.findall(r"\d+", user.split(":", 1)[1])
        calls = [m for m in task.messages[task.start:] if m.get("tool_calls")]
        assert len(calls) == len(numbers) - 1 and task.check(task.messages[-1]["content"])
        for i, m in enumerate(calls):
            left = numbers[i + 2:]
            assert m["content"] == f"Adding {numbers[i + 1]}; left after it: {', '.join(left) or 'none'}."
            assert json.loads(m["tool_calls"][0]["function"]["arguments"]).popitem()[1].endswith(f" + {numbers[i + 1]}")
    assert recalls >= 25
    shares = [any(m.get("tool_calls") and m["content"] for m in t.messages)
              for t in A.training_tasks("train", 900, recall_ledger=0.5) if t.family == "recall"]
    assert 0.35 < np.mean(shares) < 0.65   # ~120 conversations: 0.5 +- 3.3 standard errors (0.046)
    with pytest.raises(ValueError, match="recall_ledger"):
        A.training_tasks("train", 1, recall_ledger=2.0)


def test_earlier_exchanges_come_from_the_conversations_own_split(monkeypatch):
    """An earlier, unrelated exchange put before a conversation is a task of a seed from the same split's
    range: training conversations never carry a validation or test seed's task (they drew from 0..10**9)."""
    drawn = []
    make_task = synthetic.make_task

    def recording(family, seed, **kw):
        drawn.append(seed)
        return make_task(family, seed, **kw)

    monkeypatch.setattr(synthetic, "make_task", recording)
    for split in ("train", "val", "test"):
        drawn.clear()
        A.training_tasks(split, 120)
        start = synthetic.SPLIT_SEEDS[split]
        assert len(drawn) > 10 and all(start <= s < start + synthetic.SPLIT_SPAN for s in drawn), split


def test_data_build_hands_its_ledger_share_to_the_corpus(tmp_path, monkeypatch):
    import clover.cli.train as train_cli
    from clover.cli.commands import main as cli_main

    seen: dict = {}

    def corpus(out, *args, **kwargs):
        seen.update(kwargs)
        raise OSError("stopped here")

    monkeypatch.setattr(train_cli, "build_corpus", corpus)
    shipped = str(Path(A.__file__).resolve().parents[1] / "weights" / "clover-tiny")
    assert cli_main(["data", "build", "--out", str(tmp_path / "d"), "--tokenizer", shipped, "--recall-ledger", "0.5"]) == 1
    assert seen["recall_ledger"] == 0.5
