"""Held-out scores of a checkpoint for its model card (`clover eval bpb`, `clover eval match`):

- `bits_per_byte`: causal (AR) likelihood of the test split's code and English documents, in bits
  per UTF-8 byte, next to gzip -9 and xz -9 on the same bytes;
- `continuation_match`: held-out code prompts, greedy continuations by `ar` and by block diffusion
  at several thresholds on the same weights: per-token agreement with the true continuation, TPF.

- `copy_accuracy`: held-out agent conversations (test seeds), teacher-forced: how often the causal
  head's next token is right on the assistant's tokens, by kind: digits of a number that stands earlier
  in the conversation (copied), of a number that does not (computed), other tokens seen earlier, others;
  and whole words copied from earlier in the conversation, in the same spelling or respelt (a space before
  the word here and none before every earlier occurrence, or the other way round: `\nOthru` is `Oth`+`ru`,
  ` Othru` is ` Oth`+`ru`); and a name the conversation copies, replaced by one no model can know;
- `repeat_accuracy`: copying outside the chat format: a random string (digits, words, made-up names)
  written twice, teacher-forced accuracy on the second copy after its first token (induction).
- `turn_accuracy`: agent conversations of a split (validation seeds by default), each assistant turn
  after the last user message generated greedily by `ar` from the conversation before it: how often the
  turn (thinking, call markup, answer) comes out exactly right, and how many of its calls name a tool
  not offered. Validation seeds, so a recipe can choose between checkpoints on it without looking at
  test seeds.

The agent tasks of the card (`clover eval tasks`) run through the evaluation harness against the model
served in process, the project's one agent loop (`clover.cli.evaluate`).
"""

from __future__ import annotations

import gzip
import lzma
import math
import random
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from clover.engine.engine import Engine
from clover.engine.sampling import SamplingParams
from clover.model.chat import parse_output
from clover.model.config import GenerationConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import EOS_TOKEN, IM_END, Tokenizer
from clover.training.data import encode_stream, read_texts

if TYPE_CHECKING:
    from clover.training.synthetic import Task

BPB_BATCH_TOKENS = 8192   # tokens per forward of `bits_per_byte`
PROMPT_TOKENS = (64, 192)  # the shortest and longest prompt of `code_prompts`


NEAR_COPY_SHARE = 0.5   # a held-out document sharing more of its distinct non-blank lines with one training document


def near_copies(data: str | Path, kind: str, docs: list[str]) -> list[int]:
    """The indices of `docs` that are near-copies of a document of the train split (more than NEAR_COPY_SHARE of
    their distinct non-blank lines in one training document: the standard library's codec tables, one per code
    page, are ~0.9 alike); none where the data has no train split of this kind."""
    def lines(text: str) -> set[str]:
        return {x for x in text.splitlines() if x.strip()}

    path = Path(data) / "raw" / "train" / f"{kind}.jsonl"
    train = [lines(t) for t in read_texts(data, "train", kind)] if path.is_file() else []
    out = []
    for i, doc in enumerate(docs):
        mine = lines(doc)
        if mine and any(len(mine & t) > NEAR_COPY_SHARE * len(mine) for t in train):
            out.append(i)
    return out


def _compressed_bpb(raw: bytes) -> dict:
    n = len(raw)
    return {"gzip9_bits_per_byte": 8 * len(gzip.compress(raw, compresslevel=9)) / n,
            "xz9_bits_per_byte": 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / n}


