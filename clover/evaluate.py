"""Model-card evaluations, all on held-out data (`clover eval ...`):

- `bits_per_byte`: causal (AR) likelihood of the test split's code and English documents, in bits
  per UTF-8 byte, next to gzip -9 and xz -9 on the same bytes;
- `continuation_match`: held-out code prompts, greedy continuations by `ar` and by block diffusion
  at several thresholds on the same weights: per-token agreement with the true continuation, TPF;
- `agent_tasks`: synthetic agent tasks from the test seeds, run through the real chat template,
  engine, output parser and tools, thinking on or off: success rate and how tasks ended.
"""

from __future__ import annotations

import gzip
import json
import lzma
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from clover import synthetic
from clover.chat import parse_output
from clover.data import read_raw
from clover.engine import Engine
from clover.model import CloverForCausalLM
from clover.sampling import SamplingParams
from clover.tokenizer import EOS_TOKEN, Tokenizer


@torch.inference_mode()
def bits_per_byte(model: CloverForCausalLM, tok: Tokenizer, data: str | Path, kind: str, split: str = "test",
                  window: int = 512, max_bytes: int | None = None) -> dict:
    """Every token of every document is predicted, the first from an end-of-text token, in
    non-overlapping windows of `window` tokens (a window's first tokens see less context)."""
    docs = [d["text"] for d in read_raw(data, split, kind)]
    if max_bytes is not None:
        kept, total = [], 0
        for d in docs:
            if total >= max_bytes:
                break
            kept.append(d)
            total += len(d.encode())
        docs = kept
    eos = tok.special_ids[EOS_TOKEN]
    nll, tokens = 0.0, 0
    for doc in docs:
        ids = [eos] + tok.encode(doc)
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start: start + window + 1]], device=model.device)
            logits = model(chunk[:, :-1]).float()
            nll += float(F.cross_entropy(logits[0], chunk[0, 1:], reduction="sum"))
            tokens += chunk.shape[1] - 1
    raw = "".join(docs).encode()
    n = len(raw)
    return {
        "kind": kind, "split": split, "documents": len(docs), "bytes": n, "tokens": tokens,
        "model_bits_per_byte": nll / math.log(2) / n, "model_nats_per_token": nll / tokens,
        "gzip9_bits_per_byte": 8 * len(gzip.compress(raw, compresslevel=9)) / n,
        "xz9_bits_per_byte": 8 * len(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)) / n,
    }


def code_prompts(tok: Tokenizer, data: str | Path, count: int, new_tokens: int, seed: int = 0,
                 split: str = "test") -> list[tuple[list[int], list[int]]]:
    """(prompt, true continuation) pairs cut at random places of the split's code documents."""
    stream = np.fromfile(Path(data) / "tokens" / f"{split}_code.bin", dtype=np.uint16).astype(np.int64)
    eos = tok.special_ids[EOS_TOKEN]
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < count:
        plen = rng.randint(64, 192)
        start = rng.randrange(0, len(stream) - plen - new_tokens)
        window = stream[start: start + plen + new_tokens].tolist()
        if eos in window:  # stay inside one document
            continue
        pairs.append((window[:plen], window[plen:]))
    return pairs


