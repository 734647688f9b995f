"""Decoding speed: block diffusion at several thresholds and block sizes against AR decoding of the
same weights, and against transformers' greedy `generate` on the same backbone weights.

For each prompt length and batch size: tokens/s, TPF and engine overhead (wall time outside model
forwards, as a share of the total) for `ar` and `low_confidence` (every block size x threshold),
and tokens/s of transformers. Fixed output length (end-of-sequence ignored), greedy, same process.
Prints its conditions, a table, and one JSON line last.

    python benchmarks/decode.py [--model DIR] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from clover.checkpoint import CheckpointError, default_model_dir, load_checkpoint
from clover.config import CloverConfig
from clover.engine import Engine
from clover.model import CloverForCausalLM
from clover.sampling import SamplingParams
from clover.testing import transformers_twin


def _model(path: str | None) -> tuple[CloverForCausalLM, str]:
    try:
        return load_checkpoint(path or default_model_dir(), dtype="float32"), str(path or default_model_dir())
    except CheckpointError:
        if path:
            raise
        torch.manual_seed(0)
        return CloverForCausalLM(CloverConfig.preset("tiny")).eval(), "tiny preset, random weights"


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    engine.forward_seconds = 0.0
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    nfe = sum(r.stats.nfe for r in results)
    return {"tokens_per_s": tokens / wall, "tpf": tokens / nfe, "overhead": 1 - engine.forward_seconds / wall,
            "wall_s": wall, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model, else the tiny preset at random)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-lengths", default="64,1024")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9,0.95,1.0")
    parser.add_argument("--block-sizes", default="4,8,16,32")
    parser.add_argument("--quick", action="store_true", help="prompt 64, batch 1, block 32 only")
    args = parser.parse_args()
    if args.quick:
        args.prompt_lengths, args.batches, args.block_sizes = "64", "1", "32"
    model, source = _model(args.model)
    engine = Engine(model)
    ref = transformers_twin(model)
    conditions = {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": "cpu", "dtype": "float32", "model": source,
        "parameters": model.config.num_parameters()[0], "new_tokens": args.new_tokens, "greedy": True,
        "ignore_eos": True,
    }
    print("conditions:", json.dumps(conditions))
    gen = torch.Generator().manual_seed(0)
    high = min(model.config.vocab_size, model.config.mask_token_id) - 1
    rows = []
    for plen in map(int, args.prompt_lengths.split(",")):
        for batch in map(int, args.batches.split(",")):
            prompts = torch.randint(0, high, (batch, plen), generator=gen).tolist()
            base = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
            engine.generate(prompts[:1], base.with_(max_new_tokens=4))  # warm-up
            ar = _run(engine, prompts, base.with_(algorithm="ar"))
            rows.append({"prompt": plen, "batch": batch, "algorithm": "ar", **ar})
            if ref is not None:
                ids = torch.tensor(prompts)
                t0 = time.perf_counter()
                ref.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                             pad_token_id=0)
                wall = time.perf_counter() - t0
                rows.append({"prompt": plen, "batch": batch, "algorithm": "transformers_generate",
                             "tokens_per_s": batch * args.new_tokens / wall, "wall_s": wall})
            for bs in map(int, args.block_sizes.split(",")):
                for th in map(float, args.thresholds.split(",")):
                    r = _run(engine, prompts, base.with_(block_size=bs, threshold=th))
                    rows.append({"prompt": plen, "batch": batch, "algorithm": "low_confidence", "block_size": bs,
                                 "threshold": th, **r, "speedup_over_ar": r["tokens_per_s"] / ar["tokens_per_s"]})
    print(f"\n{'prompt':>6} {'batch':>5} {'algorithm':>22} {'block':>5} {'thr':>5} {'tok/s':>8} {'TPF':>6} "
          f"{'overhead':>8} {'vs AR':>6}")
    for r in rows:
        print(f"{r['prompt']:>6} {r['batch']:>5} {r['algorithm']:>22} {r.get('block_size', ''):>5} "
              f"{r.get('threshold', ''):>5} {r['tokens_per_s']:8.1f} {r.get('tpf', float('nan')):6.2f} "
              f"{100 * r.get('overhead', float('nan')):7.1f}% {r.get('speedup_over_ar', float('nan')):6.2f}")
    b1 = [r["overhead"] for r in rows if r["batch"] == 1 and "overhead" in r]
    summary = {"max_overhead_batch1": max(b1) if b1 else None,
               "best_speedup_over_ar": max((r.get("speedup_over_ar", 0) for r in rows), default=None)}
    print(json.dumps({"benchmark": "decode", "conditions": conditions, "summary": summary, "results": rows}))


if __name__ == "__main__":
    main()