@torch.inference_mode()
def bits_per_byte(model: CloverForCausalLM, tok: Tokenizer, data: str | Path, kind: str, split: str = "test",
                  window: int = 512, max_bytes: int | None = None) -> dict:
    """Every token of every document is predicted, the first from an end-of-text token, in
    non-overlapping windows of `window` tokens (a window's first tokens see less context). Outside the
    train split, the same figures without the documents that are near-copies of a training one
    (`near_copies`): `without_near_copies`."""
    docs = list(read_texts(data, split, kind))
    if not docs:
        raise ValueError(f"{Path(data) / 'raw' / split / kind}.jsonl: needs documents, each with a \"text\" string")
    if max_bytes is not None:   # the documents in order, the last cut to fit
        kept, total = [], 0
        for d in docs:
            piece = d.encode()[: max_bytes - total].decode(errors="ignore")
            kept.append(piece)
            total += len(piece.encode())
            if total >= max_bytes or len(piece) < len(d):   # the budget is spent, or ends in this document
                break
        docs = kept
    eos = tok.special_ids[EOS_TOKEN]
    by_length: dict[int, list[tuple[int, np.ndarray]]] = {}   # windows of equal length run as one batch (a short
    for i, doc in enumerate(docs):                           # window is many small forwards otherwise: minutes
        ids = np.asarray([eos] + tok.encode(doc), dtype=np.int64)   # at --window 1), each with its document
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start: start + window + 1]
            by_length.setdefault(len(chunk), []).append((i, chunk))
    nll, tokens = [0.0] * len(docs), [0] * len(docs)
    for length, chunks in sorted(by_length.items()):
        rows = max(1, BPB_BATCH_TOKENS // length)
        for j in range(0, len(chunks), rows):
            part = chunks[j: j + rows]
            batch = torch.from_numpy(np.stack([c for _, c in part])).to(model.device)
            logits = model(batch[:, :-1]).float()
            per_row = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").sum(1).tolist()
            for (i, _), x in zip(part, per_row, strict=True):
                nll[i] += x
                tokens[i] += length - 1
    raw = "".join(docs).encode()
    n = len(raw)
    if n == 0:
        raise ValueError(f"{Path(data) / 'raw' / split / kind}.jsonl: no text to score (empty documents, or "
                         "--max-bytes smaller than a character)")
    out = {
        "kind": kind, "split": split, "documents": len(docs), "bytes": n, "tokens": sum(tokens),
        "model_bits_per_byte": sum(nll) / math.log(2) / n, "model_nats_per_token": sum(nll) / sum(tokens),
        **_compressed_bpb(raw),
    }
    if split != "train":
        copies = set(near_copies(data, kind, docs))
        rest = [i for i in range(len(docs)) if i not in copies]
        out["near_copies"] = len(copies)
        if copies and rest:
            raw_rest = "".join(docs[i] for i in rest).encode()
            out["without_near_copies"] = {
                "documents": len(rest), "bytes": len(raw_rest),
                "model_bits_per_byte": sum(nll[i] for i in rest) / math.log(2) / len(raw_rest),
                **_compressed_bpb(raw_rest)}
    return out


def code_prompts(tok: Tokenizer, data: str | Path, count: int, new_tokens: int, seed: int = 0,
                 split: str = "test") -> list[tuple[list[int], list[int]]]:
    """(prompt, true continuation) pairs cut at random places of the split's code documents, in `tok`'s ids
    (the model's: the documents are encoded here, as `clover data build` encodes them for its own tokenizer,
    so a model with the data's tokenizer gets the prompts of its token shard, and one with another tokenizer
    prompts it can read rather than ids that mean other tokens to it)."""
    eos = tok.special_ids[EOS_TOKEN]
    stream = np.asarray(encode_stream(tok, read_texts(data, split, "code")), dtype=np.int64)
    shortest, longest = PROMPT_TOKENS
    if len(stream) <= longest + new_tokens:
        raise ValueError(f"{Path(data) / 'raw' / split}/code.jsonl: too little code for prompts of up to {longest} "
                         f"tokens and {new_tokens} more")
    rng = random.Random(seed)
    pairs = []
    for _ in range(1000 * count):   # draws whose window crosses a document's end are drawn again
        if len(pairs) == count:
            break
        plen = rng.randint(shortest, longest)
        start = rng.randrange(0, len(stream) - plen - new_tokens)
        window = stream[start: start + plen + new_tokens].tolist()
        if eos in window:  # stay inside one document
            continue
        pairs.append((window[:plen], window[plen:]))
    if len(pairs) < count:
        raise ValueError(f"{Path(data) / 'raw' / split}/code.jsonl: too few documents long enough for a prompt of "
                         f"{shortest} to {longest} tokens and {new_tokens} more")
    return pairs


def continuation_match(model: CloverForCausalLM, tok: Tokenizer, data: str | Path, count: int = 200,
                       new_tokens: int = 64, thresholds: tuple[float, ...] = (0.7, 0.9, 0.95),
                       block_size: int | None = None, batch: int = 16, split: str = "test") -> dict:
    """Code continuations of the split (`code_prompts`) by `ar`, `low_confidence` at each threshold and
    `verify`: per-token match with the true continuation, TPF, tokens/s, and agreement with `ar`."""
    pairs = code_prompts(tok, data, count, new_tokens, split=split)
    engine = Engine(model, tok, max_batch_size=batch)
    rows = []
    base = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, block_size=block_size)
    # verify: lossless, so its tokens must equal ar's (same_as_ar checks it); what it adds is TPF
    settings = [("ar", None)] + [("low_confidence", th) for th in thresholds] + [("verify", None)]
    ar_tokens: list[list[int]] = []
    for algorithm, threshold in settings:
        params = base.with_(algorithm=algorithm, threshold=base.threshold if threshold is None else threshold)
        t0 = time.perf_counter()
        results = engine.generate([p for p, _ in pairs], params)
        wall = time.perf_counter() - t0
        match = [sum(a == b for a, b in zip(r.token_ids, truth, strict=False)) / len(truth)
                 for r, (_, truth) in zip(results, pairs, strict=True)]
        generated = sum(len(r.token_ids) for r in results)
        nfe = sum(r.stats.nfe for r in results)
        if algorithm == "ar":
            ar_tokens = [r.token_ids for r in results]
        same = sum(a == b for r, ref in zip(results, ar_tokens, strict=True)
                   for a, b in zip(r.token_ids, ref, strict=False)) / max(sum(len(ref) for ref in ar_tokens), 1)
        rows.append({"algorithm": algorithm, "threshold": threshold, "match": float(np.mean(match)),
                     "match_stderr": float(np.std(match) / math.sqrt(len(match))), "tpf": generated / nfe,
                     "tokens_per_s": generated / wall, "wall_s": wall, "same_as_ar": same})
    ar = rows[0]["match"]
    for r in rows[1:]:
        r["match_vs_ar"] = r["match"] / ar if ar else None
    return {"prompts": count, "new_tokens": new_tokens, "batch": batch, "split": split,
            "block_size": GenerationConfig.resolve_block_size(block_size, model.config), "results": rows}


