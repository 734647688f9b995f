"""Self-check of a loaded model: the spec's invariants measured on random tokens (`clover check`).

Useful after `clover convert`, a dtype change or a new device: it reports how far the three
forward modes are from each other on this machine, with nothing but the checkpoint.
"""

from __future__ import annotations

import time

import torch

from clover.model.modeling import CloverForCausalLM

# Allowed max abs error relative to max(1, largest |logit|): fp32 sums in a different order
# between modes (observed ~1e-6); 16-bit formats carry 8-11 mantissa bits through every layer.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}


@torch.inference_mode()
def verify_model(model: CloverForCausalLM, blocks: int = 4, batch: int = 2, seed: int = 0) -> dict:
    """Measure: incremental causal == one pass; clean stream == causal; noisy block j == preview of
    block j over a causal prefill of j blocks. Returns errors, timings and a pass/fail verdict."""
    config = model.config
    b = config.block_size
    t = min(blocks * b + b // 2, config.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    high = config.vocab_size
    ids = torch.randint(0, high, (batch, t), generator=gen)
    ids = torch.where(ids == config.mask_token_id, (ids + 1) % high, ids).to(model.device)
    noise = torch.rand(batch, t, generator=gen).to(model.device) < 0.5
    noisy = torch.where(noise, torch.full_like(ids, config.mask_token_id), ids)

    model(ids[:, :b])  # warm-up: first calls pay for allocator and kernel selection
    t0 = time.perf_counter()
    full = model(ids)
    t_full = time.perf_counter() - t0
    scale = max(1.0, float(full.abs().max()))
    cache = model.new_cache(batch)
    cuts = sorted({0, 1, b // 2 + 1, *range(b, t, b), t})
    pieces = [model.causal(ids[:, a:c], cache) for a, c in zip(cuts, cuts[1:], strict=False)]
    incremental = float((torch.cat(pieces, 1) - full).abs().max())

    t0 = time.perf_counter()
    train = model.training_forward(ids, noisy)
    t_train = time.perf_counter() - t0
    clean = float((train.clean - full).abs().max())
    preview_errors = []
    for j in range(-(-t // b)):
        cache = model.new_cache(batch)
        if j:
            model.causal(ids[:, : j * b], cache, logits="none")
        block = noisy[:, j * b : (j + 1) * b]
        got = model.preview(block, cache)
        preview_errors.append(float((got - train.noisy[:, j * b : j * b + block.shape[1]]).abs().max()))

    tol = TOLERANCE.get(model.dtype, 1e-2) * scale
    errors = {"incremental_vs_one_pass": incremental, "clean_stream_vs_causal": clean,
              "noisy_stream_vs_preview": max(preview_errors)}
    return {
        "dtype": str(model.dtype).removeprefix("torch."), "device": str(model.device), "batch": batch,
        "tokens": t, "block_size": b, "max_abs_logit": scale, "tolerance": tol, "errors": errors,
        "preview_error_per_block": preview_errors,
        "seconds": {"causal_one_pass": t_full, "training_forward": t_train},
        "ok": all(e <= tol for e in errors.values()),
    }