def continuation_match(model: CloverForCausalLM, tok: Tokenizer, data: str | Path, count: int = 200,
                       new_tokens: int = 64, thresholds: tuple[float, ...] = (0.7, 0.9, 0.95),
                       block_size: int | None = None, batch: int = 16) -> dict:
    pairs = code_prompts(tok, data, count, new_tokens)
    engine = Engine(model, tok, max_batch_size=batch)
    rows = []
    base = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, block_size=block_size)
    settings = [("ar", None)] + [("low_confidence", th) for th in thresholds]
    for algorithm, threshold in settings:
        params = base.with_(algorithm=algorithm, threshold=base.threshold if threshold is None else threshold)
        t0 = time.perf_counter()
        results = engine.generate([p for p, _ in pairs], params)
        wall = time.perf_counter() - t0
        match = [sum(a == b for a, b in zip(r.token_ids, truth, strict=False)) / len(truth)
                 for r, (_, truth) in zip(results, pairs, strict=True)]
        generated = sum(len(r.token_ids) for r in results)
        nfe = sum(r.stats.nfe for r in results)
        rows.append({"algorithm": algorithm, "threshold": threshold, "match": float(np.mean(match)),
                     "match_stderr": float(np.std(match) / math.sqrt(len(match))), "tpf": generated / nfe,
                     "tokens_per_s": generated / wall, "wall_s": wall})
    ar = rows[0]["match"]
    for r in rows[1:]:
        r["match_vs_ar"] = r["match"] / ar if ar else None
    return {"prompts": count, "new_tokens": new_tokens, "batch": batch,
            "block_size": block_size or model.config.block_size, "results": rows}


def run_agent_task(engine: Engine, tok: Tokenizer, task: synthetic.Task, thinking: bool, params: SamplingParams,
                   max_steps: int = 12) -> dict:
    """Solve one task with the model in the loop: generate, parse, run tool calls, until an answer."""
    world = task.fresh_world()
    messages = [dict(m) for m in task.prompt_messages]
    steps, malformed, calls = 0, 0, 0
    while steps < max_steps:
        steps += 1
        prompt = tok.apply_chat_template(messages, tools=task.tools or None, enable_thinking=thinking)
        ids = tok.encode(prompt)
        if len(ids) + params.max_new_tokens > engine.config.max_position_embeddings:
            return {"success": False, "reason": "context_full", "steps": steps, "malformed": malformed, "calls": calls}
        [result] = engine.generate([ids], params)
        out = parse_output(result.text, thinking=thinking, tools=task.tools or None)
        malformed += len(out.errors)
        if out.tool_calls:
            calls += len(out.tool_calls)
            messages.append({"role": "assistant", "content": out.content, "tool_calls": [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in out.tool_calls]})
            for c in out.tool_calls:
                messages.append({"role": "tool", "content": world.call(c.name, c.arguments)})
            continue
        if out.errors:
            return {"success": False, "reason": "invalid_tool_call", "steps": steps, "malformed": malformed,
                    "calls": calls}
        ok = task.check(out.content)
        return {"success": ok, "reason": "success" if ok else "wrong_answer", "steps": steps,
                "malformed": malformed, "calls": calls, "answer": out.content[:200]}
    return {"success": False, "reason": "step_limit", "steps": steps, "malformed": malformed, "calls": calls}


def agent_tasks(model: CloverForCausalLM, tok: Tokenizer, count: int = 100, thinking: bool = True,
                params: SamplingParams | None = None, max_new_tokens: int = 160) -> dict:
    """Synthetic agent tasks (test seeds) solved with `params` (default: the decoding defaults)."""
    engine = Engine(model, tok)
    params = (params or SamplingParams()).with_(max_new_tokens=max_new_tokens)
    algorithm, threshold = params.algorithm, params.threshold
    outcomes = []
    t0 = time.perf_counter()
    for task in synthetic.tasks("test", count):
        outcomes.append({"family": task.family, "seed": task.seed,
                         **run_agent_task(engine, tok, task, thinking, params)})
    by_family = {}
    for fam in synthetic.FAMILIES:
        rows = [o for o in outcomes if o["family"] == fam]
        if rows:
            by_family[fam] = sum(o["success"] for o in rows) / len(rows)
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o["reason"]] = reasons.get(o["reason"], 0) + 1
    return {"tasks": count, "thinking": thinking, "algorithm": algorithm, "threshold": threshold,
            "success_rate": sum(o["success"] for o in outcomes) / len(outcomes), "by_family": by_family,
            "reasons": reasons, "wall_s": time.perf_counter() - t0, "outcomes": outcomes}


def dump(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    if path:
        Path(path).write_text(text + "\n")
