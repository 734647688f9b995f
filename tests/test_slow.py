"""Slow checks at the `tiny` preset's shape (run with `make test-slow`)."""

import pytest
import torch
from conftest import perturbed_model
from test_parity import clover_from, reference_model

from clover.model.config import CloverConfig
from clover.model.testing import assert_close

pytestmark = pytest.mark.slow


def test_tiny_preset_matches_transformers_and_keeps_the_invariant():
    config = CloverConfig.preset("tiny")
    ref = reference_model(config)
    model = clover_from(ref, config)
    ids = torch.randint(0, config.vocab_size, (2, 100))
    with torch.no_grad():
        assert_close(model(ids), ref(ids).logits, atol=1e-4, what="tiny logits vs transformers")
    model = perturbed_model(config)
    noisy = torch.where(torch.rand(2, 100) < 0.5, config.mask_token_id, ids)
    with torch.no_grad():
        out = model.training_forward(ids, noisy)
        for j in range(4):
            cache = model.new_cache(2)
            if j:
                model.causal(ids[:, : 32 * j], cache, logits="none")
            assert_close(model.preview(noisy[:, 32 * j : 32 * (j + 1)], cache), out.noisy[:, 32 * j : 32 * (j + 1)],
                         atol=1e-4, what=f"block {j}")

