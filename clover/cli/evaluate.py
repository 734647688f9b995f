"""`clover eval` (bpb, match, copy, turns, tasks, agent) and `clover bench serve`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from clover.cli.options import (
    json_object,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
    rate,
    threshold,
    thresholds,
)
from clover.engine.sampling import ALGORITHMS, SamplingParams
from clover.model.files import check_replaceable, write_text_atomic

if TYPE_CHECKING:
    from clover.evaluation.harness import Endpoint


def parse_endpoints(urls: list[str], models: list[str], api_key: str | None) -> list[Endpoint]:
    """`--endpoint [NAME=]URL` (repeatable) with one `--model` for all or one per endpoint."""
    from clover.evaluation.harness import Endpoint

    if len(models) not in (1, len(urls)):
        raise ValueError(f"give one --model for all endpoints or one per endpoint ({len(urls)} endpoints, "
                         f"{len(models)} models)")
    out = []
    for i, spec in enumerate(urls):
        name, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--endpoint {spec!r} is not a URL; use http://HOST:PORT/v1 or NAME=http://HOST:PORT/v1")
        out.append(Endpoint(url=url, model=models[i % len(models)], name=name, api_key=api_key))
    return out


def cmd_eval_agent(args: argparse.Namespace) -> int:
    from clover.evaluation.harness import HarnessConfig, run_harness

    conditions = args.condition or [{}]
    cfg = HarnessConfig(endpoints=parse_endpoints(args.endpoint, args.model, args.api_key),
                        suites=tuple(args.suite.split(",")),
                        tasks_per_suite=args.tasks, runs=args.runs, conditions=conditions, step_limit=args.step_limit,
                        task_timeout_s=args.task_timeout, request_timeout_s=args.request_timeout,
                        max_tokens=args.max_tokens, thinking=args.thinking, split=args.split)
    summary = run_harness(cfg, args.out, resume=args.resume)
    print(json.dumps({c: {k: v for k, v in s.items() if k in ("success_mean", "reasons", "tpf", "tokens_per_s")}
                      | {"total_s_median": s["total_s"]["median"]} for c, s in summary.items()}))
    print(f"report: {Path(args.out) / 'report.md'}", file=sys.stderr)
    unmeasured = [c for c, s in summary.items() if s["quality_runs"] == 0]
    if unmeasured:   # every run of a condition failed to reach its endpoint (or the harness failed): nothing measured
        print(f"clover eval agent: error: every task run of {', '.join(unmeasured)} was an infrastructure or harness "
              f"error (see {Path(args.out) / 'results.jsonl'}); nothing measured", file=sys.stderr)
        return 1
    return 0


def turns_result(text: str) -> tuple[str, dict]:
    """(path, result): an earlier `clover eval turns --out` file, whose replies a new run is compared with."""
    try:
        value = json.loads(Path(text).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text} as JSON ({exc})") from None
    if not isinstance(value, dict) or value.get("evaluation") != "turn_accuracy" or not isinstance(value.get("replies"), list) \
            or value.get("turns") != len(value["replies"]):
        raise argparse.ArgumentTypeError(f"{text} is not a `clover eval turns --out` result with its replies")
    return text, value


def cmd_eval(args: argparse.Namespace) -> int:
    from clover.model.checkpoint import load_for_generation
    from clover.training import scores
    from clover.training.data import require_data

    if args.eval_command in ("bpb", "match"):
        require_data(args.data)
    if args.eval_command == "turns" and args.same_as:   # before minutes of decoding: the same conversations?
        asked = dict(zip(scores.TURNS_DRAWN, (args.count, args.split, args.pool, args.tool_grammar), strict=True))
        found = {k: args.same_as[1].get(k) for k in asked}
        if found != asked:
            print(f"clover eval turns: error: --same-as {args.same_as[0]} is of other conversations ({found}; "
                  f"this run: {asked})", file=sys.stderr)
            return 2
    loaded = load_for_generation(args.model, args.dtype, "cpu")
    model, tok = loaded.model, loaded.tokenizer
    if args.eval_command == "bpb":
        result = {"evaluation": "bits_per_byte", "results": [
            scores.bits_per_byte(model, tok, args.data, kind, args.split, args.window, args.max_bytes)
            for kind in args.kinds.split(",")]}
    elif args.eval_command == "copy":
        result = {"evaluation": "copy_accuracy", **scores.copy_accuracy(model, tok, args.count, args.split),
                  "repeats": scores.repeat_accuracy(model, tok)}
    elif args.eval_command == "turns":
        decoder = SamplingParams(algorithm=args.algorithm, block_size=args.block_size,
                                 **({} if args.threshold is None else {"threshold": args.threshold}))
        result = {"evaluation": "turn_accuracy",
                  **scores.turn_accuracy(model, tok, args.count, args.split, pool=args.pool,
                                         tool_grammar=args.tool_grammar, decoder=decoder)}
        if args.same_as:   # (a mismatch found only now, e.g. another generator's turns, keeps the result)
            path, earlier = args.same_as
            try:
                result["same_as"] = {"file": path, "share": scores.same_turns(result, earlier)}
            except ValueError as exc:
                result["same_as"] = {"file": path, "share": None, "error": str(exc)}
                print(f"clover eval turns: warning: --same-as {path}: {exc}", file=sys.stderr)
    elif args.eval_command == "match":
        result = {"evaluation": "continuation_match", **scores.continuation_match(
            model, tok, args.data, args.prompts, args.new_tokens, args.thresholds,
            args.block_size, args.batch, args.split)}
    else:
        result = {"evaluation": "agent_tasks", "split": args.split, "runs": _eval_tasks(args, loaded)}
    result["model"] = str(args.model or "shipped")
    result["dtype"] = str(model.dtype).removeprefix("torch.")
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=2) + "\n")   # its presence says the step is done
    summary = {k: v for k, v in result.items() if k not in ("runs", "replies")}   # (replies: in --out only)
    if "runs" in result:
        summary["runs"] = [{k: v for k, v in r.items() if k != "outcomes"} for r in result["runs"]]
    print(json.dumps(summary))
    return 0


def files_digest(paths: Iterable[Path]) -> str:
    """SHA-256 over files, in the order given: each one's name, then its bytes."""
    import hashlib

    h = hashlib.sha256()
    for f in paths:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def source_digest() -> str:
    """SHA-256 over this package's source (its .py and .jinja files): with the weights, what makes an evaluation's
    outputs what they are (the engine, server, parser, task generators and checkers)."""
    package = Path(__file__).resolve().parents[1]
    return files_digest(sorted([*package.rglob("*.py"), *package.rglob("*.jinja")]))