COPY_KINDS = ("number_copied", "number_computed", "other_copied", "other_new")


def _token_kinds(pieces: list[str], scored: list[bool]) -> list[str | None]:
    """COPY_KINDS label of each scored token (None elsewhere) of a conversation decoded token by token.
    A token with a digit belongs to the maximal run of digits around it; the number is copied when the
    same run (not part of a longer one) stands in the text before it."""
    starts, pos = [], 0
    for piece in pieces:
        starts.append(pos)
        pos += len(piece)
    text = "".join(pieces)
    kinds: list[str | None] = []
    seen: set[str] = set()
    for i, piece in enumerate(pieces):
        if scored[i]:
            digit = next((k for k, c in enumerate(piece) if c.isdigit()), None)
            if digit is not None:
                a = b = starts[i] + digit
                while a > 0 and text[a - 1].isdigit():
                    a -= 1
                while b < len(text) and text[b].isdigit():
                    b += 1
                number = text[a:b]
                before = text[:a]
                copied = any(not before[m.start() - 1: m.start()].isdigit() and not before[m.end(): m.end() + 1].isdigit()
                             for m in re.finditer(re.escape(number), before))
                kinds.append("number_copied" if copied else "number_computed")
            else:
                kinds.append("other_copied" if piece in seen else "other_new")
        else:
            kinds.append(None)
        seen.add(piece)
    return kinds


_WORD = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z][A-Za-z0-9_]+")


