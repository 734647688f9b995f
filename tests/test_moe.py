"""Sparse MoE: batched dispatch against the per-expert loop reference; router and aux loss."""

import pytest
import torch

from clover.model.moe import (
    SparseMoE,
    experts_dense,
    experts_gathered,
    experts_grouped,
    experts_reference,
    load_balancing_loss,
    route,
)
from clover.model.testing import assert_close


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 8, 2), (64, 16, 4), (5, 32, 8)])
def test_grouped_dense_and_gathered_dispatch_equal_reference_outputs_and_grads(tokens, experts, top_k):
    d, width = 12, 10
    x = torch.randn(tokens, d, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * width, d) * 0.3).requires_grad_()
    down = (torch.randn(experts, d, width) * 0.3).requires_grad_()
    weights, chosen = route(torch.randn(tokens, experts), top_k, x.dtype)
    weights.requires_grad_()
    out_ref = experts_reference(x, gate_up, down, weights, chosen)
    out = experts_grouped(x, gate_up, down, weights, chosen)
    assert_close(out, out_ref, atol=1e-6, what="output")
    assert_close(experts_dense(x, gate_up, down, weights, chosen), out_ref, atol=1e-6, what="dense output")
    gathered = experts_gathered(x, gate_up, down, weights, chosen)
    assert_close(gathered, out_ref, atol=1e-6, what="gathered output")
    probe = torch.randn_like(out)
    inputs = (x, gate_up, down, weights)
    grads = torch.autograd.grad((out * probe).sum(), inputs)
    grads_ref = torch.autograd.grad((out_ref * probe).sum(), inputs)
    grads_gathered = torch.autograd.grad((gathered * probe).sum(), inputs)
    for name, a, b, c in zip(["x", "gate_up", "down", "weights"], grads, grads_ref, grads_gathered, strict=True):
        # (the grouped dispatch scales the [n,I] product by the weight, the reference the [n,D] output: the
        # weights' gradient sums other terms whose float32 rounding reaches ~10, as for einsum below)
        assert_close(a, b, atol=1e-5 if name == "weights" else 1e-6, what=f"grad {name}")
        # (einsum sums in another order: float32 rounding of sums whose terms reach ~10, so 1e-5 absolute)
        assert_close(c, b, atol=1e-5, what=f"gathered grad {name}")


def test_route_renormalises_top_k_of_the_full_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, chosen = route(logits, 2, torch.float32)
    assert chosen.tolist() == [[0, 1]]
    p = torch.softmax(logits, -1)[0, :2]
    assert_close(weights[0], p / p.sum(), atol=1e-7, what="weights")


def test_module_uses_shared_expert_with_sigmoid_gate():
    moe = SparseMoE(8, 6, 5, num_experts=4, top_k=2)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(3, 7, 8)
    out, router_logits = moe(x)
    flat = x.reshape(-1, 8)
    weights, chosen = route(flat @ moe.gate.weight.T, 2, flat.dtype)
    expected = experts_reference(flat, moe.experts.gate_up_proj, moe.experts.down_proj, weights, chosen)
    expected = expected + torch.sigmoid(moe.shared_expert_gate(flat)) * moe.shared_expert(flat)
    assert router_logits.shape == (21, 4)
    assert_close(out.reshape(-1, 8), expected, atol=1e-6, what="moe output")


def test_load_balancing_loss_matches_transformers():
    transformers_moe = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    layers = [torch.randn(20, 8) for _ in range(3)]
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False
    ours = load_balancing_loss(layers, 8, 2, mask.reshape(-1))
    theirs = transformers_moe.load_balancing_loss_func(tuple(layers), 8, 2, mask)
    assert_close(ours, torch.as_tensor(theirs), atol=1e-6, what="aux loss (masked)")
    assert_close(load_balancing_loss(layers, 8, 2), torch.as_tensor(
        transformers_moe.load_balancing_loss_func(tuple(layers), 8, 2)), atol=1e-6, what="aux loss")
    # perfectly balanced routing gives the minimum, top_k
    uniform = [torch.zeros(8, 8) + torch.eye(8) * 5]
    assert_close(load_balancing_loss(uniform, 8, 1), torch.tensor(1.0), atol=1e-2, what="balanced")


