"""Serving throughput of `clover serve` under concurrent load, against one-at-a-time serving.

Starts the server (a subprocess on a free local port), then for each concurrency runs the serving
benchmark of `clover bench serve` (`clover.evaluation.bench`: streamed chat requests, fixed prompts,
fixed output length with end-of-sequence ignored, one warm-up request) at that concurrency. Reports requests/s and output tokens/s per
concurrency and the ratio to concurrency 1 (sequential serving), measured in the same run.
Prints its conditions, a table, and one JSON line last.

    python benchmarks/serve.py [--model DIR] [--requests 32] [--max-tokens 64] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import httpx
import torch

from clover.evaluation.bench import run_bench, summarise
from clover.serving.local import serve_subprocess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--algorithm", choices=["low_confidence", "ar", "verify"], help="(default: the server's)")
    parser.add_argument("--threshold", type=float, help="(default: the server's)")
    args = parser.parse_args()
    serve_args = ["--max-batch-size", "32"] + (["--model", args.model] if args.model else [])
    with serve_subprocess(serve_args) as (url, _):
        subjects = ["a stack", "a queue", "binary search", "a linked list", "merge sort", "a hash map", "a heap",
                    "a trie"]
        prompts = [f"Write a Python function for {subjects[i % len(subjects)]} (variant {i})."
                   for i in range(args.requests + 1)]   # the first is the warm-up request
        extra = {"ignore_eos": True, "algorithm": args.algorithm, "threshold": args.threshold,
                 "chat_template_kwargs": {"enable_thinking": False}}
        extra = {k: v for k, v in extra.items() if v is not None}
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows = []
        for conc in map(int, args.concurrency.split(",")):
            # the serving benchmark of `clover bench serve`, one concurrency at a time
            out = run_bench(url + "/v1", model, prompts, args.max_tokens, conc, None, 1, None, extra, 0)
            s = summarise(out["records"], out["wall_s"], None, None)
            if s["failed"]:
                raise SystemExit(f"{s['failed']} requests failed at concurrency {conc}: {s['errors']}")
            rows.append({"concurrency": conc, "requests": args.requests, "wall_s": s["wall_s"],
                         "requests_per_s": s["request_throughput"], "output_tokens_per_s": s["output_token_throughput"],
                         "ttft_median_s": s["ttft_s"]["median"], "tpot_median_s": s["tpot_s"]["median"]})
        base = rows[0]["output_tokens_per_s"]
        for r in rows:
            r["throughput_vs_sequential"] = r["output_tokens_per_s"] / base
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "device": "cpu", "model": args.model or "shipped",
                  "max_tokens": args.max_tokens, "algorithm": args.algorithm, "threshold": args.threshold,
                  "ignore_eos": True, "max_batch_size": 32}
    print("conditions:", json.dumps(conditions))
    print(f"{'concurrency':>11} {'req/s':>8} {'out tok/s':>10} {'vs sequential':>14} {'TTFT p50':>9} {'TPOT p50':>9}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['requests_per_s']:8.2f} {r['output_tokens_per_s']:10.1f} "
              f"{r['throughput_vs_sequential']:13.2f}x {r['ttft_median_s']:8.3f}s {r['tpot_median_s']:8.4f}s")
    print(json.dumps({"benchmark": "serve", "conditions": conditions, "results": rows}))


if __name__ == "__main__":
    main()