def _copied_words(pieces: list[str], scored: list[bool], markup: frozenset[str] = frozenset()) -> list[
        tuple[list[int], bool]]:
    """(token indices, respelt) of each word of the scored tokens that stands earlier in the text as a whole
    word; respelt when no earlier occurrence has a space before it exactly where this one has (or lacks) one,
    so that the tokenizer starts them with different tokens and a copy must change the token it read. Words in
    `markup` (what the chat template writes itself: `function`, `parameter`, `im_end`) are format, not copies."""
    owner = [i for i, piece in enumerate(pieces) for _ in piece]
    text = "".join(pieces)
    seen: dict[str, set[bool]] = {}   # each word so far: whether a space stood before it, at each occurrence
    out = []
    for m in _WORD.finditer(text):    # (whole words: an occurrence of a word is a match of it)
        a, b = m.span()
        spaced, before = text[a - 1: a] == " ", seen.setdefault(m.group(), set())
        toks = sorted(set(owner[a:b]))
        if before and m.group() not in markup and all(scored[t] for t in toks):
            out.append((toks, spaced not in before))
        before.add(spaced)
    return out


_NAMED = re.compile(r"(?<=[a-z,] )[A-Z][a-z]{3,}(?![A-Za-z0-9_])")   # a capitalised word inside a sentence


def _whole_word(text: str) -> re.Pattern:
    """`text` where it stands as a whole word (no letter, digit or underscore on either side)."""
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(text)}(?![A-Za-z0-9_])")


def _strings(x: object) -> list[str]:
    """Every string value (not key) inside a message structure."""
    if isinstance(x, str):
        return [x]
    if isinstance(x, dict):
        return [s for v in x.values() for s in _strings(v)]
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    return []


def _renamed(x: object, word: re.Pattern, new: str) -> object:
    """The structure with `word` replaced by `new` in every string value (keys and other values unchanged)."""
    if isinstance(x, str):
        return word.sub(new, x)
    if isinstance(x, dict):
        return {k: _renamed(v, word, new) for k, v in x.items()}
    if isinstance(x, list):
        return [_renamed(v, word, new) for v in x]
    return x


def with_unseen_name(messages: list[dict], rng: random.Random) -> tuple[list[dict], str] | None:
    """The conversation with one name that its last user message states inside a sentence and an assistant turn
    repeats (a place, a country: `Kaqua`) replaced in every string of it by a made-up name of
    `recall_data.wide_name`'s 1,792 syllables (the agent data draws its names from 16), which the model cannot
    have met as a whole; None when there is no such name. The generator's own names repeat across conversations,
    so a model can write them from memory without copying; a name it has never seen can only be copied."""
    from clover.training.recall_data import wide_name

    users = [m for m in messages if m["role"] == "user"]
    said = _strings([m for m in messages if m["role"] == "assistant"])
    names = sorted({m.group() for m in _NAMED.finditer(users[-1].get("content") or "" if users else "")
                    if any(_whole_word(m.group()).search(text) for text in said)})
    if not names:
        return None
    every = "\n".join(_strings(messages))
    new = wide_name(rng).capitalize()
    while new in every:
        new = wide_name(rng).capitalize()
    return _renamed(messages, _whole_word(names[0]), new), new


