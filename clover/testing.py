"""Helpers shared by the tests and benchmarks."""

from __future__ import annotations

import torch


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
