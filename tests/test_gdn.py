"""Gated DeltaNet kernels against their references: delta rule, convolutions, preview softmax."""

import math

import pytest
import torch

from clover.model.gdn import (
    block_preview,
    block_preview_reference,
    causal_conv,
    delta_rule_chunked,
    delta_rule_kept,
    delta_rule_recurrent,
    l2norm,
    next_ring,
    preview_conv_reference,
    right_conv,
)
from clover.model.testing import assert_close

CHUNK = 8


def _inputs(n, t, h, dk, dv, requires_grad=False):
    q = l2norm(torch.randn(n, t, h, dk)) / math.sqrt(dk)
    k = l2norm(torch.randn(n, t, h, dk))
    v = torch.randn(n, t, h, dv)
    g = -torch.rand(n, t, h) * 2  # decays exp(g) in (e^-2, 1]
    beta = torch.rand(n, t, h)
    s0 = torch.randn(n, h, dk, dv)
    xs = [q, k, v, g, beta, s0]
    if requires_grad:
        xs = [x.clone().requires_grad_() for x in xs]
    return xs


@pytest.mark.parametrize("t", [CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 1])
def test_chunked_equals_recurrent_forward_and_backward(t):
    xs = _inputs(2, t, 3, 8, 5, requires_grad=True)
    o_ref, s_ref = delta_rule_recurrent(*xs)
    grads_ref = torch.autograd.grad((o_ref * torch.linspace(-1, 1, o_ref.numel()).view_as(o_ref)).sum() + s_ref.sum(), xs)
    o, s, _ = delta_rule_chunked(*xs, chunk_size=CHUNK)
    grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + s.sum(), xs)
    # fp32 throughout; errors observed ~2e-7, the bound leaves room for other BLAS orderings
    assert_close(o, o_ref, atol=2e-5, what="output")
    assert_close(s, s_ref, atol=2e-5, what="final state")
    for name, a, b in zip("q k v g beta state".split(), grads, grads_ref, strict=True):
        assert_close(a, b, atol=5e-5, rtol=1e-5, what=f"grad {name}")


def test_chunked_runs_in_fp32_under_bf16_autocast():
    """Its products stay fp32 under autocast (outputs and gradients bit-equal to no autocast), with
    decays as steep as the tiny presets' init (down to exp(-28) per step, underflowing within a chunk)."""
    xs = _inputs(2, 3 * CHUNK + 1, 3, 8, 5, requires_grad=True)
    with torch.no_grad():
        xs[3].mul_(14.0)
    results = []
    for enabled in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            o, s, _ = delta_rule_chunked(*xs, chunk_size=CHUNK)
        results.append((o, s, *torch.autograd.grad(o.square().sum() + s.sum(), xs)))
    for a, b in zip(*results, strict=True):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_chunk_states_are_the_states_at_every_boundary():
    q, k, v, g, beta, s0 = _inputs(2, 3 * CHUNK + 2, 2, 4, 3)
    _, _, states = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=CHUNK, return_chunk_states=True)
    assert states.shape == (2, 2, 4, 4, 3)
    for i in range(4):
        _, s_ref = delta_rule_recurrent(q[:, : i * CHUNK], k[:, : i * CHUNK], v[:, : i * CHUNK], g[:, : i * CHUNK],
                                        beta[:, : i * CHUNK], s0)
        assert_close(states[:, :, i], s_ref, atol=2e-5, what=f"state before chunk {i}")


@pytest.mark.parametrize("counts", [[0, 1], [2, 3], [5, 4], [0, 0]])
@pytest.mark.parametrize("kernel", ["recurrent", "chunked"])
def test_kept_state_is_the_recurrence_run_to_each_rows_count(counts, kernel):
    """`verify` keeps the state after each row's last verified step: `delta_rule_kept`, from the written
    rows either kernel returns, equals the recurrence run over exactly those steps."""
    q, k, v, g, beta, s0 = _inputs(2, 5, 2, 4, 3)
    if kernel == "recurrent":
        o, s, w = delta_rule_recurrent(q, k, v, g, beta, s0, return_written=True)
        o_plain, s_plain = delta_rule_recurrent(q, k, v, g, beta, s0)
        assert torch.equal(o, o_plain) and torch.equal(s, s_plain)
    else:
        *_, w = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=CHUNK, return_written=True)
    kept = delta_rule_kept(k, w, g, s0, torch.tensor(counts))
    assert kept.shape == s0.shape
    for i, c in enumerate(counts):
        _, s_ref = delta_rule_recurrent(q[i:i + 1, :c], k[i:i + 1, :c], v[i:i + 1, :c], g[i:i + 1, :c],
                                        beta[i:i + 1, :c], s0[i:i + 1])
        assert_close(kept[i:i + 1], s_ref, atol=2e-5, what=f"state after {c} steps")
        if c == 0 or (c == 1 and kernel == "recurrent"):   # the same operations as the reference
            assert torch.equal(kept[i:i + 1], s_ref)


