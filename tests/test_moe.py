"""Sparse MoE: batched dispatch against the per-expert loop reference; router and aux loss."""

import pytest
import torch

from clover.model.moe import SparseMoE, experts_dense, experts_grouped, experts_reference, load_balancing_loss, route
from clover.model.testing import assert_close


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 8, 2), (64, 16, 4), (5, 32, 8)])
def test_grouped_and_dense_dispatch_equal_reference_outputs_and_grads(tokens, experts, top_k):
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
    probe = torch.randn_like(out)
    inputs = (x, gate_up, down, weights)
    grads = torch.autograd.grad((out * probe).sum(), inputs)
    grads_ref = torch.autograd.grad((out_ref * probe).sum(), inputs)
    for name, a, b in zip(["x", "gate_up", "down", "weights"], grads, grads_ref, strict=True):
        assert_close(a, b, atol=1e-6, what=f"grad {name}")


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
    with the next block's preview (2 x block_size tokens). One token of the 35B shape stays grouped."""
    from clover.model import moe
    from clover.model.config import CloverConfig

    def waste(config: CloverConfig, tokens: int) -> int:
        unused = config.num_experts - config.num_experts_per_tok
        return tokens * unused * config.hidden_size * config.moe_intermediate_size

    shipped = CloverConfig.preset("tiny-wide")
    assert waste(shipped, 2 * shipped.block_size) <= moe._COMPILED_DENSE_WASTE < waste(shipped, 72)
    assert waste(CloverConfig.preset("clover-35b-a3b"), 1) > moe._COMPILED_DENSE_WASTE
