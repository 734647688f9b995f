import pytest
import torch

from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def perturbed_model(config: CloverConfig, scale: float = 0.3) -> CloverForCausalLM:
    """A model whose Clover extras and norms are moved off their neutral init, so that every
    parameter influences the result (a test that leaves them at init could not see them)."""
    model = CloverForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("conv_right", "history_bias", "preview_log_scale", "layernorm.weight", "norm.weight")):
                p.add_(torch.randn_like(p) * scale)
    return model


@pytest.fixture
def debug_config() -> CloverConfig:
    return CloverConfig.preset("debug")


@pytest.fixture
def debug_model(debug_config) -> CloverForCausalLM:
    return perturbed_model(debug_config)