def test_zero_beta_and_decay_steps_leave_the_state_untouched():
    q, k, v, g, beta, s0 = _inputs(1, 5, 2, 4, 3)
    g[:, 3:] = 0
    beta[:, 3:] = 0
    _, s_full, _ = delta_rule_chunked(q, k, v, g, beta, s0, chunk_size=4)
    _, s_three, _ = delta_rule_chunked(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], s0, chunk_size=4)
    assert_close(s_full, s_three, atol=1e-6, what="state")


def test_preview_conv_matches_reference_and_reduces_to_causal_conv():
    q_ch, width, s = 6, 4, 8
    weight, right = torch.randn(q_ch, width), torch.randn(q_ch, width - 1)
    u, ring = torch.randn(2, s, q_ch), torch.randn(2, width - 1, q_ch)
    lengths = torch.tensor([8, 5])
    fast = causal_conv(u, ring, weight) + right_conv(u, lengths, right)
    for i in range(2):
        ref = preview_conv_reference(u[i], ring[i], weight, right, int(lengths[i]))
        n = int(lengths[i])
        assert_close(fast[i, :n], ref[:n], atol=1e-5, what=f"preview conv, sequence {i}")
    # conv_right at its initial zeros: the preview conv is exactly the causal conv over the same rows
    causal = causal_conv(u, ring, weight)
    assert torch.equal(causal + right_conv(u, lengths, torch.zeros_like(right)), causal)
    rows = torch.cat([ring, u], dim=1)
    plain = torch.nn.functional.conv1d(rows.transpose(1, 2), weight.unsqueeze(1), groups=q_ch).transpose(1, 2)
    assert_close(causal, plain, atol=1e-6, what="causal conv vs torch conv1d")


def test_next_ring_keeps_the_last_committed_rows():
    ring = torch.arange(3 * 2, dtype=torch.float).view(1, 3, 2).repeat(2, 1, 1)
    u = 100 + torch.arange(5 * 2, dtype=torch.float).view(1, 5, 2).repeat(2, 1, 1)
    out = next_ring(ring, u, torch.tensor([5, 2]))
    assert torch.equal(out[0], u[0, 2:5])
    assert torch.equal(out[1], torch.cat([ring[1, 2:], u[1, :2]]))


def test_block_preview_matches_reference():
    n, s, h, dk, dv = 2, 6, 3, 4, 5
    q, k = l2norm(torch.randn(n, s, h, dk)), l2norm(torch.randn(n, s, h, dk))
    v, state = torch.randn(n, s, h, dv), torch.randn(n, h, dk, dv)
    log_scale, bias = torch.randn(h), torch.randn(h)
    lengths = torch.tensor([6, 4])
    fast = block_preview(q, k, v, state, log_scale, bias, lengths)
    for i in range(n):
        ref = block_preview_reference(q[i], k[i], v[i], state[i], log_scale, bias, int(lengths[i]))
        m = int(lengths[i])
        assert_close(fast[i, :m], ref[:m], atol=1e-5, what=f"block preview, sequence {i}")


@pytest.mark.parametrize("n_valid", [1, 4, 32])
def test_history_share_is_calibrated_against_block_length(n_valid):
    """With flat block logits the history slot's probability is sigmoid(history_bias) for any n."""
    h, dk = 2, 4
    q = l2norm(torch.randn(1, 32, h, dk))
    k = torch.zeros(1, 32, h, dk)  # q.k = 0: flat block logits
    v = torch.zeros(1, 32, h, 1)
    state = torch.zeros(1, h, dk, 1)
    state[..., 0] = 1.0  # m_t = sum(q_hat): history value known
    bias = torch.tensor([0.0, 1.5])
    o = block_preview(q, k, v, state, torch.zeros(h), bias, torch.tensor([n_valid]))
    share = o[0, :n_valid, :, 0] / q[0, :n_valid].sum(-1)
    assert_close(share, torch.sigmoid(bias).expand_as(share), atol=1e-5, what="history share")
