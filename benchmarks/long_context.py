"""Decoding speed as the context grows: tokens/s of the decode steps alone (median time between
tokens, prefill excluded) after prompts of several lengths, batch 1, `ar` (and block diffusion per
block), on the tiny preset with random weights and a context long enough for the longest prompt.
The prompt is prefilled in chunks (--max-prefill-tokens). Prints its conditions, a table, and one
JSON line last.

    python benchmarks/long_context.py [--lengths 1024,4096,16384] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from clover.config import CloverConfig
from clover.engine import Engine
from clover.model import CloverForCausalLM
from clover.sampling import SamplingParams


def decode_speed(model: CloverForCausalLM, prompt: list[int], params: SamplingParams, chunk: int) -> dict:
    """Prefill seconds, and decode tokens/s from the median gap between events (per token)."""
    engine = Engine(model, max_prefill_tokens=chunk)
    t0 = time.perf_counter()
    last, gaps, first = None, [], None
    for ev in engine.stream(prompt, params):
        now = time.perf_counter()
        if last is None:
            first = now - t0
        elif ev.token_ids:
            gaps.append((now - last) / len(ev.token_ids))
        last = now
    return {"prefill_and_first_s": first, "decode_tokens_per_s": 1 / statistics.median(gaps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--algorithms", default="ar,low_confidence")
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.manual_seed(0)
    context = max(lengths) + args.new_tokens + 64
    model = CloverForCausalLM(CloverConfig.preset("tiny", max_position_embeddings=context)).eval()
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "model": "tiny preset, random weights", "dtype": "float32",
                  "batch": 1, "context": context, "new_tokens": args.new_tokens,
                  "max_prefill_tokens": args.max_prefill_tokens, "greedy": True, "ignore_eos": True}
    print("conditions:", json.dumps(conditions))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for alg in args.algorithms.split(","):
        params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, algorithm=alg)
        decode_speed(model, torch.randint(0, 8000, (64,), generator=gen).tolist(), params, args.max_prefill_tokens)
        for n in lengths:
            r = decode_speed(model, torch.randint(0, 8000, (n,), generator=gen).tolist(), params,
                             args.max_prefill_tokens)
            rows.append({"algorithm": alg, "prompt": n, **r})
            print(f"{alg:15s} prompt {n:6d}  prefill+first {r['prefill_and_first_s']:7.2f} s  "
                  f"decode {r['decode_tokens_per_s']:7.1f} tok/s", flush=True)
    ratios = {}
    for alg in args.algorithms.split(","):
        mine = [r for r in rows if r["algorithm"] == alg]
        ratios[alg] = mine[-1]["decode_tokens_per_s"] / mine[0]["decode_tokens_per_s"]
    print(json.dumps({"benchmark": "long_context", "conditions": conditions,
                      "summary": {"longest_over_shortest_decode_speed": ratios}, "results": rows}))


if __name__ == "__main__":
    main()
