"""Self-distillation data for parallel decoding (issue 10; in the spirit of dParallel's certainty-forcing
distillation): the model's own greedy `ar` outputs on training prompts become the targets of its noisy
stream, so that previews agree with the causal head and whole runs of structured text (tool-call markup,
JSON arguments, boilerplate code) become confident enough to commit in one or two steps.

`build_distill_data(model, data, out)` writes a data directory that `clover train` reads like any other:
- chat: for training conversations (train split), the prompt up to a randomly chosen assistant turn,
  followed by the model's greedy `ar` reply to it (only the reply is scored);
- code: windows of the training code stream, each followed by the model's greedy continuation (the
  whole window is scored, as code always is);
- english, and the validation / test shards, tokenizer and manifest: links to the source directory.
Seeded; the model and the source directory decide everything.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np

from clover.engine.engine import Engine
from clover.engine.sampling import SamplingParams
from clover.model.checkpoint import load_checkpoint
from clover.model.files import write_directory
from clover.model.tokenizer import EOS_TOKEN, IM_END, Tokenizer
from clover.training.data import read_raw


def _chat_prompts(data: Path, tok: Tokenizer, count: int, rng: random.Random, max_prompt: int) -> list[list[int]]:
    rows = list(read_raw(data, "train", "chat"))
    for n, row in enumerate(rows, 1):   # (a record of another shape was a KeyError or TypeError traceback)
        msgs = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in msgs) or not isinstance(row.get("tools", []), (list, type(None))):
            raise ValueError(f"{data / 'raw' / 'train' / 'chat.jsonl'} record {n}: a chat record holds \"messages\" (a "
                             "list of objects with a \"role\") and may hold \"tools\" (a list)")
    out = []
    for row in rng.sample(rows, min(count * 2, len(rows))):
        msgs = row["messages"]
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            continue
        last_user = users[-1]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant" and i > last_user]
        if not turns:
            continue
        i = rng.choice(turns)
        thinking = "reasoning_content" in msgs[i]
        ids = tok.encode(tok.apply_chat_template(msgs[:i], tools=row.get("tools") or None, enable_thinking=thinking))
        if len(ids) <= max_prompt:
            out.append(ids)
        if len(out) == count:
            break
    return out


def build_distill_data(model_dir: str | Path, data: str | Path, out: str | Path, chat: int = 1500, code: int = 300,
                       new_tokens: int = 64, code_prompt: int = 192, batch: int = 32, seed: int = 0) -> dict:
    """Write the distillation data directory `out` (see the module docstring); returns its counts."""
    data, out = Path(data), Path(out)
    tok = Tokenizer.load(data / "tokenizer")
    model = load_checkpoint(model_dir, dtype="float32").eval()
    tok.check_model(model_dir, model.config.vocab_size, f"the data in {data}")
    engine = Engine(model, tok, max_batch_size=batch)
    eos = tok.special_ids[EOS_TOKEN]
    rng = random.Random(seed)
    limit = model.config.max_position_embeddings - new_tokens
    t0 = time.perf_counter()
    params = SamplingParams(max_new_tokens=new_tokens, algorithm="ar")
    prompts = _chat_prompts(data, tok, chat, rng, limit)
    if not prompts:   # (the data written would hold no conversation, which `train` then refuses)
        raise ValueError(f"no chat prompts in {data / 'raw' / 'train'}: distillation needs records with an assistant "
                         f"turn after a user message, whose prompt fits {limit} tokens")
    stream = np.fromfile(data / "tokens" / "train_code.bin", dtype=np.uint16).astype(np.int64)
    if len(stream) <= code_prompt:
        raise ValueError(f"{data / 'tokens' / 'train_code.bin'} holds {len(stream)} tokens: too few for code prompts "
                         f"of {code_prompt}")
    code_prompts, tries = [], 0
    while len(code_prompts) < code:
        tries += 1
        if tries > 100 * code:   # (else a stream whose every window holds an end of text loops for ever)
            raise ValueError(f"found {len(code_prompts)} of {code} code windows of {code_prompt} tokens without an end "
                             f"of text in {tries - 1} draws from {data / 'tokens' / 'train_code.bin'}")
        start = rng.randrange(0, len(stream) - code_prompt)
        window = stream[start: start + code_prompt].tolist()
        if eos not in window:
            code_prompts.append(window)
    # (every prompt drawn before any is answered: a stream without code windows fails at once, not after the chat)
    replies = engine.generate(prompts, params)
    continuations = engine.generate(code_prompts, params.with_(ignore_eos=True))

    all_ids, all_mask, offsets = [], [], [0]
    turn_end = tok.encode(IM_END + "\n")  # how the chat template closes an assistant turn
    for p, r in zip(prompts, replies, strict=True):
        reply = r.token_ids + (turn_end if r.finish_reason == "stop" else [])
        all_ids += p + reply + [eos]
        all_mask += [0] * len(p) + [1] * len(reply) + [0]
        offsets.append(len(all_ids))
    code_ids: list[int] = []
    for p, r in zip(code_prompts, continuations, strict=True):
        code_ids += p + r.token_ids + [eos]
    counts = {"train_chat": len(all_ids), "train_code": len(code_ids), "chat_examples": len(prompts),
              "code_examples": len(code_prompts), "reply_tokens": sum(len(r.token_ids) for r in replies),
              "model": str(model_dir), "source": str(data), "new_tokens": new_tokens,
              "seconds": time.perf_counter() - t0}

    def fill(tmp: Path) -> None:
        (tmp / "tokens").mkdir()
        np.savez(tmp / "tokens" / "train_chat.npz", ids=np.asarray(all_ids, dtype=np.uint16),
                 mask=np.asarray(all_mask, dtype=np.uint8), offsets=np.asarray(offsets, dtype=np.int64))
        np.asarray(code_ids, dtype=np.uint16).tofile(tmp / "tokens" / "train_code.bin")
        for f in (data / "tokens").iterdir():
            if not (tmp / "tokens" / f.name).exists() and f.name != "counts.json":
                (tmp / "tokens" / f.name).symlink_to(f.resolve())
        for name in ("tokenizer", "manifest.json", "raw"):
            (tmp / name).symlink_to((data / name).resolve())
        (tmp / "tokens" / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")

    write_directory(out, fill)
    return counts
