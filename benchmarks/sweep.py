"""Right-sizing the model for a CPU budget: a few shapes of the Qwen3.5-MoE family, equal wall-clock each.

Every shape is AR-pretrained from random weights on the same data mix (the recipe's), for the same
wall-clock budget, estimated: a short probe run measures its training tokens/s, and its step count
is set so that the budget holds the whole schedule (warmup, cosine decay to the end), so no shape is
cut off mid-schedule; the measured training wall time is reported next to the budget (it also holds
data loading, the final evaluation and checkpoint saves). Each is then scored on held-out validation text (bits per byte, code and English, the
same bytes for every shape). The vocabulary is the data's tokenizer for all shapes (a vocabulary
sweep needs a re-tokenised corpus per size: not done here). Prints its conditions, a table, and one
JSON line last; the model card shows the table.

    python benchmarks/sweep.py --data data [--minutes 5] [--shapes tiny,narrow-deep,...] [--out runs/sweep]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import shutil
import time
from pathlib import Path

import torch

from clover.model.checkpoint import load_checkpoint, save_checkpoint
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import Tokenizer
from clover.training import scores
from clover.training.trainer import TrainConfig, train

# Overrides of the `tiny` preset (hidden 256, 8 layers, 8 experts top-2 of width 128, head dim 64).
SHAPES: dict[str, dict] = {
    "tiny": {},
    "narrow-deep": dict(hidden_size=192, num_hidden_layers=12),
    "wide-shallow": dict(hidden_size=384, num_hidden_layers=4),
    "more-experts": dict(num_experts=16, moe_intermediate_size=64),
    "fewer-experts": dict(num_experts=4, moe_intermediate_size=256),
}
MIX = "code=0.45,english=0.25,chat=0.3"   # the recipe's pretraining mix
BATCH, SEQ_LEN, LR, WARMUP = 8, 512, 3e-3, 20


def run_shape(name: str, overrides: dict, args: argparse.Namespace, tok: Tokenizer) -> dict:
    out = Path(args.out) / name
    shutil.rmtree(out, ignore_errors=True)
    config = CloverConfig.preset("tiny", mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids,
                                 **overrides)
    if tok.vocab_size > config.vocab_size:
        raise SystemExit(f"the tokenizer has {tok.vocab_size} tokens, the shapes only {config.vocab_size}")
    torch.manual_seed(0)
    save_checkpoint(CloverForCausalLM(config), out / "init", extra_files=tok.files())
    base = TrainConfig(data=args.data, out=str(out / "probe"), init=str(out / "init"), objective="ar", mix=MIX,
                       pack=True, steps=args.probe_steps, batch_size=BATCH, seq_len=SEQ_LEN, lr=LR, warmup=WARMUP,
                       log_every=1, eval_every=10**9, eval_batches=1, save_every=10**9)
    train(base)
    log = [json.loads(line) for line in (out / "probe" / "log.jsonl").read_text().splitlines()]
    rates = sorted(r["tokens_per_s"] for r in log if r["kind"] == "train" and r["step"] > 1)  # step 1 warms up
    tokens_per_s = rates[len(rates) // 2]
    steps = max(WARMUP + 1, int(args.minutes * 60 * tokens_per_s / (BATCH * SEQ_LEN)))
    t0 = time.perf_counter()
    train(dataclasses.replace(base, out=str(out / "run"), steps=steps, log_every=10))
    wall = time.perf_counter() - t0
    model = load_checkpoint(out / "run" / "model").eval()
    bpb = {kind: scores.bits_per_byte(model, tok, args.data, kind, "val", 512, args.eval_bytes)["model_bits_per_byte"]
           for kind in ("code", "english")}
    total, active = config.num_parameters()
    return {"shape": name, "overrides": overrides, "params_total": total, "params_active": active,
            "probe_tokens_per_s": tokens_per_s, "steps": steps, "tokens": steps * BATCH * SEQ_LEN,
            "train_wall_s": wall, "wall_over_budget": wall / (args.minutes * 60), "val_bpb_code": bpb["code"],
            "val_bpb_english": bpb["english"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data")
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall-clock per shape")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--probe-steps", type=int, default=8)
    ap.add_argument("--eval-bytes", type=int, default=60_000, help="validation bytes per kind")
    ap.add_argument("--out", default="runs/sweep")
    args = ap.parse_args()
    if args.probe_steps < 3:
        ap.error("--probe-steps must be at least 3 (the first step is a warm-up)")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {sorted(SHAPES)}")
    tok = Tokenizer.load(Path(args.data) / "tokenizer")
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": "float32",
                  "minutes_per_shape": args.minutes, "batch": BATCH, "seq_len": SEQ_LEN, "lr": LR, "mix": MIX,
                  "objective": "ar", "eval": f"val split, {args.eval_bytes} bytes per kind, windows of 512"}
    print("conditions:", json.dumps(conditions))
    rows = []
    for name in args.shapes.split(","):
        r = run_shape(name, SHAPES[name], args, tok)
        rows.append(r)
        print(f"{name:14s} {r['params_total'] / 1e6:5.1f}M total {r['params_active'] / 1e6:5.1f}M active  "
              f"{r['probe_tokens_per_s']:6.0f} tok/s  {r['steps']:4d} steps  {r['train_wall_s']:5.0f} s  "
              f"val bpb code {r['val_bpb_code']:.3f} english {r['val_bpb_english']:.3f}", flush=True)
    best = min(rows, key=lambda r: r["val_bpb_code"] + r["val_bpb_english"])   # code and English added
    result = {"benchmark": "shape_sweep", "conditions": conditions, "summary": {"best": best["shape"]},
              "results": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