@torch.inference_mode()
def copy_accuracy(model: CloverForCausalLM, tok: Tokenizer, count: int = 64, split: str = "test",
                  max_tokens: int = 2048) -> dict:
    """Teacher-forced next-token accuracy of the causal head on the assistant tokens of `count` agent
    conversations of `split` (`clover.training.agent_data`, the training pool of tool names), by
    COPY_KINDS; each conversation cut at max_tokens. `words`: whole words copied from earlier in the
    conversation (right when every token of the word is), in the same spelling or respelt (`_copied_words`).
    `unseen_names`: the same conversations with a name they copy made unknowable (`with_unseen_name`): its
    copies in assistant turns, per token and per whole name."""
    from clover.training.agent_data import training_tasks
    from clover.training.data import chat_example

    right = dict.fromkeys(COPY_KINDS, 0)
    total = dict.fromkeys(COPY_KINDS, 0)
    words = {k: [0, 0] for k in ("same_spelling", "respelt")}   # right, total
    markup = frozenset(_WORD.findall(tok.chat_template)) | {w for t in tok.special_ids for w in _WORD.findall(t)}
    names = [0, 0, 0, 0]   # whole names right, names, tokens right, tokens
    rng = random.Random(0)

    def predicted(messages: list[dict], task: Task) -> tuple[list[int], list[int], list[str], list[bool]]:
        ids, mask = chat_example(tok, messages, task.tools, task.thinking)
        ids, mask = ids[:max_tokens], mask[:max_tokens]
        pred = model(torch.tensor([ids], device=model.device))[0].argmax(-1).tolist()
        return ids, pred, [tok.decode([t]) for t in ids], [bool(m) and i > 0 for i, m in enumerate(mask)]

    for task in training_tasks(split, count):
        renamed = with_unseen_name(task.messages, rng)
        if renamed is not None:
            ids, pred, pieces, scored = predicted(renamed[0], task)
            owner = [i for i, piece in enumerate(pieces) for _ in piece]
            for m in _whole_word(renamed[1]).finditer("".join(pieces)):
                toks = sorted(set(owner[m.start():m.end()]))
                if all(scored[t] for t in toks):
                    ok = [pred[t - 1] == ids[t] for t in toks]
                    names = [names[0] + all(ok), names[1] + 1, names[2] + sum(ok), names[3] + len(ok)]
        ids, pred, pieces, scored = predicted(task.messages, task)
        for i, kind in enumerate(_token_kinds(pieces, scored)):
            if kind is not None:
                total[kind] += 1
                right[kind] += int(pred[i - 1] == ids[i])
        for toks, respelt in _copied_words(pieces, scored, markup):
            w = words["respelt" if respelt else "same_spelling"]
            w[0] += all(pred[t - 1] == ids[t] for t in toks)
            w[1] += 1
    return {"conversations": count, "split": split,
            "results": {k: {"accuracy": right[k] / total[k] if total[k] else None, "tokens": total[k]}
                        for k in COPY_KINDS},
            "words": {k: {"accuracy": r / n if n else None, "words": n} for k, (r, n) in words.items()},
            "unseen_names": {"accuracy": names[0] / names[1] if names[1] else None, "names": names[1],
                             "token_accuracy": names[2] / names[3] if names[3] else None, "tokens": names[3]}}


REPEAT_KINDS = ("digits", "words", "names")


@torch.inference_mode()
def repeat_accuracy(model: CloverForCausalLM, tok: Tokenizer, count: int = 40, seed: int = 0) -> dict:
    """Copying outside the chat format: for each kind, `count` texts "Remember this: S\nNow write it
    again: S" with S a random string (12 digits, 6 distinct words or 3 made-up names); the causal head's
    teacher-forced accuracy on the second S after its first token, where copying the first S is the only
    way to be right (a model that does not copy is near chance: 1/10 on digits); tokens that are only
    white space are not scored."""
    from clover.training import recall_data

    rng = random.Random(seed)
    make = {"digits": lambda: " ".join(rng.choice("0123456789") for _ in range(12)),
            "words": lambda: " ".join(rng.sample(recall_data.WORDS, 6)),
            "names": lambda: " ".join(recall_data.made_up_name(rng) for _ in range(3))}
    out = {}
    for kind in REPEAT_KINDS:
        right = total = 0
        for _ in range(count):
            text = make[kind]()
            prompt = f"Remember this: {text}\nNow write it again:"
            head, ids = tok.encode(prompt), tok.encode(f"{prompt} {text}")
            if ids[: len(head)] != head:
                raise ValueError("the prompt's tokens change when the copy follows")
            pred = model(torch.tensor([ids], device=model.device))[0].argmax(-1).tolist()
            # the copy's tokens after its first, less those that are only white space (between digits)
            scored = [i for i in range(len(head), len(ids)) if tok.decode([ids[i]]).strip()][1:]
            total += len(scored)
            right += sum(pred[i - 1] == ids[i] for i in scored)
        out[kind] = {"accuracy": right / total, "tokens": total}
    return {"texts_per_kind": count, "results": out}