def test_compiled_passes_of_the_shipped_shape_keep_the_dense_mix_up_to_a_fused_commit_and_preview():
    """Under compile the dense expert mix (no graph break) is kept while the multiply-adds it wastes stay
    under a bound sized for the shipped model's largest decoding pass at batch 1: a block's commit fused
    with the next block's preview (2 x block_size tokens). A pass of the 35B shape above E / K tokens takes the
    grouped dispatch (up to E / K, the indexed experts: the next test)."""
    from clover.model import moe
    from clover.model.config import CloverConfig

    def waste(config: CloverConfig, tokens: int) -> int:
        unused = config.num_experts - config.num_experts_per_tok
        return tokens * unused * config.hidden_size * config.moe_intermediate_size

    shipped = CloverConfig.preset("tiny-wide")
    assert waste(shipped, 2 * shipped.block_size) <= moe._COMPILED_DENSE_WASTE < waste(shipped, 72)
    big = CloverConfig.preset("clover-35b-a3b")
    assert waste(big, big.num_experts // big.num_experts_per_tok + 1) > moe._COMPILED_DENSE_WASTE


def _module_reference(module: SparseMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    weights, experts = route(logits, module.top_k, x.dtype)
    want = experts_reference(x, module.experts.gate_up_proj, module.experts.down_proj, weights, experts)
    return want + torch.sigmoid(module.shared_expert_gate(x)) * module.shared_expert(x)


def _random_module() -> SparseMoE:
    module = SparseMoE(384, 128, 128, num_experts=8, top_k=2)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return module


@pytest.mark.parametrize("tokens,chosen", [(1, "gathered"), (4, "gathered"), (5, "dense"), (73, "grouped")])
def test_compiled_passes_index_the_tokens_own_experts_while_they_read_fewer_weights_than_the_dense_mix(
        tokens, chosen, monkeypatch):
    """Under compile, a pass of T tokens with T * top_k <= E (tiny-wide: 8 experts, top 2, so up to 4 tokens: an
    `ar` step of up to 4 sequences) takes `experts_gathered`, a larger one the dense mix within its bound,
    beyond it the grouped dispatch; the module's output is the reference's whichever runs."""
    from clover.model import moe

    moe.keep_grouped_dispatch_out_of_graphs()   # (what compiling a pass does first)
    module = _random_module()
    ran = []
    for name in ("experts_gathered", "experts_dense", "_grouped_outside_graph"):
        fn = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    x = torch.randn(tokens, 384)
    out, logits = module(x)
    assert ran == [{"gathered": "experts_gathered", "dense": "experts_dense",
                    "grouped": "_grouped_outside_graph"}[chosen]]
    assert_close(out, _module_reference(module, x, logits), atol=1e-5, what="module output")


def test_a_model_compiled_by_the_user_before_any_pass_of_ours_takes_the_plain_grouped_dispatch(monkeypatch):
    """`torch.compile(model)` called directly, before this package compiled anything (so dynamo's wrapper was
    never made): a large pass takes the plain grouped dispatch (simulated compiling), with the reference's
    output."""
    from clover.model import moe

    monkeypatch.setattr(moe, "_grouped_outside_graph", None)
    ran = []
    monkeypatch.setattr(moe, "experts_grouped", lambda *a, fn=moe.experts_grouped: ran.append(1) or fn(*a))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    module = _random_module()
    x = torch.randn(73, 384)
    out, logits = module(x)
    assert ran == [1]
    assert_close(out, _module_reference(module, x, logits), atol=1e-5, what="module output")
