"""Causal mode against transformers' Qwen3_5MoeForCausalLM on the same random weights (spec section 2)."""

import pytest
import torch

from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.testing import assert_close, transformers_config

transformers = pytest.importorskip("transformers")

CONFIGS = {
    # 4 q heads / 2 kv heads, GDN 2 key / 4 value heads, 8 experts top-2
    "gqa2-e8": CloverConfig.preset("debug"),
    # 6 q heads / 1 kv head, GDN 2 key / 2 value heads, 6 experts top-3, head dim 32, 5 layers
    "gqa6-e6": CloverConfig.preset(
        "debug", num_attention_heads=6, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=6,
        num_experts_per_tok=3, num_hidden_layers=5, layer_types=None, block_size=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
    ),
}


def reference_model(config: CloverConfig):
    """transformers' model with our config's fields and every parameter randomised."""
    ref = transformers.Qwen3_5MoeForCausalLM(transformers_config(config)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):  # constant at init: move them off it
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.mul_(2.0)  # std 0.04: larger activations than at init, still a well-conditioned network
    return ref


def clover_from(ref, config: CloverConfig) -> CloverForCausalLM:
    model = CloverForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert unexpected == []
    assert all(k.rsplit(".", 1)[-1] in ("conv_right", "preview_log_scale", "history_bias") for k in missing)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_causal_logits_equal_transformers(name):
    config = CONFIGS[name]
    ref = reference_model(config)
    model = clover_from(ref, config)
    ids = torch.randint(0, config.vocab_size, (2, 45))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model(ids)
    assert_close(got, expected, atol=1e-4, what=f"{name} logits")
    assert expected.abs().max() > 0.5  # the comparison is not between near-zero tensors


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_decode_equals_transformers_cached_decode(name):
    """Prefill then one token at a time through both caches (transformers' recurrent GDN path)."""
    config = CONFIGS[name]
    ref = reference_model(config)
    model = clover_from(ref, config)
    ids = torch.randint(0, config.vocab_size, (1, 13))
    with torch.no_grad():
        out = ref(ids[:, :9], use_cache=True)
        past = out.past_key_values
        cache = model.new_cache(1)
        assert_close(model.causal(ids[:, :9], cache), out.logits, atol=1e-4, what="prefill")
        for i in range(9, 13):
            out = ref(ids[:, i : i + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            assert_close(model.causal(ids[:, i : i + 1], cache), out.logits, atol=1e-4, what=f"step {i}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_ar_decoding_equals_transformers_generate(name):
    from clover.engine.engine import Engine
    from clover.engine.sampling import SamplingParams

    config = CONFIGS[name]
    ref = reference_model(config)
    model = clover_from(ref, config)
    prompts = [torch.randint(0, config.vocab_size - 2, (n,)).tolist() for n in (7, 19)]
    params = SamplingParams(max_new_tokens=16, algorithm="ar", ignore_eos=True)
    ours = Engine(model).generate(prompts, params)
    for prompt, result in zip(prompts, ours, strict=True):
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                           suppress_tokens=[config.mask_token_id], pad_token_id=0)
        assert result.token_ids == out[0, len(prompt):].tolist()
