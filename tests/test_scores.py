"""Held-out scores of a checkpoint (the model card's): bits per byte against a direct computation.

(The agent tasks of `clover eval tasks` run through the harness: tests/test_harness.py.)"""

import json
import lzma
import math

import pytest
import torch
from conftest import perturbed_model

from clover.model.config import CloverConfig
from clover.model.tokenizer import Tokenizer, stdlib_texts
from clover.training import scores


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(list(stdlib_texts(300_000)), vocab_size=600)


def test_bits_per_byte_matches_a_direct_computation(tok, tmp_path):
    docs = ["def f(x):\n    return x * 2\n", "import os\nprint(os.getcwd())\n"]
    (tmp_path / "raw" / "test").mkdir(parents=True)
    with open(tmp_path / "raw" / "test" / "code.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    config = CloverConfig.preset("debug", vocab_size=640, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    model = perturbed_model(config)
    got = scores.bits_per_byte(model, tok, tmp_path, "code", window=4)  # windows shorter than the documents
    nll = [0.0, 0.0]
    with torch.no_grad():
        for i, d in enumerate(docs):
            ids = [tok.special_ids["<|endoftext|>"]] + tok.encode(d)
            for s in range(0, len(ids) - 1, 4):
                chunk = torch.tensor([ids[s: s + 5]])
                lp = torch.log_softmax(model(chunk[:, :-1])[0], -1)
                nll[i] -= float(lp[torch.arange(chunk.shape[1] - 1), chunk[0, 1:]].sum())
    n = len("".join(docs).encode())
    assert got["bytes"] == n and abs(got["model_bits_per_byte"] - sum(nll) / math.log(2) / n) < 1e-4
    assert 0 < got["xz9_bits_per_byte"] and 0 < got["gzip9_bits_per_byte"]
    assert got["near_copies"] == 0 and "without_near_copies" not in got   # (no train split here)
    # a training document holding all of the second one's lines: it is a near-copy, scored apart
    (tmp_path / "raw" / "train").mkdir()
    (tmp_path / "raw" / "train" / "code.jsonl").write_text(json.dumps({"text": "x = 1\n" + docs[1]}) + "\n")
    again = scores.bits_per_byte(model, tok, tmp_path, "code", window=4)
    assert again["model_bits_per_byte"] == got["model_bits_per_byte"] and again["near_copies"] == 1
    rest = again["without_near_copies"]
    n0 = len(docs[0].encode())
    assert rest["documents"] == 1 and rest["bytes"] == n0 and abs(rest["model_bits_per_byte"] - nll[0] / math.log(2) / n0) < 1e-4
    assert rest["xz9_bits_per_byte"] == 8 * len(lzma.compress(docs[0].encode(), preset=9 | lzma.PRESET_EXTREME)) / n0
    # (half of its lines is not more than half: not a near-copy)
    (tmp_path / "raw" / "train" / "code.jsonl").write_text(json.dumps({"text": "import os\n"}) + "\n")
    assert scores.bits_per_byte(model, tok, tmp_path, "code", window=4)["near_copies"] == 0


def test_continuation_match_rows_and_verify_equals_ar(tok, tmp_path):
    """Every decoder gets a row; verify's tokens equal ar's (same_as_ar 1.0), so its match is ar's."""
    (tmp_path / "raw" / "test").mkdir(parents=True)
    (tmp_path / "raw" / "test" / "code.jsonl").write_text(json.dumps({"text": "def f(x):\n    return x * 2\n" * 40}))
    config = CloverConfig.preset("debug", vocab_size=640, mask_token_id=tok.mask_token_id,
                                 eos_token_id=tok.eos_token_ids)
    got = scores.continuation_match(perturbed_model(config), tok, tmp_path, count=3, new_tokens=12,
                                    thresholds=(0.9,), block_size=8, batch=2)
    rows = {r["algorithm"]: r for r in got["results"]}
    assert list(rows) == ["ar", "low_confidence", "verify"]
    assert rows["ar"]["same_as_ar"] == 1.0 and rows["ar"]["tpf"] == 1.0
    assert rows["verify"]["same_as_ar"] == 1.0 and rows["verify"]["match"] == rows["ar"]["match"]
    assert all(0.0 <= r["match"] <= 1.0 and r["tpf"] > 0 for r in rows.values())


def test_code_prompts_are_cut_from_the_split_asked_for(tok, tmp_path):
    """Model selection reads the val split (`clover eval match --split val`); the test split stays unread."""
    for split, text in (("val", "a = 1\n"), ("test", "b = 2\n")):
        (tmp_path / "raw" / split).mkdir(parents=True)
        (tmp_path / "raw" / split / "code.jsonl").write_text(json.dumps({"text": text * 200}) + "\n")
    for split, text in (("val", "a = 1\n"), ("test", "b = 2\n")):
        pairs = scores.code_prompts(tok, tmp_path, 3, 16, split=split)
        assert len(pairs) == 3 and all(len(t) == 16 for _, t in pairs)
        assert all(set(tok.decode(p + t)) <= set(text) for p, t in pairs)


def test_code_prompts_are_in_the_models_own_tokens(tok, tmp_path):
    """The documents are encoded with the model's tokenizer, as the data's shards are with the data's: a model
    with another tokenizer than the data's (the shipped one against a rebuilt data/, whose tokenizer differs)
    gets prompts that read as the code, not the data's ids, which mean other tokens to it. With the data's
    tokenizer the prompts are those of its token shard."""
    import numpy as np

    from clover.training.data import SPLITS, STREAMS, encode_corpus

    code = "def area(width, height):\n    return width * height\n\n\nclass Shape:\n    pass\n"
    (tmp_path / "raw" / "val").mkdir(parents=True)
    (tmp_path / "raw" / "val" / "code.jsonl").write_text(
        "".join(json.dumps({"text": code.replace("area", f"area{i}") * 8}) + "\n" for i in range(12)))
    other = Tokenizer.train([code * 20, "some english words here " * 50], vocab_size=300)
    assert not other.encodes_like(tok)
    text = "".join(json.loads(line)["text"] for line in (tmp_path / "raw" / "val" / "code.jsonl").open())
    for t in (tok, other):
        pairs = scores.code_prompts(t, tmp_path, 5, 12, split="val")
        assert all(t.decode(p + c) in text for p, c in pairs)
    for split in SPLITS:   # encode_corpus reads every split and kind: the others empty
        (tmp_path / "raw" / split).mkdir(exist_ok=True)
        for kind in (*STREAMS, "chat"):
            if not (tmp_path / "raw" / split / f"{kind}.jsonl").exists():
                (tmp_path / "raw" / split / f"{kind}.jsonl").write_text("")
    encode_corpus(tmp_path, tok)
    shard = np.fromfile(tmp_path / "tokens" / "val_code.bin", dtype=np.uint16).tolist()
    eos = tok.special_ids["<|endoftext|>"]
    with pytest.raises(ValueError, match="too few documents long enough"):   # no endless redrawing
        scores.code_prompts(tok, tmp_path, 5, len(shard) // 2, split="val")
    for p, c in scores.code_prompts(tok, tmp_path, 5, 12, split="val"):
        window = p + c
        assert any(shard[i: i + len(window)] == window for i in range(len(shard) - len(window) + 1)) and eos not in window


def test_copy_kinds_tell_copied_numbers_from_computed_ones():
    from clover.training.scores import _token_kinds

    pieces = ["x", " =", " 8", "97", "\n", "Ans", ":", " 8", "97", " 1", "897", ":"]
    kinds = _token_kinds(pieces, [False] * 5 + [True] * 7)
    assert kinds == [None] * 5 + ["other_new", "other_new", "number_copied", "number_copied", "number_computed",
                                  "number_computed", "other_copied"]   # 1897 is not 897 copied


def test_copied_words_tell_a_respelt_copy_from_a_same_spelling_one():
    from clover.training.scores import _copied_words

    pieces = ["Call", " Oth", "ru", " now", "\n", "Oth", "ru", " and", " Oth", "ru", " Othru2"]
    words = _copied_words(pieces, [False] * 4 + [True] * 7)
    # `Othru` on its own line after ` Othru`: respelt; after a space again: the same spelling; `and` and
    # `Othru2` stand nowhere earlier; the first occurrence is not scored
    assert words == [([5, 6], True), ([8, 9], False)]
    # the chat template's own words are format, not copies
    pieces = ["<tool_call>", "\n", "Oth", "ru", "<tool_call>", " Oth", "ru"]
    assert _copied_words(pieces, [True] * 7, frozenset({"tool_call"})) == [([5, 6], True)]
    assert _copied_words(pieces, [True] * 7) == [([4], False), ([5, 6], True)]


class Oracle:
    """Logits [1,T,V] that predict every next token (`right`), or always token 0 (the last row: token 0)."""
    device = torch.device("cpu")

    def __init__(self, vocab: int, right: bool = True) -> None:
        self.vocab, self.right = vocab, right

    def __call__(self, ids):
        logits = torch.zeros(1, ids.shape[1], self.vocab)
        if self.right:
            logits[0, torch.arange(ids.shape[1] - 1), ids[0, 1:]] = 1.0
        return logits


def test_copy_accuracy_scores_each_assistant_token_against_the_prediction_before_it(tok):
    class Lagging(Oracle):   # off by one position: scores ~0
        def __call__(self, ids):
            return super().__call__(torch.cat([ids[:, :1], ids[:, :-1]], dim=1))

    good = scores.copy_accuracy(Oracle(tok.vocab_size), tok, count=6)["results"]
    bad = scores.copy_accuracy(Lagging(tok.vocab_size), tok, count=6)["results"]
    assert good["number_copied"]["tokens"] > 0 and good["other_copied"]["tokens"] > 0
    assert all(r["accuracy"] == 1.0 for r in good.values() if r["tokens"])
    assert bad["number_copied"]["accuracy"] < 0.5 and bad["other_copied"]["accuracy"] < 0.5
    good_words = scores.copy_accuracy(Oracle(tok.vocab_size), tok, count=6)["words"]
    assert all(w["words"] > 0 and w["accuracy"] == 1.0 for w in good_words.values())
    bad_words = scores.copy_accuracy(Lagging(tok.vocab_size), tok, count=6)["words"]
    assert all(w["accuracy"] < 0.5 for w in bad_words.values())
    good_names = scores.copy_accuracy(Oracle(tok.vocab_size), tok, count=12)["unseen_names"]
    bad_names = scores.copy_accuracy(Lagging(tok.vocab_size), tok, count=12)["unseen_names"]
    assert good_names["names"] > 0 and good_names["accuracy"] == good_names["token_accuracy"] == 1.0
    assert bad_names["names"] == good_names["names"] and bad_names["accuracy"] == 0.0


def test_unseen_name_replaces_a_stated_and_copied_name_everywhere_and_nothing_else():
    import random

    messages = [{"role": "user", "content": "What is the capital of Kaqua? Answer for Kaqua."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "capital_of", "arguments": {"country": "Kaqua"}}}]},
                {"role": "tool", "content": "Othru"},
                {"role": "assistant", "content": "The capital of Kaqua is Othru. Kaquan food is good.\nKaqua: done",
                 "tool_calls": [{"type": "function", "function": {"name": "note", "arguments": {"Kaqua": 1}}}]}]
    renamed, name = scores.with_unseen_name(messages, random.Random(0))
    text = str(renamed)
    # every string (also after a new line, which JSON text spells \n), never a key
    assert "Kaqua" not in text.replace("Kaquan", "").replace("'Kaqua': 1", "") and text.count(name) == 5
    assert "Kaquan" in text and renamed[3]["tool_calls"][0]["function"]["arguments"] == {"Kaqua": 1}
    assert name[0].isupper() and "Othru" in text and "What" in text and "Answer" in text
    # a name the assistant never repeats, or one that opens a sentence, is not a copy
    assert scores.with_unseen_name(messages[:1] + [{"role": "assistant", "content": "Othru."}], random.Random(0)) is None
    assert scores.with_unseen_name([{"role": "user", "content": "Kaqua is far."},
                                    {"role": "assistant", "content": "Kaqua"}], random.Random(0)) is None


