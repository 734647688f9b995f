"""Soak test of `clover serve`: concurrent streams, clients that hang up mid-stream and hostile requests
for a fixed time, on 127.0.0.1 (issue 15).

Starts the server (a subprocess on a free port) and runs `--streams` client threads for `--seconds`.
Each loop a client sends, at random: a streamed chat request read to its end (a stream that ends
without its finish chunk and [DONE] is "lost"), a streamed request it abandons after the first chunks
(a disconnect), a non-streamed completion, or a hostile request (malformed, deep or surrogate JSON,
absurd values, unknown fields, huge stop strings) that must get a 4xx, or a poisonous one (temperatures
and penalties of 1e-300) that must be answered without touching the others. Reports requests by kind and
status class, 5xx, lost streams, and the server's resident memory (RSS) after warm-up and at the end,
then /health's running and queued counts once the load stops (both must be 0). Prints its conditions
and one JSON line.

    python benchmarks/soak.py [--model DIR] [--streams 8] [--seconds 60] [--seed 0]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import threading
import time
from collections import Counter

import httpx

from clover.serving.local import serve_subprocess

# (body, whether it must be refused with a 4xx); the others are poison that must be answered alone
HOSTILE = [(b, True) for b in [
    b"{not json",
    b"[" * 50_000 + b"]" * 50_000,
    b'{"messages":[{"role":"user","content":"a\\ud800"}]}',
    b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}',
    b'{"messages":[{"role":"user","content":"x"}],"frobnicate":1}',
    b'{"messages":[{"role":"user","content":"x"}],"max_tokens":100000000}',
    b'{"messages":[{"role":"user","content":"x"}],"stop":["' + b"y" * 2000 + b'"]}',
    b'{"messages":[{"role":"user","content":"x"}],"n":1000}',
    b'{"messages":[],"tools":[{"type":"function","function":{"name":"bad name"}}]}',
    b'{"prompt":[1,2,99999999],"max_tokens":2}',
    b'{"messages":[{"role":"user","content":"x"}],"guided_regex":"("}',
]] + [(b, False) for b in [
    b'{"messages":[{"role":"user","content":"x"}],"temperature":1e-300,"max_tokens":4}',
    b'{"messages":[{"role":"user","content":"x"}],"temperature":5e-324,"max_tokens":4,"algorithm":"verify"}',
    b'{"messages":[{"role":"user","content":"x"}],"repetition_penalty":1e-300,"max_tokens":4,"temperature":1}',
]]


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _stream(client: httpx.Client, url: str, body: dict, abandon: bool) -> str:
    """'ok', 'lost' or 'abandoned' (status codes are counted by the caller through the exception)."""
    saw_finish = saw_done = False
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            raise httpx.HTTPStatusError(str(r.status_code), request=r.request, response=r)
        for i, line in enumerate(r.iter_lines()):
            if abandon and i >= 2:
                return "abandoned"
            if line == "data: [DONE]":
                saw_done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                saw_finish |= any(c.get("finish_reason") for c in event.get("choices", []))
    return "ok" if saw_finish and saw_done else "lost"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    counts: Counter = Counter()
    lock = threading.Lock()
    with serve_subprocess(["--max-batch-size", "16"] + (["--model", args.model] if args.model else [])) as (url, proc):
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, timeout=120)
        rss_start = _rss_mb(proc.pid)
        deadline = time.monotonic() + args.seconds

        def client(k: int) -> None:
            rng = random.Random(args.seed * 1000 + k)
            with httpx.Client() as c:
                while time.monotonic() < deadline:
                    kind = rng.choice(["stream", "stream", "disconnect", "completion", "hostile"])
                    body = {"messages": [{"role": "user", "content": f"Tell me about {rng.randint(0, 999)}."}],
                            "max_tokens": rng.randint(8, 48), "stream": True,
                            "algorithm": rng.choice(["low_confidence", "ar", "verify"]),
                            "chat_template_kwargs": {"enable_thinking": rng.random() < 0.5}}
                    try:
                        if kind in ("stream", "disconnect"):
                            outcome = _stream(c, url, body, abandon=kind == "disconnect")
                            status = 200
                        elif kind == "completion":
                            r = c.post(url + "/v1/completions", json={"prompt": "def f(x):", "max_tokens": 16,
                                                                      "n": rng.randint(1, 3)}, timeout=120)
                            status, outcome = r.status_code, "ok"
                        else:
                            payload, refuse = rng.choice(HOSTILE)
                            r = c.post(url + "/v1/chat/completions", content=payload,
                                       headers={"content-type": "application/json"}, timeout=120)
                            status = r.status_code
                            outcome = ("ok" if 400 <= status < 500 else "accepted") if refuse else \
                                ("answered" if status == 200 else "poison-failed")
                    except httpx.HTTPStatusError as exc:
                        status, outcome = exc.response.status_code, "error"
                    except httpx.HTTPError as exc:
                        status, outcome = 0, f"transport:{type(exc).__name__}"
                    with lock:
                        counts[(kind, status // 100 if status else 0, outcome)] += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)
        health = httpx.get(url + "/health", timeout=10).json()
        rss_end = _rss_mb(proc.pid)
    total = sum(counts.values())
    server_errors = sum(v for (_, cls, _), v in counts.items() if cls == 5)
    lost = sum(v for (_, _, outcome), v in counts.items() if outcome == "lost")
    transport = sum(v for (_, _, outcome), v in counts.items() if outcome.startswith("transport"))
    hostile_accepted = sum(v for (kind, _, outcome), v in counts.items() if outcome in ("accepted", "poison-failed"))
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                  "model": args.model or "shipped", "streams": args.streams, "seconds": args.seconds,
                  "seed": args.seed, "max_batch_size": 16}
    print("conditions:", json.dumps(conditions))
    for (kind, cls, outcome), v in sorted(counts.items()):
        print(f"{kind:>11} {cls}xx {outcome:<24} {v}")
    result = {"requests": total, "requests_per_s": total / args.seconds, "server_errors_5xx": server_errors,
              "lost_streams": lost, "transport_errors": transport, "hostile_mishandled": hostile_accepted,
              "rss_mb_after_warmup": round(rss_start, 1), "rss_mb_end": round(rss_end, 1),
              "running_after": health["running"], "queued_after": health["queued"]}
    print(json.dumps({"benchmark": "soak", "conditions": conditions, **result}))


if __name__ == "__main__":
    main()
