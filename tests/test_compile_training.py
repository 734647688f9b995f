"""`compile_training`: the compiled training forward against the eager one (slow: each case compiles for minutes
on 2 cores; `make test-slow`)."""

import pytest
import torch
import torch._dynamo.utils

from clover.model import moe
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.testing import assert_close
from clover.training.objectives import ObjectiveConfig, compute_loss, sample_noise

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("experts", ["dense", "grouped"])
@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_compiled_training_forward_equals_eager(objective, experts, monkeypatch):
    """A training step's loss and every gradient equal the eager step's up to float rounding (the compiled graphs
    sum in other orders); "grouped": the experts' dispatch that real training shapes take, eager between the
    compiled pieces of each layer (at this small shape the compiled pass would mix every expert). Passes without
    gradients stay eager."""
    if experts == "grouped":
        monkeypatch.setattr(moe, "_COMPILED_DENSE_WASTE", 0)
    torch._dynamo.reset()
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
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    model.compile_training()
    for _ in range(2):   # the first call compiles, the second runs the cached graphs
        c_loss, c_grads = step()
        assert abs(c_loss - loss) <= 1e-5 * abs(loss)
        assert c_grads.keys() == grads.keys()
        for name, g in grads.items():
            assert_close(c_grads[name], g, atol=1e-5 * max(1.0, float(g.abs().max())), what=name)
    # it ran compiled: one graph at least, and with the grouped experts' breaks one more per layer
    built = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    assert built >= (1 + config.num_hidden_layers if experts == "grouped" else 1), built
    assert model._train_run is not None

    def refuse(*args: object) -> None:
        raise AssertionError("a pass without gradients ran the compiled training forward")

    model._train_run = refuse
    with torch.no_grad():   # validation and decoding stay eager (a compiled pass would be a new graph)
        model.causal(ids)
