"""The `clover` command: one verb per job.

    clover init    DIR --preset NAME                               a checkpoint with random weights (presets)
    clover convert SRC DST                                         transformers Qwen3.5-MoE -> Clover
    clover export  SRC DST --causal                                Clover -> plain transformers (causal mode)
    clover info    DIR                                             config and parameter counts
    clover check   DIR                                             the spec's invariants, measured
    clover generate [PROMPT]                                       decode a prompt (block diffusion or AR)
    clover chat                                                    interactive multi-turn chat
    clover serve [--port 8000]                                     OpenAI-compatible server
    clover data build --out DIR                                    offline corpus, tokenizer, token shards
    clover data distill --model M --data DIR --out DIR             self-distillation data: a model's greedy outputs
    clover train --data DIR --out RUN                              AR / diffusion / SFT training, resumable
    clover plot RUN...                                             loss curves as PNG
    clover eval bpb|match|copy|turns|tasks|agent                   held-out evaluations, the agent harness
    clover bench serve --endpoint URL                              serving benchmark (TTFT, TPOT, ITL, E2EL)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from clover.cli.evaluate import add_bench_parser, add_eval_parser
from clover.cli.generate import add_chat_parser, add_generate_parser, add_serve_parser
from clover.cli.options import json_object, layout, positive_int, seed
from clover.cli.train import add_data_parser, add_plot_parser, add_train_parser
from clover.model.chat import ChatFormatError
from clover.model.checkpoint import (
    CheckpointError,
    check_checkpoint_target,
    convert_transformers_checkpoint,
    export_causal,
    load_checkpoint,
    save_checkpoint,
)
from clover.model.checks import verify_model
from clover.model.config import PRESETS, CloverConfig, ConfigError
from clover.model.modeling import CloverForCausalLM, check_gdn_init
from clover.model.tokenizer import Tokenizer, TokenizerError, stdlib_texts
from clover.training.trainer import TrainConfig


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def cmd_init(args: argparse.Namespace) -> int:
    check_checkpoint_target(args.directory, args.overwrite)
    check_gdn_init(args.gdn_gate_z, args.gdn_dt_max)   # before a tokenizer is trained
    overrides = args.override or {}
    if args.layout:
        if {"layer_types", "num_hidden_layers"} & set(overrides):
            raise ValueError("--layout sets layer_types and num_hidden_layers: drop them from --override")
        overrides = {**overrides, "layer_types": args.layout, "num_hidden_layers": len(args.layout)}
    config = CloverConfig.preset(args.preset, **overrides)
    total, _ = config.num_parameters()
    if total > 2e9 and not args.force:
        raise ValueError(f"preset {args.preset!r} has {_human(total)} parameters; pass --force to allocate it")
    tokenizer = None
    if args.tokenizer:
        tokenizer = Tokenizer.load(args.tokenizer)
    elif config.vocab_size <= 65536 and not args.no_tokenizer:
        # a byte-level BPE on standard-library source, so that text commands work on the new model
        tokenizer = Tokenizer.train(stdlib_texts(), vocab_size=config.vocab_size)
    if tokenizer is not None:
        ids = {"mask_token_id": tokenizer.mask_token_id, "eos_token_id": tokenizer.eos_token_ids}
        given = {**overrides}
        if isinstance(given.get("eos_token_id"), int):
            given["eos_token_id"] = [given["eos_token_id"]]
        for name, value in ids.items():
            if name in given and given[name] != value:
                raise ValueError(f"--override {name} {overrides[name]!r} differs from the tokenizer's {value!r}; "
                                 "drop it, or pass --no-tokenizer")
        if overrides.get("vocab_size", tokenizer.vocab_size) < tokenizer.vocab_size:
            raise ValueError(f"--override vocab_size {overrides['vocab_size']} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size} tokens")
        config = CloverConfig.preset(args.preset, **{
            **overrides, "vocab_size": max(config.vocab_size, tokenizer.vocab_size),
            "mask_token_id": tokenizer.mask_token_id, "eos_token_id": tokenizer.eos_token_ids})
    model = CloverForCausalLM.from_scratch(config, args.seed, args.gdn_gate_z, args.gdn_dt_max)
    save_checkpoint(model, args.directory, dtype=args.dtype, extra_files=tokenizer.files() if tokenizer else None)
    with_tok = (f", tokenizer of {tokenizer.vocab_size} tokens" if tokenizer else ", no tokenizer" if args.no_tokenizer
                else f", no tokenizer (none is trained for a vocabulary of {config.vocab_size:,}: give --tokenizer)")
    print(f"wrote {args.directory}: preset {args.preset}, {_human(total)} parameters, random weights "
          f"(seed {args.seed}){with_tok}")
    return 0


def _source_and_target(source: str, target: str, overwrite: bool) -> None:
    if Path(source).resolve() == Path(target).resolve():
        raise ValueError(f"the target {target} is the source: write it elsewhere")
    check_checkpoint_target(target, overwrite)


def cmd_convert(args: argparse.Namespace) -> int:
    _source_and_target(args.source, args.target, args.overwrite)
    config = convert_transformers_checkpoint(args.source, args.target, dtype=args.dtype, block_size=args.block_size,
                                             mask_token_id=args.mask_token_id, keep_mask_row=args.keep_mask_row)
    try:
        clover_source = "mask_token_id" in json.loads((Path(args.source) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        clover_source = False
    if clover_source and not args.keep_mask_row:   # (the recipe converts its AR parent, a Clover checkpoint, so)
        print(f"note: {args.source} is a Clover checkpoint; its mask token's row ({config.mask_token_id}) was reset to "
              "the mean embedding, as for an AR parent: one trained for block diffusion loses what that row learnt "
              "(--keep-mask-row keeps it)", file=sys.stderr)
    total, active = config.num_parameters()
    print(f"converted {args.source} -> {args.target}: {_human(total)} total / {_human(active)} active parameters, "
          f"block_size {config.block_size}, mask_token_id {config.mask_token_id}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    _source_and_target(args.source, args.target, args.overwrite)
    count = export_causal(args.source, args.target, dtype=None if args.dtype == "auto" else args.dtype)
    print(f"exported the causal model of {args.source} -> {args.target}: {count} tensors, a transformers "
          "Qwen3_5MoeForCausalLM checkpoint (no trust_remote_code needed)")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    model = load_checkpoint(args.directory, dtype=None)
    config = model.config
    total, active = config.num_parameters()
    counted = sum(p.numel() for p in model.parameters())
    info = {
        "directory": args.directory, "dtype": str(model.dtype).removeprefix("torch."),
        "parameters_total": counted, "parameters_active_per_token": active,
        "layers": {t: config.layer_types.count(t) for t in sorted(set(config.layer_types))},
        "config": config.to_dict(),
    }
    if counted != total:
        info["parameters_from_config"] = total
    print(json.dumps(info, indent=2))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    model = load_checkpoint(args.directory, dtype=args.dtype, device=args.device)
    report = verify_model(model, blocks=args.blocks, batch=args.batch, seed=args.seed)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.directory}: {report['dtype']} on {report['device']}, batch {report['batch']}, "
              f"{report['tokens']} tokens, block size {report['block_size']}")
        for name, err in report["errors"].items():
            verdict = "ok" if err <= report["tolerance"] else "FAIL"
            print(f"  {name:26s} max abs error {err:.2e}  (tolerance {report['tolerance']:.1e})  {verdict}")
        print(f"  causal pass {report['seconds']['causal_one_pass'] * 1e3:.1f} ms, "
              f"training forward {report['seconds']['training_forward'] * 1e3:.1f} ms")
        print("all invariants hold" if report["ok"] else "INVARIANT VIOLATED")
    return 0 if report["ok"] else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clover", description="Clover block-diffusion language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="write a checkpoint with random weights from a preset",
                       description="Write a checkpoint with random weights from a named preset.",
                       epilog="example: clover init /tmp/debug-model --preset debug")
    p.add_argument("directory")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already there")
    p.add_argument("--preset", default="debug", choices=sorted(PRESETS))
    p.add_argument("--override", type=json_object, help='JSON object of config fields to change, e.g. \'{"block_size": 16}\'')
    p.add_argument("--layout", type=layout, help="the layers' mixers, one letter per layer: L Gated DeltaNet, "
                                                 "F full attention (e.g. LFLF; default: the preset's)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=seed, default=0)
    # the GDN init options and their defaults are `clover train --init preset:NAME`'s (TrainConfig)
    p.add_argument("--gdn-gate-z", type=float, default=TrainConfig.gdn_gate_z,
                   help="open the GDN output gates to silu(z) at this mean z (default 0: the transformers-style init)")
    p.add_argument("--gdn-dt-max", type=float, default=TrainConfig.gdn_dt_max,
                   help="GDN decay steps softplus(dt_bias) log-uniform in [0.001, this] (default 0: the "
                        "transformers-style dt_bias 1)")
    p.add_argument("--force", action="store_true", help="allow presets over 2B parameters")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="DIR", help="copy the tokenizer of this directory")
    tok.add_argument("--no-tokenizer", action="store_true",
                     help="write no tokenizer (default: train a byte-level BPE on Python standard-library source, "
                          "for a vocabulary of at most 65,536; none above that)")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("convert", help="convert a transformers Qwen3.5-MoE checkpoint into a Clover one",
                       description="Convert a transformers Qwen3_5MoeForCausalLM (or multimodal Qwen3.5-MoE) "
                                   "checkpoint directory into a Clover checkpoint. Backbone weights are kept "
                                   "exactly; the new GDN parameters start at their neutral init.",
                       epilog="example: clover convert ./qwen3.5-moe-ar ./clover-from-ar --dtype bfloat16")
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already there")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--block-size", type=int, help="diffusion block size (default 32)")
    p.add_argument("--mask-token-id", type=int, help="mask token id (default: the tokenizer's mask token where SOURCE has a "
                                                          "Clover tokenizer, else the last vocabulary row)")
    p.add_argument("--keep-mask-row", action="store_true",
                   help="keep the mask token's embedding row as it is (default: the mean embedding, for an AR source)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", help="write a checkpoint's causal model as a plain transformers checkpoint",
                       description="Write the causal (autoregressive) model of a Clover checkpoint as a transformers "
                                   "Qwen3_5MoeForCausalLM checkpoint: backbone weights only (the block-diffusion "
                                   "extension is left out), with the tokenizer, chat template and generation "
                                   "config. Clover checkpoints themselves load in transformers with "
                                   "trust_remote_code=True; this one needs no remote code.",
                       epilog="example: clover export clover/weights/clover-tiny ./clover-tiny-causal --causal")
    p.add_argument("source")
    p.add_argument("target")
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint already there")
    p.add_argument("--causal", action="store_true", required=True,
                   help="export the causal mode (the only export there is; required to say so)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("info", help="print a checkpoint's config and parameter counts",
                       description="Print a checkpoint's config and parameter counts as JSON.",
                       epilog="example: clover info /tmp/debug-model")
    p.add_argument("directory")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("check", help="measure the forward-mode invariants of a checkpoint",
                       description="Load a checkpoint and measure, on random tokens, that incremental causal use "
                                   "equals one causal pass, that the training forward's clean stream equals causal "
                                   "mode, and that its noisy stream equals block previews over a causal prefill. "
                                   "Exits 2 if an error exceeds the dtype's tolerance.",
                       epilog="example: clover check /tmp/debug-model --dtype bfloat16")
    p.add_argument("directory")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--blocks", type=positive_int, default=4, help="sequence length in blocks (default 4)")
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--json", action="store_true", help="print the report as one JSON line")
    p.set_defaults(func=cmd_check)

    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    add_data_parser(sub)
    add_train_parser(sub)
    add_plot_parser(sub)
    add_eval_parser(sub)
    add_bench_parser(sub)
    return parser


def _describe(exc: BaseException) -> str:
    """What went wrong in words: an operating-system error as "PATH: reason" (not "[Errno 13] Permission
    denied: 'PATH'"), anything else as its message."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else exc.filename
        return f"{where}: {exc.strerror}" if where else exc.strerror
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    # the command as typed (`clover data build: error: ...`, not `clover data: ...`)
    name = " ".join(filter(None, (args.command, getattr(args, f"{args.command}_command", None))))
    try:
        return func(args)
    except (CheckpointError, ConfigError, TokenizerError, ChatFormatError, ValueError, OSError,
            json.JSONDecodeError) as exc:
        print(f"clover {name}: error: {_describe(exc)}", file=sys.stderr)
        return 1
    except MemoryError as exc:
        print(f"clover {name}: error: out of memory{': ' + str(exc) if str(exc) else ''} (smaller batches, "
              "sequences or models need less)", file=sys.stderr)
        return 1
    except RuntimeError as exc:   # torch's allocators raise these (torch.OutOfMemoryError is one on CUDA)
        if not any(m in str(exc) for m in ("can't allocate memory", "out of memory", "unable to mmap")):
            raise
        print(f"clover {name}: error: out of memory: {str(exc).splitlines()[0][:300]} (smaller batches, "
              "sequences or models need less)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"clover {name}: interrupted", file=sys.stderr)
        return 130

