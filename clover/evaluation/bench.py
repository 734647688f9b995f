"""`clover bench serve`: a serving benchmark for any OpenAI-compatible endpoint (spec section 8).

Requests are streamed chat completions (`clover.evaluation.client`, the harness's client) sent at a
fixed concurrency or as a Poisson process, with random or file prompts; warm-up requests are
excluded. Per request: TTFT (request sent -> first streamed text: content, reasoning or tool
arguments), E2EL (-> last event), TPOT ((E2EL - TTFT) /
(output tokens - 1), output tokens from the server's `usage`), ITL (each gap between streamed chunks
divided evenly over the tokens that chunk carries; the tokens of a chunk are the request's output
tokens shared out by the chunk's share of the text, since the OpenAI stream does not count them),
and the raw chunk gaps apart. Summaries: mean, median, p90, p99; request and token throughput;
goodput under TTFT / TPOT limits; Clover's NFE and TPF when the server reports them.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import httpx

from clover.evaluation.client import InfraError, StreamedReply, list_models, one_line, stream_chat
from clover.model.files import read_text

WORDS = ("the of and to in is that for it as with was on be by this are or an from at which but not have all "
         "code data model block token stream agent tool value list file test result time number function").split()


@dataclass
class RequestRecord:
    ok: bool
    ttft: float | None = None
    e2el: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    chunk_gaps: list[float] = field(default_factory=list)
    nfe: int | None = None
    error: str | None = None


def split_itl(gaps: list[float], chunk_chars: list[int], output_tokens: int) -> list[float]:
    """Per-token inter-token latencies: gap i is shared evenly by the tokens of chunk i, the tokens
    of each chunk being `output_tokens` shared out by its share of the characters (at least one)."""
    total = sum(chunk_chars)
    if not gaps or total == 0:
        return []
    out = []
    for gap, chars in zip(gaps, chunk_chars, strict=True):
        tokens = max(1, round(output_tokens * chars / total))
        out += [gap / tokens] * tokens
    return out


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    s = sorted(values)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {"mean": statistics.fmean(s), "median": statistics.median(s), "p90": q(0.90), "p99": q(0.99)}


def random_prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _one(client: httpx.Client, endpoint: str, body: dict, api_key: str | None) -> RequestRecord:
    """One request, measured; any failure of it (the endpoint's, a reply that cannot be read or measured) is its
    failed record, never the end of the whole benchmark."""
    try:
        return _measured(stream_chat(client, endpoint, body, api_key))
    except Exception as exc:
        return RequestRecord(ok=False, error=one_line(f"{type(exc).__name__}: {exc}"))


def _measured(reply: StreamedReply) -> RequestRecord:
    out_tokens = reply.usage.get("completion_tokens") or 0   # (null or left out: the server did not count them)
    ttft, times, chars = reply.ttft_s, reply.chunk_s, reply.chunk_chars
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    tpot = (reply.e2e_s - ttft) / (out_tokens - 1) if ttft is not None and out_tokens > 1 else None
    first_tokens = round(out_tokens * chars[0] / sum(chars)) if chars else 0  # arrive with TTFT, not in any gap
    return RequestRecord(ok=True, ttft=ttft, e2el=reply.e2e_s, output_tokens=out_tokens,
                         prompt_tokens=reply.usage.get("prompt_tokens") or 0, tpot=tpot,
                         itl=split_itl(gaps, chars[1:], out_tokens - first_tokens), chunk_gaps=gaps,
                         nfe=reply.usage.get("nfe"))


# the request fields the benchmark writes (`run_bench`), and the options that set them
BENCH_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options")
BENCH_FIELDS_HOW = "--model, --output-len, --input-len or --prompts-file; one reply per request, streamed"


def run_bench(endpoint: str, model: str, prompts: list[str], output_len: int, concurrency: int | None,
              rate: float | None, warmup: int, api_key: str | None, extra_body: dict, seed: int) -> dict:
    """Warm-up requests one at a time, then the measured ones from a thread pool: at most `concurrency`
    in flight, sent as they free up or (with `rate`) at Poisson arrival times."""
    def body(prompt: str) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
                "stream": True, "stream_options": {"include_usage": True}, **extra_body}

    measured = prompts[warmup:]
    workers = concurrency or max(len(measured), 1)
    limits = httpx.Limits(max_connections=max(workers, 8))
    with httpx.Client(limits=limits) as client, ThreadPoolExecutor(max_workers=workers) as pool:
        for p in prompts[:warmup]:
            _one(client, endpoint, body(p), api_key)
        rng = random.Random(seed)
        t0 = time.perf_counter()
        futures = []
        for i, p in enumerate(measured):
            if rate and i:   # Poisson gaps between requests (none after the last: the wall clock would hold it)
                time.sleep(rng.expovariate(rate))
            futures.append(pool.submit(_one, client, endpoint, body(p), api_key))
        records = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    return {"records": records, "wall_s": wall}


def summarise(records: list[RequestRecord], wall: float, ttft_limit: float | None, tpot_limit: float | None) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok if (ttft_limit is None or (r.ttft is not None and r.ttft <= ttft_limit))
            and (tpot_limit is None or r.tpot is None or r.tpot <= tpot_limit)]
    nfe = [r.nfe for r in ok if r.nfe]
    return {
        "requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5], "wall_s": wall,
        "request_throughput": len(ok) / wall if wall else None, "output_token_throughput": out_tokens / wall if wall else None,
        "total_output_tokens": out_tokens, "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "goodput": len(good) / wall if wall else None,
        "goodput_limits": {"ttft_s": ttft_limit, "tpot_s": tpot_limit},
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": percentiles([x for r in ok for x in r.itl]),
        "chunk_gap_s": percentiles([x for r in ok for x in r.chunk_gaps]),
        "e2el_s": percentiles([r.e2el for r in ok if r.e2el is not None]),
        "nfe_total": sum(nfe) if nfe else None,
        "tpf": (sum(r.output_tokens for r in ok if r.nfe) / sum(nfe)) if nfe else None,
    }


def served_model(endpoint: str, model: str | None, api_key: str | None) -> str:
    """`model`, or the first model id ENDPOINT/models lists; a clear error, before any request is timed, when
    the endpoint cannot be reached or (without `model`) lists none; a warning where it lists others than `model`."""
    try:
        status, models = list_models(endpoint, api_key)
    except InfraError as exc:
        raise ValueError(str(exc)) from None
    if model is None and not models:
        raise ValueError(f"{endpoint.rstrip('/')}/models listed no model (HTTP {status}); give --model")
    # a warning, not a refusal: a server that ignores the name (llama.cpp's) answers anyway; one that refuses it
    # fails each request, listed with its error
    if model is not None and models and model not in models:
        print(f"warning: {endpoint.rstrip('/')}/models lists {', '.join(map(repr, models[:5]))}, not {model!r}: "
              "check --model", file=sys.stderr)
    return model or models[0]


def bench_serve(endpoint: str, model: str | None, num_prompts: int, input_len: int, output_len: int,
                concurrency: int | None, rate: float | None, warmup: int, prompts_file: str | None,
                api_key: str | None, extra_body: dict, ttft_limit: float | None, tpot_limit: float | None,
                seed: int = 0) -> dict:
    if concurrency is None and rate is None:
        raise ValueError("give --concurrency or --rate")
    own = sorted(set(extra_body) & set(BENCH_FIELDS))
    if own:   # they would change what is measured while the conditions say otherwise
        raise ValueError(f"--extra-body may not set {own}: they decide what is measured, which the benchmark's "
                         f"options set ({BENCH_FIELDS_HOW})")
    rng = random.Random(seed)
    if prompts_file:   # (read before the endpoint is asked anything)
        lines = [x for x in read_text(prompts_file).splitlines() if x.strip()]
        if not lines:
            raise ValueError(f"{prompts_file} holds no prompts")
        # the warm-up's prompts are random ones, never the file's: a server that caches prompts would answer the
        # measured ones faster after a warm-up that sent them
        prompts = [random_prompt(rng, input_len) for _ in range(warmup)] + \
            [lines[i % len(lines)] for i in range(num_prompts)]
    else:
        prompts = [random_prompt(rng, input_len) for _ in range(num_prompts + warmup)]
    model = served_model(endpoint, model, api_key)
    out = run_bench(endpoint, model, prompts, output_len, concurrency, rate, warmup, api_key, extra_body, seed)
    summary = summarise(out["records"], out["wall_s"], ttft_limit, tpot_limit)
    return {"benchmark": "serve", "endpoint": endpoint, "model": model,
            "conditions": {"num_prompts": num_prompts, "input_words": None if prompts_file else input_len,
                           "prompts_file": prompts_file, "output_len": output_len, "concurrency": concurrency,
                           "rate": rate, "warmup": warmup, "extra_body": extra_body,
                           "date": time.strftime("%Y-%m-%d")},
            **summary, "per_request": [asdict(r) | {"itl": None} for r in out["records"]]}
