"""Training-step throughput: tokens/s and achieved GFLOP/s of one optimizer step (forward, backward,
AdamW, the trainer's) for a few model shapes, AR and block-diffusion objectives, fp32 against bf16 autocast,
with and without `torch.compile` of the training forward (`clover train --compile`), with and without flushing
denormals. Random token batches (the data pipeline is not timed). Medians over repeats after warm-up, same process
and threads.
The two warm-up steps also check that the loss and every gradient are finite (a fast step that does
not train is not a speed). Prints its conditions, a table, and one JSON line last.

FLOPs are counted as 6 x active parameters x tokens per stream (the noisy stream of the diffusion
objective doubles the tokens), plus attention scores; the figure says how close a step comes to the
arithmetic the machine can do, not an exact operation count.

A shape is a preset of clover/model/config.py (tiny, tiny-wide, ...) or one of SHAPES below.

    python benchmarks/train.py [--shapes tiny,tiny-wide] [--batch 8] [--seq 256] [--steps 4] [--compile]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from contextlib import nullcontext

import torch
import torch._dynamo

from clover.model.config import PRESETS, CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.training.objectives import ObjectiveConfig, compute_loss, sample_noise
from clover.training.trainer import TrainConfig, make_optimizer

# More shapes (issue 10's throughput table): overrides of the `tiny` preset.
SHAPES: dict[str, dict] = {
    "tiny-narrow": dict(hidden_size=192, moe_intermediate_size=96, shared_expert_intermediate_size=96),
    "tiny-384": dict(hidden_size=384, num_attention_heads=6, moe_intermediate_size=192,
                     shared_expert_intermediate_size=192),
    "tiny-deep": dict(num_hidden_layers=12),
    "tiny-dense-ish": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256),
    "tiny-v4k": dict(vocab_size=4096, mask_token_id=4095, eos_token_id=4094),
}


def shape_config(name: str) -> CloverConfig:
    if name in PRESETS:
        return CloverConfig.preset(name)
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; choose from {sorted(PRESETS) + sorted(SHAPES)}")
    return CloverConfig.preset("tiny", **SHAPES[name])


def step_flops(config: CloverConfig, batch: int, seq: int, objective: str) -> float:
    _, active = config.num_parameters()
    streams = 2 if objective == "diffusion" else 1
    tokens = batch * seq * streams
    attn_layers = sum(t == "full_attention" for t in config.layer_types)
    attn = 6 * 2 * attn_layers * config.num_attention_heads * config.head_dim * seq * tokens
    return 6.0 * active * tokens + attn


def bench(name: str, objective: str, dtype: str, compiled: bool, batch: int, seq: int, steps: int) -> dict:
    config = shape_config(name)
    torch.manual_seed(0)
    model = CloverForCausalLM(config).train()
    opt = make_optimizer(model, TrainConfig(data="", out="", lr=1e-3))   # the trainer's AdamW
    obj = ObjectiveConfig(objective, ar_loss_weight=1.0 if objective == "diffusion" else 0.0)
    ids = torch.randint(0, config.vocab_size - 2, (batch, seq))
    eligible = torch.ones(batch, seq, dtype=torch.bool)
    lengths = torch.full((batch,), seq)
    denominators = {"tokens": float(batch * seq), "ar_targets": float(batch * (seq - 1)), "rows": float(batch)}
    gen = torch.Generator().manual_seed(0)
    if compiled:   # what `clover train --compile` does, from a clean slate (dynamo's caches outlive a model)
        torch._dynamo.reset()
        model.compile_training()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()

    def one(check: bool = False) -> bool:
        """One optimizer step; with `check`, whether the loss and every gradient were finite."""
        noises = sample_noise(eligible, config.block_size, obj, gen) if objective == "diffusion" else None
        with ctx:
            loss, _ = compute_loss(model, ids, eligible, lengths, obj, noises, denominators)
        loss.backward()
        finite = not check or (bool(torch.isfinite(loss)) and all(
            bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None))
        opt.step()
        opt.zero_grad(set_to_none=True)
        return finite

    finite = all([one(check=True) for _ in range(2)])   # warm-up steps, checked (untimed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times)
    total, active = config.num_parameters()
    return {"shape": name, "objective": objective, "dtype": dtype, "compile": compiled, "finite_grads": finite,
            "params_total_m": total / 1e6, "params_active_m": active / 1e6, "seconds_per_step": sec,
            "tokens_per_s": batch * seq / sec, "gflops": step_flops(config, batch, seq, objective) / sec / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="tiny")
    ap.add_argument("--objectives", default="ar,diffusion")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--compile", action="store_true",
                    help="also time the compiled training forward (clover train --compile)")
    ap.add_argument("--flush-denormal", action="store_true", help="also time with torch.set_flush_denormal(True)")
    args = ap.parse_args()
    print(f"# {datetime.date.today()} {platform.machine()} {platform.processor() or ''} threads={torch.get_num_threads()} "
          f"torch {torch.__version__}; batch {args.batch} x {args.seq} tokens; median of {args.steps} steps after 2 "
          f"warm-up steps; random tokens; AdamW")
    rows = []
    for flush in ([False, True] if args.flush_denormal else [False]):
        torch.set_flush_denormal(flush)
        for shape in args.shapes.split(","):
            for objective in args.objectives.split(","):
                for dtype in args.dtypes.split(","):
                    for compiled in ([False, True] if args.compile else [False]):
                        r = bench(shape, objective, dtype, compiled, args.batch, args.seq, args.steps)
                        r["flush_denormal"] = flush
                        rows.append(r)
                        print(f"{shape:15s} {objective:9s} {dtype:8s} compile={compiled!s:5s} flush={flush!s:5s} "
                              f"{r['params_total_m']:5.1f}M/{r['params_active_m']:4.1f}M  "
                              f"{r['seconds_per_step'] * 1000:8.1f} ms  {r['tokens_per_s']:8.0f} tok/s  "
                              f"{r['gflops']:6.1f} GFLOP/s{'' if r['finite_grads'] else '  NaN/inf gradients'}",
                              flush=True)
    torch.set_flush_denormal(False)
    print(json.dumps({"benchmark": "train", "batch": args.batch, "seq": args.seq, "rows": rows}))


if __name__ == "__main__":
    main()
