"""Helpers shared by the tests and benchmarks."""

from __future__ import annotations

import torch

from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """Fail with the max abs error, its position and the tolerance when |actual - expected| > atol + rtol |expected|."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        raise AssertionError(f"{what}: non-finite values in the result")
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    if (err > bound).any():
        worst = int(err.argmax())
        raise AssertionError(
            f"{what}: max abs error {float(err.max()):.3e} at flat index {worst} "
            f"(got {float(a.reshape(-1)[worst]):.6g}, expected {float(e.reshape(-1)[worst]):.6g}); atol {atol:g}, rtol {rtol:g}"
        )


def transformers_config(config: CloverConfig) -> object:
    """transformers' Qwen3_5MoeTextConfig with the backbone fields of `config`."""
    import transformers

    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "block_size", "mask_token_id")}
    return transformers.Qwen3_5MoeTextConfig(**fields)


def transformers_twin(model: CloverForCausalLM) -> object | None:
    """transformers' Qwen3_5MoeForCausalLM with the same backbone weights (and dtype), or None without
    transformers."""
    try:
        import transformers
    except ImportError:
        return None
    twin = transformers.Qwen3_5MoeForCausalLM(transformers_config(model.config)).eval()
    twin.load_state_dict(model.state_dict(), strict=False)
    return twin.to(model.dtype)
