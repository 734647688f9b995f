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
the server's cache point (`Tokenizer.reply_start`) unless --no-cache-points. With --sessions N, N such
conversations take turns on one engine (turn 1 of each, then turn 2 of each...), each starting with the same
--system tokens (in a chat: a system message of their text): several agents sharing a budget and a prompt.
Prints its conditions, a table (per turn; with several sessions, tokens summed over them and TTFT their mean),
and one JSON line last (a row per request).

    python benchmarks/agent_ttft.py [--model DIR] [--turns 10] [--message 300] [--reply 32] [--algorithm ar]
                                    [--prefix-cache-bytes N] [--state-every 16,1] [--chat [--no-cache-points]]
                                    [--sessions 1] [--system 0]
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


def conversations(engine: Engine, sessions: list[list[list[int]]], params: SamplingParams,
                  tokenizer: Tokenizer | None = None, points: bool = True, system: list[int] | None = None) -> list[dict]:
    """Each session's turns, the sessions taking turns (turn 1 of each, then turn 2 of each...); each starts with the
    same `system` tokens (in a chat: a system message of their text). One row per request."""
    rows = []
    histories: list[list[int]] = [list(system or []) for _ in sessions]
    chats: list[list[dict]] = [[{"role": "system", "content": tokenizer.decode(system)}] if system and tokenizer else []
                               for _ in sessions]
    for turn in range(len(sessions[0])):
        for k, messages in enumerate(sessions):
            chat = chats[k]
            if tokenizer is None:
                prompt = histories[k] + messages[turn]
            else:
                chat.append({"role": "user", "content": tokenizer.decode(messages[turn])})
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
            rows.append({"session": k + 1, "turn": turn + 1, "prompt_tokens": len(prompt), "ttft_s": ttft,
                         "cached_tokens": cached, "total_s": time.perf_counter() - t0})
            histories[k] = prompt + reply
            if tokenizer is not None:
                chat.append({"role": "assistant",
                             "content": parse_output(tokenizer.decode(reply), thinking=False).content})
    return rows


def by_turn(rows: list[dict]) -> list[dict]:
    """Per turn over the sessions: prompt tokens and tokens restored summed, TTFT the mean."""
    out = []
    for turn in sorted({r["turn"] for r in rows}):
        these = [r for r in rows if r["turn"] == turn]
        out.append({"turn": turn, "prompt_tokens": sum(r["prompt_tokens"] for r in these),
                    "cached_tokens": sum(r["cached_tokens"] for r in these),
                    "ttft_s": sum(r["ttft_s"] for r in these) / len(these)})
    return out


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
    ap.add_argument("--sessions", type=int, default=1, help="conversations taking turns on the one engine")
    ap.add_argument("--system", type=int, default=0, help="tokens of a system prompt every session starts with")
    args = ap.parse_args()
    if args.sessions < 1 or args.turns < 1 or args.system < 0:
        ap.error("--sessions and --turns must be >= 1, --system >= 0")
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
    def draw(n: int) -> list[int]:
        return pool[torch.randint(0, len(pool), (n,), generator=gen)].tolist()
    sessions = [[draw(args.message) for _ in range(args.turns)] for _ in range(args.sessions)]
    system = draw(args.system) if args.system else None   # (drawn after the messages: one session's are as before)
    if not args.chat:
        tokenizer = None
    params = SamplingParams(max_new_tokens=args.reply, ignore_eos=True, algorithm=args.algorithm)
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "model": source, "dtype": "float32", "batch": 1,
                  "turns": args.turns, "message_tokens": args.message, "reply_tokens": args.reply,
                  "algorithm": args.algorithm, "block_size": model.config.block_size,
                  "prefix_cache_bytes": args.prefix_cache_bytes, "state_every": intervals, "chat": args.chat,
                  "cache_points": args.chat and not args.no_cache_points, "sessions": args.sessions,
                  "system_tokens": args.system}
    print("conditions:", json.dumps(conditions))
    Engine(model).generate([sessions[0][0][:64]], params.with_(max_new_tokens=2))  # warm-up
    cold_rows = conversations(Engine(model), sessions, params, tokenizer, system=system)
    warm_rows, caches = {}, {}
    for every in intervals:
        engine = Engine(model, prefix_cache_bytes=args.prefix_cache_bytes, prefix_state_every=every)
        warm_rows[every] = conversations(engine, sessions, params, tokenizer, not args.no_cache_points, system)
        caches[every] = {**engine.prefix.stats.to_dict(), "bytes_held": engine.prefix.nbytes}
    cold, warm = by_turn(cold_rows), {e: by_turn(r) for e, r in warm_rows.items()}
    head = "".join(f" {'TTFT /' + str(e):>10} {'restored':>8}" for e in intervals)
    if args.sessions > 1:
        print(f"\n{args.sessions} sessions: per turn, prompt tokens and tokens restored summed over them, TTFT the mean")
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
                      "no_cache": cold_rows, "cache": {str(e): warm_rows[e] for e in intervals}}))


if __name__ == "__main__":
    main()
