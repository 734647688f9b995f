"""Serving throughput of `clover serve` under concurrent load, against one-at-a-time serving.

Starts the server (a subprocess on a free local port), then for each concurrency sends the same
set of chat requests (fixed prompts, fixed output length: end-of-sequence ignored) from that many
client threads, after one warm-up request. Reports requests/s and output tokens/s per
concurrency and the ratio to concurrency 1 (sequential serving), measured in the same run.
Prints its conditions, a table, and one JSON line last.

    python benchmarks/serve.py [--model DIR] [--requests 32] [--max-tokens 64] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--algorithm", choices=["low_confidence", "ar", "verify"], help="(default: the server's)")
    parser.add_argument("--threshold", type=float, help="(default: the server's)")
    args = parser.parse_args()
    port = _port()
    cmd = [sys.executable, "-m", "clover.cli", "serve", "--port", str(port), "--max-batch-size", "32"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        subjects = ["a stack", "a queue", "binary search", "a linked list", "merge sort", "a hash map", "a heap",
                    "a trie"]
        prompts = [f"Write a Python function for {subjects[i % len(subjects)]} (variant {i})."
                   for i in range(args.requests)]

        def request(prompt: str) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                    "ignore_eos": True, "algorithm": args.algorithm, "threshold": args.threshold,
                    "chat_template_kwargs": {"enable_thinking": False}}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        request(prompts[0])  # warm-up
        rows = []
        for conc in map(int, args.concurrency.split(",")):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=conc) as pool:
                tokens = sum(pool.map(request, prompts))
            wall = time.perf_counter() - t0
            rows.append({"concurrency": conc, "requests": args.requests, "wall_s": wall,
                         "requests_per_s": args.requests / wall, "output_tokens_per_s": tokens / wall})
        base = rows[0]["output_tokens_per_s"]
        for r in rows:
            r["throughput_vs_sequential"] = r["output_tokens_per_s"] / base
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "device": "cpu", "model": args.model or "shipped",
                  "max_tokens": args.max_tokens, "algorithm": args.algorithm, "threshold": args.threshold,
                  "ignore_eos": True, "max_batch_size": 32}
    print("conditions:", json.dumps(conditions))
    print(f"{'concurrency':>11} {'req/s':>8} {'out tok/s':>10} {'vs sequential':>14}")
    for r in rows:
        print(f"{r['concurrency']:>11} {r['requests_per_s']:8.2f} {r['output_tokens_per_s']:10.1f} "
              f"{r['throughput_vs_sequential']:13.2f}x")
    print(json.dumps({"benchmark": "serve", "conditions": conditions, "results": rows}))


if __name__ == "__main__":
    main()
