"""Long contexts: decoding speed as the context grows, and what a long prompt does to other streams.

1. Tokens/s of the decode steps alone (median time between tokens, prefill excluded) after prompts
   of several lengths, batch 1, `ar` and block diffusion, prompts prefilled in chunks.
2. Eight `ar` streams decode (one token per step each) when a prompt of --arrival tokens arrives:
   the longest gap between two tokens of any stream while it is prefilled, with chunked prefill and
   without, against the longest gap before it arrived (a chunk delays each step by one chunk's time;
   without chunks one step carries the whole prefill), and against the time of the costliest chunk
   alone (the last one, over all the prompt's earlier chunks): the target is a delay of at most one
   chunk, gap while prefilled <= gap before + that chunk's time.
Tiny preset with random weights and a context long enough for the longest prompt. Prints its
conditions, a table, and one JSON line last.

    python benchmarks/long_context.py [--lengths 1024,4096,16384] [--new-tokens 48] [--arrival 8192]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from clover.engine.engine import Engine
from clover.engine.sampling import SamplingParams
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM


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


def arrival_stall(model: CloverForCausalLM, arrival: int, chunk: int | None) -> dict:
    """Longest gap between tokens of 8 running streams before and while a long prompt is prefilled."""
    engine = Engine(model, max_prefill_tokens=chunk)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=4096, ignore_eos=True, algorithm="ar")
    streams = [engine.add_request(torch.randint(0, 8000, (40,), generator=gen).tolist(), params) for _ in range(8)]
    last = dict.fromkeys(streams)
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    long_id, gaps = None, gaps_before
    for step in range(400):
        events = engine.step()
        now = time.perf_counter()
        for ev in events:
            if ev.request_id in last and ev.token_ids:
                if last[ev.request_id] is not None:
                    gaps.append(now - last[ev.request_id])
                last[ev.request_id] = now
        if any(ev.request_id == long_id and ev.token_ids for ev in events):  # its first token: prefill over
            return {"gap_before_s": max(gaps_before), "gap_during_s": max(gaps_during), "steps": step}
        if long_id is None and len(gaps_before) >= 16:
            long_id = engine.add_request(torch.randint(0, 8000, (arrival,), generator=gen).tolist(),
                                         params.with_(max_new_tokens=32))
            gaps = gaps_during
    raise RuntimeError("the long prompt did not start within 400 steps")


def last_chunk_seconds(model: CloverForCausalLM, arrival: int, chunk: int, repeats: int = 3) -> float:
    """Median time of prefilling the last `chunk` tokens of an `arrival`-token prompt over its cached
    earlier tokens, alone (batch 1): the most a chunked prefill adds to one engine step."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 8000, (1, arrival), generator=gen)
    head = arrival - chunk
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = model.new_cache(1)
            for s in range(0, head, chunk):
                model.causal(ids[:, s: min(s + chunk, head)], cache, logits="none")
            t0 = time.perf_counter()
            model.causal(ids[:, head:], cache, logits="last")
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--algorithms", default="ar,low_confidence")
    ap.add_argument("--max-prefill-tokens", type=int, default=1024)
    ap.add_argument("--arrival", type=int, default=8192, help="tokens of the prompt that arrives during 8 streams")
    args = ap.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.manual_seed(0)
    context = max(*lengths, args.arrival) + args.new_tokens + 64
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
    stall = {chunk: arrival_stall(model, args.arrival, chunk) for chunk in (args.max_prefill_tokens, None)}
    for chunk, r in stall.items():
        print(f"8 ar streams, a {args.arrival}-token prompt arrives; chunked prefill {chunk}: longest gap between "
              f"tokens before {r['gap_before_s'] * 1000:.0f} ms, while it is prefilled {r['gap_during_s'] * 1000:.0f} ms")
    one_chunk = last_chunk_seconds(model, args.arrival, args.max_prefill_tokens)
    chunked = stall[args.max_prefill_tokens]
    delay_in_chunks = (chunked["gap_during_s"] - chunked["gap_before_s"]) / one_chunk
    print(f"the costliest {args.max_prefill_tokens}-token chunk alone: {one_chunk * 1000:.0f} ms; the streams' longest "
          f"gap grew by {delay_in_chunks:.2f} chunk times (target <= 1)")
    ratios = {}
    for alg in args.algorithms.split(","):
        mine = [r for r in rows if r["algorithm"] == alg]
        ratios[alg] = mine[-1]["decode_tokens_per_s"] / mine[0]["decode_tokens_per_s"]
    print(json.dumps({"benchmark": "long_context", "conditions": conditions,
                      "summary": {"longest_over_shortest_decode_speed": ratios,
                                  "arrival_stall": {str(k): v for k, v in stall.items()},
                                  "last_chunk_alone_s": one_chunk, "stall_delay_in_chunks": delay_in_chunks}, "results": rows}))


if __name__ == "__main__":
    main()
