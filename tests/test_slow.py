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


@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_compiled_training_forward_equals_eager(objective):
    """`compile_training`: a training step's loss and every gradient equal the eager step's up to float
    rounding (the compiled graphs sum in other orders), and passes without gradients stay eager."""
    from clover.model.modeling import CloverForCausalLM
    from clover.training.objectives import ObjectiveConfig, compute_loss, sample_noise

    config = CloverConfig.preset("debug")
    torch.manual_seed(0)
    model = CloverForCausalLM(config)
    ids = torch.randint(0, config.vocab_size - 2, (2, 64))
    eligible = torch.ones(2, 64, dtype=torch.bool)
    lengths = torch.tensor([64, 50])
    cfg = ObjectiveConfig(objective, ar_loss_weight=0.5 if objective == "diffusion" else 0.0)
    den = {"tokens": 114.0, "ar_targets": 112.0, "rows": 2.0}

    def step() -> tuple[float, dict]:
        noises = sample_noise(eligible, config.block_size, cfg, torch.Generator().manual_seed(1)) \
            if objective == "diffusion" else None
        model.zero_grad(set_to_none=True)
        loss, _ = compute_loss(model, ids, eligible, lengths, cfg, noises, den)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = step()
    model.compile_training()
    for _ in range(2):   # the first call compiles, the second runs the cached graphs
        c_loss, c_grads = step()
        assert abs(c_loss - loss) <= 1e-5 * abs(loss)
        assert c_grads.keys() == grads.keys()
        for name, g in grads.items():
            assert_close(c_grads[name], g, atol=1e-5 * max(1.0, float(g.abs().max())), what=name)
    assert model._train_ran

    def refuse(*args: object) -> None:
        raise AssertionError("a pass without gradients ran the compiled training forward")

    model._train_run = refuse
    with torch.no_grad():   # validation and decoding stay eager (a compiled pass would be a new graph)
        model.causal(ids)
