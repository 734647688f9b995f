"""Time to first token across the turns of an agent conversation, with and without the prefix cache.

A conversation of --turns turns: each turn's prompt is the previous prompt, the model's reply to it
and a new message of --message tokens (as an agent resends its history), so the history grows to
about turns x (message + reply) tokens. The same conversation runs on an engine without the prefix
cache and on one with it for each --state-every (GDN states after every that many blocks, besides
prompts' ends and frontiers: `clover.engine.prefix_cache`; 1: every block), in the same process; per
turn: TTFT (request added -> first token or block out), prompt tokens, tokens restored from the cache;
per cache, the bytes it holds at the end. Greedy, end-of-sequence ignored, random message tokens.
With --chat (a checkpoint with its tokenizer) the conversation goes through the chat template as the
server's does, thinking off: each message is the text of random tokens, each prompt the rendered chat
(whose history renders the replies otherwise than the model wrote them: no empty think block), with
the server's cache point (`Tokenizer.reply_start`) unless --no-cache-points.
Prints its conditions, a table, and one JSON line last.

    python benchmarks/agent_ttft.py [--model DIR] [--turns 10] [--message 300] [--reply 32] [--algorithm ar]
                                    [--prefix-cache-bytes N] [--state-every 16,1] [--chat [--no-cache-points]]
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
from clover.model.chat import parse_output
from clover.model.checkpoint import load_checkpoint
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import Tokenizer


def conversation(engine: Engine, messages: list[list[int]], params: SamplingParams, tokenizer: Tokenizer | None = None,
                 points: bool = True) -> list[dict]:
    rows, history, chat = [], [], []
    for turn, message in enumerate(messages):
        if tokenizer is None:
            prompt = history + message
        else:
            chat.append({"role": "user", "content": tokenizer.decode(message)})
            prompt = tokenizer.encode_chat(chat, enable_thinking=False)
            params = params.with_(cache_points=tokenizer.reply_start(prompt) if points else ())
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
        if tokenizer is not None:
            chat.append({"role": "assistant", "content": parse_output(tokenizer.decode(reply), thinking=False).content})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint (default: the tiny preset with random weights)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--message", type=int, default=300, help="tokens added by each new message")
    ap.add_argument("--reply", type=int, default=32, help="tokens the model writes per turn")
    ap.add_argument("--algorithm", default="ar", help="ar, low_confidence or verify")
    ap.add_argument("--prefix-cache-bytes", type=int, default=256 << 20)
    ap.add_argument("--state-every", default="16", help="comma-separated intervals of GDN states, one cache each")
    ap.add_argument("--chat", action="store_true", help="through the chat template (needs --model)")
    ap.add_argument("--no-cache-points", action="store_true", help="--chat without the server's cache points")
    args = ap.parse_args()
    if args.chat and not args.model:
        ap.error("--chat needs --model (a checkpoint with its tokenizer)")
    if args.no_cache_points and not args.chat:
        ap.error("--no-cache-points goes with --chat (only chat prompts have cache points)")
    intervals = [int(x) for x in args.state_every.split(",")]
    if args.model:
        model, source = load_checkpoint(args.model, dtype="float32"), args.model
        tokenizer = Tokenizer.load(args.model)
        specials = set(tokenizer.special_ids.values())
    else:
        torch.manual_seed(0)
        model, source = CloverForCausalLM(CloverConfig.preset("tiny")).eval(), "tiny preset, random weights"
        tokenizer, specials = None, {model.config.mask_token_id, *model.config.eos_token_ids}
    # messages of ordinary tokens (until 2026-12-07 they were drawn below min(vocabulary, mask id) - 2, which for a
    # checkpoint whose special tokens take the first ids was only special tokens); in a chat, their text
    pool = torch.tensor([i for i in range(model.config.vocab_size) if i not in specials])
    gen = torch.Generator().manual_seed(0)
    messages = [pool[torch.randint(0, len(pool), (args.message,), generator=gen)].tolist() for _ in range(args.turns)]
    if not args.chat:
        tokenizer = None
    params = SamplingParams(max_new_tokens=args.reply, ignore_eos=True, algorithm=args.algorithm)
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "model": source, "dtype": "float32", "batch": 1,
                  "turns": args.turns, "message_tokens": args.message, "reply_tokens": args.reply,
                  "algorithm": args.algorithm, "block_size": model.config.block_size,
                  "prefix_cache_bytes": args.prefix_cache_bytes, "state_every": intervals, "chat": args.chat,
                  "cache_points": args.chat and not args.no_cache_points}
    print("conditions:", json.dumps(conditions))
    Engine(model).generate([messages[0][:64]], params.with_(max_new_tokens=2))  # warm-up
    cold = conversation(Engine(model), messages, params, tokenizer)
    warm, caches = {}, {}
    for every in intervals:
        engine = Engine(model, prefix_cache_bytes=args.prefix_cache_bytes, prefix_state_every=every)
        warm[every] = conversation(engine, messages, params, tokenizer, not args.no_cache_points)
        caches[every] = {**engine.prefix.stats.to_dict(), "bytes_held": engine.prefix.nbytes}
    head = "".join(f" {'TTFT /' + str(e):>10} {'restored':>8}" for e in intervals)
    print(f"\n{'turn':>4} {'prompt':>7} {'TTFT no cache':>14}{head}")
    for t, c in enumerate(cold):
        cells = "".join(f" {warm[e][t]['ttft_s'] * 1000:>7.1f} ms {warm[e][t]['cached_tokens']:>8}" for e in intervals)
        print(f"{c['turn']:>4} {c['prompt_tokens']:>7} {c['ttft_s'] * 1000:>11.1f} ms{cells}")
    for e in intervals:
        print(f"states every {e} block(s): {caches[e]['bytes_held'] / 2**20:.1f} MiB held, "
              f"{caches[e]['snapshots']} GDN states, {caches[e]['tokens_reused']} tokens restored, "
              f"{caches[e]['evictions']} evictions")
    summary = {"last_over_first_ttft_no_cache": cold[-1]["ttft_s"] / cold[0]["ttft_s"],
               **{f"state_every_{e}": {"last_over_first_ttft_cache": warm[e][-1]["ttft_s"] / warm[e][0]["ttft_s"],
                                       "prefix_cache": caches[e]} for e in intervals}}
    print(json.dumps({"benchmark": "agent_ttft", "conditions": conditions, "summary": summary,
                      "no_cache": cold, "cache": {str(e): warm[e] for e in intervals}}))


if __name__ == "__main__":
    main()
