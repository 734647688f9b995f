"""Forward-pass timings of Clover's three inference passes against transformers on identical weights.

For each preset: causal prefill (per token), preview of one block over the prefilled cache (and of a
half-resolved block with every row's logits or the mask slots' only), commit
of one block (causal, extends the cache), one autoregressive step (1 token, extends the cache), and
`verify`'s check of 2, 5 and 9 tokens with the keep of half of them. The preview and the AR step are timed
in alternating rounds, which also give the preview's time over an AR step's per round (robust to this CPU's
drift between phases of a run).
transformers' Qwen3_5MoeForCausalLM runs prefill, commit (a block with past_key_values) and the AR
step on the same weights; it has no preview mode. Medians over repeats, same process and threads.
Prints its conditions, a table, and one JSON line last.

    python benchmarks/forward.py [--presets tiny,small] [--prompt 512] [--repeats 5] [--compile]
                                 [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import platform
import statistics
import time

import torch

from clover.model.checkpoint import resolve_dtype
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.testing import transformers_twin


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CHECK_WIDTHS = (2, 5, 9)   # `verify` checks of 1, 4 and 8 drafts after the pending token


@torch.inference_mode()
def bench_preset(preset: str, prompt_len: int, blocks: int, repeats: int, compiled: bool = False,
                 dtype: torch.dtype = torch.float32) -> dict:
    config = CloverConfig.preset(preset)
    torch.manual_seed(0)
    model = CloverForCausalLM(config).eval().to(dtype)
    b = config.block_size
    ids = torch.randint(0, config.vocab_size - 2, (1, prompt_len + blocks * b + 1))
    prompt, mask_block = ids[:, :prompt_len], torch.full((1, b), config.mask_token_id)

    # warm-up, then medians
    model.causal(prompt, model.new_cache(1), logits="last")
    prefill = _median_time(lambda: model.causal(prompt, model.new_cache(1), logits="last"), repeats)
    cache = model.new_cache(1)
    model.causal(prompt, cache, logits="none")

    def commits() -> list[float]:
        c = copy.deepcopy(cache)
        out = []
        for j in range(blocks):
            t0 = time.perf_counter()
            model.causal(ids[:, prompt_len + j * b: prompt_len + (j + 1) * b], c, logits="none")
            out.append(time.perf_counter() - t0)
        return out

    def ar_steps() -> list[float]:
        c = copy.deepcopy(cache)
        out = []
        for j in range(b):
            t0 = time.perf_counter()
            model.causal(ids[:, prompt_len + j: prompt_len + j + 1], c, logits="last")
            out.append(time.perf_counter() - t0)
        return out

    def checks(width: int) -> dict[str, float]:
        """`verify`'s check of `width` tokens (a pending token and drafts), then a keep of half of them."""
        check_s, keep_s = [], []
        for _ in range(repeats * blocks):
            c = copy.deepcopy(cache)
            t0 = time.perf_counter()
            _, trail = model.check(ids[:, prompt_len: prompt_len + width], c)
            t1 = time.perf_counter()
            model.keep(c, trail, [max(1, width // 2)])
            check_s.append(t1 - t0)
            keep_s.append(time.perf_counter() - t1)
        return {f"check_{width}_ms": 1e3 * statistics.median(check_s), f"keep_{width}_ms": 1e3 * statistics.median(keep_s)}

    def preview_and_steps() -> list[tuple[float, list[float]]]:
        """Rounds of one preview next to a block of AR steps. The preview and step times, and issue 11's
        ratio (the median of the per-round ratios), come from the same rounds: this CPU's speed moves by up
        to 2x between phases of a run, so medians taken in separate phases can be far apart."""
        rounds = []
        for _ in range(repeats * blocks):
            t0 = time.perf_counter()
            model.preview(mask_block, cache)
            rounds.append((time.perf_counter() - t0, ar_steps()))
        return rounds

    # a block half resolved (every other slot masked, as in the middle of low_confidence's steps): the
    # preview with every row's logits against the mask slots' only (masked_only), in alternating rounds
    half = ids[:, prompt_len: prompt_len + b].clone()
    half[:, ::2] = config.mask_token_id

    def half_rounds() -> list[tuple[float, float]]:
        out = []
        for _ in range(repeats * blocks):
            t0 = time.perf_counter()
            model.preview(half, cache)
            t1 = time.perf_counter()
            model.preview(half, cache, masked_only=True)
            out.append((t1 - t0, time.perf_counter() - t1))
        return out

    model.preview(mask_block, cache)   # warm-up
    ar_steps()
    rounds = preview_and_steps()
    halves = half_rounds()
    preview = statistics.median(p for p, _ in rounds)
    ar_step = statistics.median(t for _, steps in rounds for t in steps)
    commit = statistics.median(t for _ in range(repeats) for t in commits())
    result = {"preset": preset, "parameters_total": config.num_parameters()[0],
              "clover_prefill_ms_per_token": 1e3 * prefill / prompt_len, "clover_preview_ms": 1e3 * preview,
              "clover_commit_ms": 1e3 * commit, "clover_ar_step_ms": 1e3 * ar_step,
              "preview_over_ar_step": statistics.median(p / statistics.median(steps) for p, steps in rounds),
              "clover_preview_half_ms": 1e3 * statistics.median(f for f, _ in halves),
              "clover_preview_half_masked_only_ms": 1e3 * statistics.median(m for _, m in halves),
              "preview_half_masked_only_over_full": statistics.median(m / f for f, m in halves)}
    for width in CHECK_WIDTHS:
        checks(width)   # warm-up
        result.update({f"clover_{k}": v for k, v in checks(width).items()})
    if compiled:   # the same passes through model.compile_decode (compiled before timing)
        model.compile_decode(warmup=True)
        ar_steps()
        result["clover_ar_step_compiled_ms"] = 1e3 * statistics.median(t for _ in range(repeats) for t in ar_steps())
        model.preview(mask_block, cache)
        result["clover_preview_compiled_ms"] = 1e3 * _median_time(lambda: model.preview(mask_block, cache),
                                                                  repeats * blocks)
        for width in CHECK_WIDTHS:
            checks(width)   # compiles this width's check (and keep)
            result.update({f"clover_{k.replace('_ms', '_compiled_ms')}": v for k, v in checks(width).items()})
        model.compile_decode(False)
        result["preview_over_ar_step_compiled"] = (result["clover_preview_compiled_ms"]
                                                   / result["clover_ar_step_compiled_ms"])

    ref = transformers_twin(model)
    if ref is not None:
        ref(prompt, logits_to_keep=1)
        ref_prefill = _median_time(lambda: ref(prompt, use_cache=True, logits_to_keep=1), repeats)
        past = ref(prompt, use_cache=True, logits_to_keep=1).past_key_values

        def ref_run(step: int, count: int) -> list[float]:
            p = copy.deepcopy(past)
            out = []
            for j in range(count):
                chunk = ids[:, prompt_len + j * step: prompt_len + (j + 1) * step]
                t0 = time.perf_counter()
                p = ref(chunk, past_key_values=p, use_cache=True, logits_to_keep=1).past_key_values
                out.append(time.perf_counter() - t0)
            return out

        ref_commit = statistics.median(t for _ in range(repeats) for t in ref_run(b, blocks))
        ref_ar = statistics.median(t for _ in range(repeats) for t in ref_run(1, b))
        result.update({
            "transformers_prefill_ms_per_token": 1e3 * ref_prefill / prompt_len,
            "transformers_commit_ms": 1e3 * ref_commit, "transformers_ar_step_ms": 1e3 * ref_ar,
            "speedup_prefill": ref_prefill / prefill, "speedup_commit": ref_commit / commit,
            "speedup_ar_step": ref_ar / ar_step,
        })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--prompt", type=int, default=512, help="prefill length in tokens")
    parser.add_argument("--blocks", type=int, default=4, help="block commits timed per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time the AR step and the preview compiled (compile_decode)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and compute dtype (ours and transformers')")
    args = parser.parse_args()
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    conditions = {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(), "processor": platform.processor(),
        "torch": torch.__version__, "transformers": tf_version, "threads": torch.get_num_threads(),
        "device": "cpu", "dtype": args.dtype, "batch": 1, "prompt_tokens": args.prompt, "repeats": args.repeats,
    }
    print("conditions:", json.dumps(conditions))
    results = [bench_preset(p, args.prompt, args.blocks, args.repeats, args.compile, resolve_dtype(args.dtype))
               for p in args.presets.split(",")]
    for r in results:
        print(f"\n{r['preset']} ({r['parameters_total'] / 1e6:.1f}M parameters)")
        for key in ("prefill_ms_per_token", "preview_ms", "preview_half_ms", "preview_half_masked_only_ms",
                    "commit_ms", "ar_step_ms", "ar_step_compiled_ms",
                    "preview_compiled_ms", *(f"{kind}_{w}_{mode}ms" for mode in ("", "compiled_")
                                             for w in CHECK_WIDTHS for kind in ("check", "keep"))):
            ours, theirs = r.get(f"clover_{key}"), r.get(f"transformers_{key}")
            if ours is None:
                continue
            line = f"  {key:22s} clover {ours:9.3f}"
            if theirs is not None:
                line += f"   transformers {theirs:9.3f}   speedup {theirs / ours:5.2f}x"
            print(line)
        print(f"  {'half-masked preview':22s} mask slots' logits only / every row's: "
              f"{r['preview_half_masked_only_over_full']:.2f}x (paired rounds)")
        print(f"  {'preview / AR step':22s} {r['preview_over_ar_step']:.2f}x (paired rounds)"
              + (f"; compiled {r['preview_over_ar_step_compiled']:.2f}x (separate medians)"
                 if "preview_over_ar_step_compiled" in r else ""))
    print(json.dumps({"benchmark": "forward", "conditions": conditions, "results": results}))


if __name__ == "__main__":
    main()