@torch.inference_mode()
def turn_accuracy(model: CloverForCausalLM, tok: Tokenizer, count: int = 60, split: str = "val",
                  max_new_tokens: int = 160, batch: int = 16, pool: str = "train", tool_grammar: bool = False,
                  decoder: SamplingParams | None = None) -> dict:
    """Exact-match rate of greedy assistant turns (`decoder`'s algorithm, block size and threshold; default
    `ar`) on `count` agent conversations of `split`
    (`clover.training.agent_data`, as `clover data build` writes them): every assistant turn after the
    last user message, generated from the conversation before it (earlier turns are the reference's),
    compared as text up to the end of the turn; overall and by task family. `pool` "heldout": the
    everyday and lookup tools and the distractors come from the vocabularies training never uses (the
    harness's `heldout` suite draws them on test seeds), so the score measures reading unseen schemas. The pool
    seeds the conversations too (other tasks, not the same ones renamed): compare checkpoints within a pool.
    Also `tool_calls` (calls written, complete ones) and `unknown_tool`: the share of them naming a tool the
    conversation does not offer (0 when none is written). `tool_grammar`: each reply with tools under the lazy
    grammar `clover serve` applies by default (`auto_tool_calls`), so every call it opens names an offered tool.
    Also `tpf` (tokens per forward over all turns) and, per turn, the text written (`replies`), so that two
    decoders' turns can be compared with each other (`same_turns`)."""
    from clover.engine.structured import auto_tool_calls
    from clover.training.agent_data import training_tasks
    from clover.training.data import assistant_turns

    prompts, refs, families, contexts = [], [], [], []
    for task in training_tasks(split, count, pool):
        thinking = any(m.get("reasoning_content") for m in task.messages)   # as the training data renders it
        for prompt, turn in assistant_turns(tok, task.messages, task.tools or None, thinking):
            prompts.append(tok.encode(prompt))
            refs.append(turn.split(IM_END)[0].strip())
            families.append(task.family)
            contexts.append((thinking, task.tools))
    t0 = time.perf_counter()
    plain = (decoder or SamplingParams(algorithm="ar")).with_(max_new_tokens=max_new_tokens)
    params = [plain.with_(constraint=auto_tool_calls(tools, tok, thinking)) if tool_grammar and tools else plain
              for thinking, tools in contexts]
    outs = Engine(model, tokenizer=tok, max_batch_size=batch).generate(prompts, params)
    by_family: dict[str, list[bool]] = {}
    calls = unknown = 0
    replies = []
    for out, ref, family, (thinking, tools) in zip(outs, refs, families, contexts, strict=True):
        text = out.text.split(IM_END)[0]
        replies.append(text.strip())
        by_family.setdefault(family, []).append(replies[-1] == ref)
        # the calls written, and those naming a tool the conversation does not offer (any, where it offers none)
        parsed = parse_output(text, thinking, tools or None)
        offered = {t["function"]["name"] for t in tools or []}
        calls += len(parsed.tool_calls)
        unknown += sum(c.name not in offered for c in parsed.tool_calls)
    right = [ok for oks in by_family.values() for ok in oks]
    return {"conversations": count, "split": split, "pool": pool, "tool_grammar": tool_grammar, "turns": len(right), "exact": sum(right) / max(len(right), 1),
            "by_family": {f: {"exact": sum(v) / len(v), "turns": len(v)} for f, v in sorted(by_family.items())},
            "tool_calls": calls, "unknown_tool": unknown / max(calls, 1), "wall_s": time.perf_counter() - t0,
            "decoder": {"algorithm": plain.algorithm, "threshold": plain.threshold,   # (the block size that ran)
                        "block_size": None if plain.algorithm == "ar" else plain.block_size or model.config.block_size},
            "tpf": sum(o.stats.generated_tokens for o in outs) / max(sum(o.stats.nfe for o in outs), 1),
            "replies": replies}


TURNS_DRAWN = ("conversations", "split", "pool", "tool_grammar")   # what makes two turn_accuracy runs comparable


def same_turns(a: dict, b: dict) -> float:
    """The share of turns two `turn_accuracy` results (the same conversations, two decoders) wrote alike."""
    if any(a.get(k) != b.get(k) for k in (*TURNS_DRAWN, "turns")):
        raise ValueError("the two results are not of the same conversations")
    return sum(x == y for x, y in zip(a["replies"], b["replies"], strict=True)) / max(a["turns"], 1)