def weights_digest(model_dir: str | None) -> str:
    """SHA-256 over a checkpoint's config and weight files: what makes its outputs what they are."""
    from clover.model.checkpoint import default_model_dir, weight_files

    directory = Path(model_dir) if model_dir else default_model_dir()
    return files_digest(sorted([directory / "config.json", *weight_files(directory)]))


def _fresh_unless_same(root: Path, identity: dict) -> None:
    """`clover eval tasks` resumes the task runs kept next to --out only when they were made by the same
    weights and package source with the same settings; others are cleared (they would stand in for this model's
    runs)."""
    import shutil

    check_replaceable(root, "identity.json", "task runs of `clover eval tasks`")   # never a user's directory
    marker = root / "identity.json"
    try:
        same = json.loads(marker.read_text()) == identity
    except (OSError, ValueError):   # none, or unreadable: the runs cannot be told to be this model's
        same = False
    if root.is_dir() and not same:
        print(f"{root}: task runs of other weights or settings; starting afresh", file=sys.stderr)
        shutil.rmtree(root)
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(marker, json.dumps(identity, indent=2) + "\n")


def _eval_tasks(args: argparse.Namespace, loaded: object) -> list[dict]:
    """`clover eval tasks`: the harness's `synthetic` suite against the checkpoint served in process (the
    one agent loop of the project), once with thinking on and once off; the harness's run directories
    go next to --out (or into a temporary directory when there is none, or it is a stream)."""
    import tempfile

    from clover.evaluation.harness import Endpoint, HarnessConfig, run_harness
    from clover.serving.app import ServerConfig, build_app
    from clover.serving.local import serve_in_thread

    condition = {k: v for k, v in (("algorithm", args.algorithm), ("threshold", args.threshold)) if v is not None}
    decoding = loaded.generation.merged(**condition)
    app = build_app(loaded.model, loaded.tokenizer, ServerConfig("clover"), max_batch_size=1,
                    generation_defaults=loaded.generation)
    runs = []
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(app) as url:
        # (run directories go beside a file; beside a stream such as /dev/stdout they are temporary)
        beside = args.out and not (os.path.exists(args.out) and not os.path.isfile(args.out))
        root = Path(args.out + ".runs") if beside else Path(tmp)
        # (the dtype and the files that shape prompts and decoding too: a run in float32 stood in for bfloat16)
        shaping = [loaded.directory / n for n in ("generation_config.json", "chat_template.jinja", "tokenizer.json")]
        _fresh_unless_same(root, {"weights_sha256": weights_digest(args.model), "source_sha256": source_digest(),
                                  "count": args.count, "split": args.split,
                                  "step_limit": args.step_limit, "max_tokens": args.max_tokens,
                                  "condition": condition, "dtype": str(loaded.model.dtype).removeprefix("torch."),
                                  "files_sha256": files_digest([f for f in shaping if f.is_file()])})
        for thinking in [True, False] if args.thinking == "both" else [args.thinking == "on"]:
            cfg = HarnessConfig(endpoints=[Endpoint(url + "/v1", "clover")], suites=("synthetic",),
                                tasks_per_suite=args.count, runs=1, conditions=[condition], step_limit=args.step_limit,
                                max_tokens=args.max_tokens, thinking=thinking, infra_retries=0, split=args.split)
            out = root / f"thinking-{'on' if thinking else 'off'}"
            t0 = time.perf_counter()
            run_harness(cfg, out, resume=(out / "results.jsonl").is_file())
            rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()]
            runs.append({"thinking": thinking, "algorithm": decoding["algorithm"], "threshold": decoding["threshold"],
                         **tasks_outcomes(rows), "wall_s": time.perf_counter() - t0})
    return runs


