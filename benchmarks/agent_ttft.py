"""Time to first token across the turns of an agent conversation, with and without the prefix cache.

A conversation of --turns turns: each turn's prompt is the previous prompt, the model's reply to it
and a new message of --message tokens (as an agent resends its history), so the history grows to
about turns x (message + reply) tokens. The same conversation runs on an engine with the prefix
cache and on one without, in the same process; per turn: TTFT (request added -> first token or
block out), prompt tokens, tokens restored from the cache. Greedy, end-of-sequence ignored, random
message tokens. Prints its conditions, a table, and one JSON line last.

    python benchmarks/agent_ttft.py [--model DIR] [--turns 10] [--message 300] [--reply 32] [--algorithm ar]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from clover.engine.engine import Engine
from clover.engine.sampling import SamplingParams
from clover.model.checkpoint import load_checkpoint
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM


def conversation(engine: Engine, messages: list[list[int]], params: SamplingParams) -> list[dict]:
    rows, history = [], []
    for turn, message in enumerate(messages):
        prompt = history + message
        t0 = time.perf_counter()
        ttft, reply, cached = None, [], 0
        for ev in engine.stream(prompt, params):
            if ttft is None and ev.token_ids:
                ttft = time.perf_counter() - t0
            reply += ev.token_ids
            if ev.finished:
                cached = ev.result.stats.cached_tokens
        rows.append({"turn": turn + 1, "prompt_tokens": len(prompt), "ttft_s": ttft, "cached_tokens": cached,
                     "total_s": time.perf_counter() - t0})
        history = prompt + reply
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny preset with random weights)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--message", type=int, default=300, help="tokens added by each new message")
    ap.add_argument("--reply", type=int, default=32, help="tokens the model writes per turn")
    ap.add_argument("--algorithm", default="ar", help="ar, low_confidence or verify")
    ap.add_argument("--prefix-cache-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    if args.model:
        model, source = load_checkpoint(args.model, dtype="float32"), args.model
    else:
        torch.manual_seed(0)
        model, source = CloverForCausalLM(CloverConfig.preset("tiny")).eval(), "tiny preset, random weights"
    high = min(model.config.vocab_size, model.config.mask_token_id) - 2
    gen = torch.Generator().manual_seed(0)
    messages = [torch.randint(0, high, (args.message,), generator=gen).tolist() for _ in range(args.turns)]
    params = SamplingParams(max_new_tokens=args.reply, ignore_eos=True, algorithm=args.algorithm)
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "model": source, "dtype": "float32", "batch": 1,
                  "turns": args.turns, "message_tokens": args.message, "reply_tokens": args.reply,
                  "algorithm": args.algorithm, "block_size": model.config.block_size,
                  "prefix_cache_bytes": args.prefix_cache_bytes}
    print("conditions:", json.dumps(conditions))
    Engine(model).generate([messages[0][:64]], params.with_(max_new_tokens=2))  # warm-up
    cold = conversation(Engine(model), messages, params)
    warm_engine = Engine(model, prefix_cache_bytes=args.prefix_cache_bytes)
    warm = conversation(warm_engine, messages, params)
    print(f"\n{'turn':>4} {'prompt':>7} {'TTFT no cache':>14} {'TTFT cache':>11} {'restored':>9}")
    for c, w in zip(cold, warm, strict=True):
        print(f"{c['turn']:>4} {c['prompt_tokens']:>7} {c['ttft_s'] * 1000:>11.1f} ms {w['ttft_s'] * 1000:>8.1f} ms "
              f"{w['cached_tokens']:>9}")
    summary = {"last_over_first_ttft_cache": warm[-1]["ttft_s"] / warm[0]["ttft_s"],
               "last_over_first_ttft_no_cache": cold[-1]["ttft_s"] / cold[0]["ttft_s"],
               "prefix_cache": warm_engine.prefix.stats.to_dict(), "prefix_cache_bytes_held": warm_engine.prefix.nbytes}
    print(json.dumps({"benchmark": "agent_ttft", "conditions": conditions, "summary": summary,
                      "no_cache": cold, "cache": warm}))


if __name__ == "__main__":
    main()