@pytest.mark.parametrize("pool", ["train", "heldout"])
def test_turn_accuracy_scores_each_turn_after_the_last_user_message(tok, monkeypatch, pool):
    """A decoder that writes the reference turn (and the end-of-turn token) for every other prompt scores
    exactly half; each prompt is the conversation up to the turn, rendered as the template renders it
    (from the tool vocabularies of `pool`). Its other turns call a tool not offered where the reference
    calls one: those calls, and only those, count as unknown."""
    import re

    from clover.engine.sampling import SamplingParams
    from clover.engine.sequence import GenerationStats
    from clover.model.tokenizer import IM_END
    from clover.training.agent_data import training_tasks

    seen, calls, bad, asked = [], [0], [0], []

    class Echo:
        def __init__(self, model, tokenizer, max_batch_size):
            pass

        def generate(self, prompts, params):
            asked.extend(params)
            out = []
            for k, p in enumerate(prompts):
                text = tok.decode(p)
                seen.append(text)
                task, i = turns[k]
                full = tok.apply_chat_template(task.messages[: i + 1], tools=task.tools or None,
                                               add_generation_prompt=False)
                assert full.startswith(text)
                reply = full[len(text):]
                if k % 2:
                    reply = re.sub(r"<function=[^>\n]+>", "<function=not_offered>", reply) \
                        if "<function=" in reply else "wrong" + IM_END
                    bad[0] += reply.count("<function=")
                calls[0] += reply.count("<function=")
                stats = GenerationStats(generated_tokens=3, preview_forwards=1, commit_forwards=k % 2)
                out.append(type("R", (), {"text": reply, "stats": stats})())
            return out

    tasks = training_tasks("val", 6, pool)
    turns = [(t, i) for t in tasks for i, m in enumerate(t.messages)
             if m["role"] == "assistant" and i > max(j for j, x in enumerate(t.messages) if x["role"] == "user")]
    monkeypatch.setattr(scores, "Engine", Echo)
    got = scores.turn_accuracy(None, tok, count=6, split="val", pool=pool)
    assert got["turns"] == len(turns) == len(seen) > 6 and got["pool"] == pool
    assert got["exact"] == (len(turns) + 1) // 2 / len(turns)
    assert got["tool_calls"] == calls[0] and bad[0] > 0 and got["unknown_tool"] == bad[0] / calls[0]
    assert sum(f["turns"] for f in got["by_family"].values()) == len(turns)
    assert {(p.algorithm, p.max_new_tokens) for p in asked} == {("ar", 160)}
    # 3 tokens a turn; one forward for even turns, two for odd ones
    assert got["tpf"] == pytest.approx(3 * len(turns) / (len(turns) + len(turns) // 2))
    # another decoder: its settings reach the engine and the result; same_turns compares the replies written
    seen.clear(), asked.clear()
    lc = scores.turn_accuracy(None, tok, count=6, split="val", pool=pool, max_new_tokens=40,
                              decoder=SamplingParams(algorithm="low_confidence", block_size=8, threshold=0.9))
    assert {(p.algorithm, p.block_size, p.threshold, p.max_new_tokens) for p in asked} == {("low_confidence", 8, 0.9, 40)}
    assert lc["decoder"] == {"algorithm": "low_confidence", "block_size": 8, "threshold": 0.9}
    assert scores.same_turns(got, lc) == 1.0
    lc["replies"] = ["x"] * (len(turns) - 2) + lc["replies"][-2:]
    assert scores.same_turns(got, lc) == 2 / len(turns)
    with pytest.raises(ValueError, match="not of the same conversations"):
        scores.same_turns(got, {**lc, "pool": "other"})


def test_repeat_accuracy_scores_the_second_copy_after_its_first_token(tok):
    perfect = scores.repeat_accuracy(Oracle(tok.vocab_size), tok, count=5)["results"]
    assert all(r["accuracy"] == 1.0 for r in perfect.values())
    assert perfect["digits"]["tokens"] == 5 * 11          # 12 digits, the first unscored, spaces unscored
    blind = scores.repeat_accuracy(Oracle(tok.vocab_size, right=False), tok, count=5)["results"]
    assert all(r["accuracy"] == 0.0 for r in blind.values())


def test_bits_per_byte_reads_at_most_max_bytes_and_names_bad_raw_files(tmp_path):
    """--max-bytes 2000 evaluated a whole first document of 27,486 bytes; a line without "text", or one
    that is not JSON, was a KeyError or a bare decode error."""
    from clover.model.config import CloverConfig
    from clover.model.modeling import CloverForCausalLM
    from clover.model.tokenizer import Tokenizer
    from clover.training.scores import bits_per_byte

    raw = tmp_path / "raw" / "val"
    raw.mkdir(parents=True)
    text = "def f(x):\n    return x + 1\n" * 40          # 1,080 bytes a document
    (raw / "code.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for _ in range(3)))
    tok = Tokenizer.train([text], vocab_size=300)
    model = CloverForCausalLM.from_scratch(CloverConfig.preset("debug", vocab_size=512, mask_token_id=tok.mask_token_id,
                                                               eos_token_id=tok.eos_token_ids), seed=0).eval()
    r = bits_per_byte(model, tok, tmp_path, "code", "val", max_bytes=1500)
    assert r["bytes"] == 1500 and r["documents"] == 2
    (raw / "code.jsonl").write_text(json.dumps({"text": "é" * 10}) + "\n" + json.dumps({"text": "x" * 10}) + "\n")
    r = bits_per_byte(model, tok, tmp_path, "code", "val", max_bytes=5)   # the cut falls inside a character
    assert (r["bytes"], r["documents"]) == (4, 1)
    r = bits_per_byte(model, tok, tmp_path, "code", "val", max_bytes=20)   # the budget ends with a document
    assert (r["bytes"], r["documents"]) == (20, 1)
    with pytest.raises(ValueError, match="no text to score"):
        bits_per_byte(model, tok, tmp_path, "code", "val", max_bytes=1)
    (raw / "code.jsonl").write_text('{"text": "x"}\n{"name": "no text"}\n')
    with pytest.raises(ValueError, match='needs documents, each with a "text" string'):
        bits_per_byte(model, tok, tmp_path, "code", "val")
    (raw / "code.jsonl").write_text('{"text": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="code.jsonl: line 2 is not JSON"):
        bits_per_byte(model, tok, tmp_path, "code", "val")