def tasks_outcomes(rows: list[dict]) -> dict:
    """A `clover eval tasks` run's figures from the harness's results rows. Task runs that ended in infrastructure
    or harness errors say nothing of the model (counted as failures, they lowered its rate): they are in `reasons`
    and left out of the success rates, which are over the `measured` rest (None when nothing was measured)."""
    from clover.evaluation.harness import NOT_MEASURED
    from clover.training.synthetic import FAMILIES

    outcomes = [{"family": r["task"].split("-")[1], "seed": int(r["task"].split("-")[2]),
                 **{k: r[k] for k in ("success", "reason", "steps", "malformed", "tool_calls")}} for r in rows]
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o["reason"]] = reasons.get(o["reason"], 0) + 1
    measured = [o for o in outcomes if o["reason"] not in NOT_MEASURED]
    by_family = {f: sum(o["success"] for o in rows_) / len(rows_) for f in FAMILIES
                 if (rows_ := [o for o in measured if o["family"] == f])}
    return {"tasks": len(outcomes), "measured": len(measured),
            "success_rate": sum(o["success"] for o in measured) / len(measured) if measured else None,
            "by_family": by_family, "reasons": reasons, "outcomes": outcomes}


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out evaluations of a model (bits per byte, continuation match, copying, agent tasks)")
    esub = p.add_subparsers(dest="eval_command", required=True, metavar="EVALUATION")
    a = esub.add_parser(
        "agent", help="agent workloads (suites synthetic, tools, memory, heldout, coding, humaneval) against "
        "OpenAI-compatible endpoints",
        description="A fixed agent loop (same prompts, tools, timeouts, step limit and retry policy for every model) "
                    "over the OpenAI chat API with tools. Writes metadata, transcripts, results.jsonl, summary.json, "
                    "report.md and PNG plots to --out; --resume continues an interrupted run (same settings; --runs may "
                    "grow). Model-written code runs "
                    "in a subprocess with time and memory limits in the task's directory, inside bubblewrap "
                    "namespaces (no network, read-only elsewhere) where it is installed.",
        epilog="example: clover eval agent --endpoint http://127.0.0.1:8000/v1 --model clover-tiny --runs 3 "
               "--condition '{\"algorithm\": \"ar\"}' --condition '{\"algorithm\": \"low_confidence\", "
               "\"block_size\": 32}' --out reports/agent",
    )
    a.add_argument("--endpoint", action="append", required=True,
                   help="base URL ending in /v1, optionally NAME=URL (repeatable: endpoints side by side)")
    a.add_argument("--model", action="append", required=True, help="model name (one for all, or one per endpoint)")
    a.add_argument("--suite", default="tools,memory", help="comma-separated: synthetic, tools, memory, heldout, coding, humaneval")
    a.add_argument("--tasks", type=positive_int, help="tasks per suite (default: synthetic 100, tools 12, memory 12, heldout 12, coding 8, "
                   "humaneval all 164)")
    a.add_argument("--runs", type=positive_int, default=3)
    a.add_argument("--condition", type=json_object, action="append", default=[], help="JSON extra body fields (repeatable: a sweep)")
    a.add_argument("--step-limit", type=positive_int, default=40)
    a.add_argument("--task-timeout", type=positive_float, default=300.0, help="seconds per task")
    a.add_argument("--request-timeout", type=positive_float, default=120.0,
                   help="seconds per model request: a reply still streaming past it ends its task run as a timeout, "
                        "one that never began is an infrastructure error")
    a.add_argument("--max-tokens", type=positive_int, default=256)
    a.add_argument("--thinking", action="store_true", help="thinking on (default off)")
    a.add_argument("--split", default="test", choices=["test", "val"],
                   help="seeds of the seeded suites (all but humaneval): test (report these), or val to develop a "
                        "recipe on without tuning to the test tasks")
    a.add_argument("--api-key")
    a.add_argument("--out", required=True)
    a.add_argument("--resume", action="store_true")
    a.set_defaults(func=cmd_eval_agent)
    for name, helptext in (("bpb", "bits per byte on held-out code and English, next to gzip -9 and xz -9"),
                           ("match", "held-out code continuations: ar vs block diffusion, per-token match and TPF"),
                           ("copy", "held-out agent conversations, teacher-forced: next-token accuracy on the "
                                    "assistant's tokens, numbers copied from the conversation apart"),
                           ("turns", "agent conversations (validation seeds by default), each assistant turn after the "
                                     "last user message generated greedily (ar, or --algorithm) from the conversation before it: exact-match rate"),
                           ("tasks", "held-out synthetic agent tasks: the harness (suite synthetic) against the model served "
                                     "in process")):
        e = esub.add_parser(name, help=helptext, description=helptext + ".")
        e.add_argument("--model", help="checkpoint (default: the shipped model)")
        e.add_argument("--out", type=output_file, help="write the full result as JSON here")
        e.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                       help="compute dtype, as `clover generate --dtype` (default float32; auto: as stored)")
        if name not in ("tasks", "copy", "turns"):
            e.add_argument("--data", required=True, help="directory from `clover data build`")
        if name == "bpb":
            e.add_argument("--kinds", default="code,english")
            e.add_argument("--split", default="test", choices=["val", "test"])
            e.add_argument("--window", type=positive_int, default=512)
            e.add_argument("--max-bytes", type=positive_int, help="evaluate at most this many bytes per kind")
        elif name == "match":
            e.add_argument("--prompts", type=positive_int, default=200)
            e.add_argument("--new-tokens", type=positive_int, default=64)
            e.add_argument("--thresholds", type=thresholds, default="0.7,0.9,0.95",
                           help="comma-separated confidence thresholds in (0, 1]")
            e.add_argument("--block-size", type=positive_int)
            e.add_argument("--batch", type=positive_int, default=16)
            e.add_argument("--split", default="test", choices=["val", "test"])
        elif name == "copy":
            e.add_argument("--count", type=positive_int, default=64, help="conversations")
            e.add_argument("--split", default="test", choices=["val", "test"])
        elif name == "turns":
            e.add_argument("--count", type=positive_int, default=60, help="conversations")
            e.add_argument("--split", default="val", choices=["val", "test"])
            e.add_argument("--pool", default="train", choices=["train", "heldout"],
                           help="tool vocabularies: training's, or the held-out ones training never uses")
            e.add_argument("--tool-grammar", action="store_true",
                           help="hold each call a turn opens to the offered tools and their schemas, as `clover serve` "
                                "does by default (off: the model's own calls)")
            e.add_argument("--algorithm", default="ar", choices=list(ALGORITHMS),
                           help="the decoder that writes the turns (default ar)")
            e.add_argument("--block-size", type=positive_int, help="(block decoders; default: the model's)")
            e.add_argument("--threshold", type=threshold,
                           help="confidence threshold of low_confidence (default: the model's generation config)")
            e.add_argument("--same-as", type=turns_result, metavar="JSON",
                           help="an earlier `clover eval turns --out` of the same conversations (another decoder or "
                                "model): also report the share of turns written alike")
        else:
            e.add_argument("--count", type=positive_int, default=100)
            e.add_argument("--step-limit", type=positive_int, default=12)
            e.add_argument("--max-tokens", type=positive_int, default=160)
            e.add_argument("--thinking", default="both", choices=["on", "off", "both"])
            e.add_argument("--split", default="test", choices=["test", "val"],
                           help="task seeds: test (the model card's), or val to develop a recipe on")
            e.add_argument("--algorithm", choices=list(ALGORITHMS), help="(default: the model's generation config)")
            e.add_argument("--threshold", type=threshold, help="(default: the model's generation config)")
        e.set_defaults(func=cmd_eval)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from clover.evaluation.bench import bench_serve

    extra = args.extra_body or {}
    result = bench_serve(args.endpoint, args.model, args.num_prompts, args.input_len, args.output_len, args.concurrency,
                         args.rate, args.warmup, args.prompts_file, args.api_key, extra,
                         args.ttft_limit_ms / 1e3 if args.ttft_limit_ms else None,
                         args.tpot_limit_ms / 1e3 if args.tpot_limit_ms else None, args.seed)
    text = json.dumps(result)
    if args.out:
        write_text_atomic(args.out, text + "\n")
    summary = {k: v for k, v in result.items() if k != "per_request"}
    print(json.dumps(summary))
    return 0 if result["succeeded"] else 1


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark against an OpenAI-compatible endpoint")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    b = bsub.add_parser(
        "serve", help="TTFT, TPOT, ITL, E2EL, throughput and goodput of an OpenAI-compatible endpoint",
        description="Stream chat completions to ENDPOINT at a fixed concurrency or a Poisson rate and report TTFT, "
                    "TPOT, ITL (and raw chunk gaps), E2EL with mean / median / p90 / p99, request and token "
                    "throughput, goodput under --ttft-limit-ms / --tpot-limit-ms, and NFE / TPF from usage when the "
                    "server reports them, as JSON.",
        epilog="example: clover bench serve --endpoint http://127.0.0.1:8000/v1 --concurrency 8 --num-prompts 32 "
               "--output-len 64 --extra-body '{\"threshold\": 0.9}'",
    )
    b.add_argument("--endpoint", required=True, help="base URL ending in /v1")
    b.add_argument("--model", help="model id (default: the first of /v1/models)")
    b.add_argument("--concurrency", type=positive_int, help="requests in flight at once")
    b.add_argument("--rate", type=rate, help="Poisson arrival rate, requests per second (inf: all at once)")
    b.add_argument("--num-prompts", type=positive_int, default=32)
    b.add_argument("--input-len", type=positive_int, default=64, help="words per random prompt")
    b.add_argument("--output-len", type=positive_int, default=64, help="max_tokens per request")
    b.add_argument("--prompts-file", help="one prompt per line instead of random prompts")
    b.add_argument("--warmup", type=nonnegative_int, default=2, help="requests sent first and left out")
    b.add_argument("--ttft-limit-ms", type=positive_float)
    b.add_argument("--tpot-limit-ms", type=positive_float)
    b.add_argument("--api-key")
    b.add_argument("--extra-body", type=json_object, help="JSON merged into every request (e.g. Clover's algorithm, threshold)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", type=output_file, help="write the full result (with per-request records) here")
    b.set_defaults(func=cmd_bench_serve)
