"""Gated DeltaNet kernels in plain PyTorch, each fast path beside its slow reference.

Dimension letters: N batch (or blocks), T length, C chunk / block size, H value heads, K key dim,
V value dim, W conv kernel width, Q conv channels (q|k|v).

Causal (spec section 2), per value head, with q and k unit-normalised and q scaled by 1/sqrt(K):
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t
Preview (spec section 3, our design): a softmax over the block's keys plus one history slot whose
value is the clean state's readout S^T q_hat and whose logit is history_bias + log(n).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (the convention of fla and transformers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# -- delta rule ------------------------------------------------------------------------------------

# Eager PyTorch on 2 CPU cores: up to this many steps, one step at a time takes less time than one
# chunk of the same length (per-op overhead; ~170 against ~230 us for 2 steps of clover-tiny's heads).
RECURRENT_STEPS = 3


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, return_written: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Reference: one step at a time. q, k [N,T,H,K]; v [N,T,H,V]; g, beta [N,T,H]; state [N,H,K,V].

    Returns (o [N,T,H,V], final state [N,H,K,V]), both fp32, and with `return_written` the row each
    step writes, w_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t) [N,T,H,V] (S_t = exp(g_t) S_{t-1} + k_t w_t^T).
    """
    n, t_len, h, dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    s = torch.zeros(n, h, dk, v.shape[-1], device=v.device) if state is None else state.float()
    outs, written = [], []
    for t in range(t_len):
        s = s * g[:, t].exp()[..., None, None]                                     # [N,H,K,V]
        pred = torch.einsum("nhkv,nhk->nhv", s, k[:, t])                           # [N,H,V]
        w = beta[:, t, :, None] * (v[:, t] - pred)
        s = s + torch.einsum("nhk,nhv->nhkv", k[:, t], w)
        outs.append(torch.einsum("nhkv,nhk->nhv", s, q[:, t]))
        written.append(w)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape, dtype=torch.float32)
    if return_written:
        return o, s, torch.stack(written, dim=1) if written else torch.zeros_like(o)
    return o, s


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, chunk_size: int = 32, return_chunk_states: bool = False,
    return_written: bool = False, keep_chunks: list[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Chunked delta rule (WY form): intra-chunk work in parallel, a scan over chunks only.

    Same inputs and outputs as `delta_rule_recurrent`, plus, when asked, the state before every
    chunk: chunk_states [N,H,nC,K,V] (chunk_states[:, :, 0] is the initial state), or with `keep_chunks`
    (ascending, each < nC) only those chunks' [N,H,len(keep_chunks),K,V] (the others are never held: a
    prefix cache asks for a few of a long prefill's), and with `return_written` the written rows w [N,T,H,V]
    last, as `delta_rule_recurrent` gives them.

    Within a chunk starting from state S0, with cumulative log decay G_t = g_1 + ... + g_t, the
    written rows w_s solve (I + A) W = beta * (V - exp(G) K S0), A_sr = beta_s exp(G_s - G_r) k_s.k_r
    for r < s; then o_t = exp(G_t) S0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) w_s and
    S_end = exp(G_C) S0 + sum_s exp(G_C - G_s) k_s w_s^T.

    It runs in fp32 under autocast too (its products would otherwise be cast to bf16): compiled under
    bf16 autocast, its backward gave NaN gradients where the decays underflow (per-step log decays of
    -3 to -28 at the tiny presets' init), which eager bf16 and compiled fp32 do not.
    """
    with torch.autocast(q.device.type, enabled=False):
        return _chunked(q, k, v, g, beta, state, chunk_size, return_chunk_states, return_written, keep_chunks)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor | None, chunk_size: int, return_chunk_states: bool, return_written: bool,
             keep_chunks: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    n, t_len, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t_len) % c
    # [N,H,T,*] in fp32; padded steps have g = 0 and beta = 0, so they leave the state unchanged.
    q, k, v = (F.pad(x.float().transpose(1, 2), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.float().transpose(1, 2), (0, pad)) for x in (g, beta))
    n_chunks = (t_len + pad) // c
    q, k, v = (x.reshape(n, h, n_chunks, c, -1) for x in (q, k, v))             # [N,H,nC,C,*]
    g, beta = (x.reshape(n, h, n_chunks, c) for x in (g, beta))                 # [N,H,nC,C]

    cum = g.cumsum(-1)                                                          # G_t [N,H,nC,C]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t, zero above the diagonal (masked before exp: no overflow).
    decay_ts = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)                                                # [N,H,nC,C,C]
    a_mat = (beta[..., None] * kk * decay_ts).tril(-1)
    system = a_mat + torch.eye(c, device=q.device)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w_v, w_k = sol[..., :dv], sol[..., dv:]                                    # W = w_v - w_k @ S0
    attn = (q @ k.transpose(-1, -2)) * decay_ts                                 # [N,H,nC,C,C]
    q_decayed = q * cum.exp()[..., None]                                        # exp(G_t) q_t
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]                       # exp(G_C - G_s) k_s
    chunk_decay = cum[..., -1].exp()[..., None, None]                           # [N,H,nC,1,1]

    s = torch.zeros(n, h, dk, dv, device=q.device) if state is None else state.float()
    outs, states, written = [], [], []
    # the chunks as separate views taken once: indexing [:, :, i] in the loop made each chunk's backward
    # fill and add a gradient of the whole tensor (quadratic in the chunks: 10% of an 8 x 2,048 training step)
    w_v, w_k, q_decayed, attn, chunk_decay, k_to_end = (
        x.unbind(2) for x in (w_v, w_k, q_decayed, attn, chunk_decay, k_to_end))
    for i in range(n_chunks):
        if return_chunk_states and (keep_chunks is None or i in keep_chunks):
            states.append(s)
        w = w_v[i] - w_k[i] @ s                                                 # [N,H,C,V]
        outs.append(q_decayed[i] @ s + attn[i] @ w)
        written.append(w)
        s = chunk_decay[i] * s + k_to_end[i].transpose(-1, -2) @ w
    o = torch.stack(outs, dim=2).reshape(n, h, -1, dv)[:, :, :t_len].transpose(1, 2)
    chunk_states = torch.stack(states, dim=2) if return_chunk_states else None
    if return_written:
        return o, s, chunk_states, torch.stack(written, dim=2).reshape(n, h, -1, dv)[:, :, :t_len].transpose(1, 2)
    return o, s, chunk_states


def delta_rule_kept(
    k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, state: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The state [N,H,K,V] after the first counts[n] steps of each row (`verify` keeps the steps the
    causal head verified), from the steps' keys k [N,T,H,K], written rows w [N,T,H,V] (what both kernels
    return with `return_written`) and log decays g [N,T,H]: with G_t = g_1 + ... + g_t and c = counts[n],
    S_c = exp(G_c) S_0 + sum_{s<=c} exp(G_c - G_s) k_s w_s^T. A written row depends only on the steps
    before it, so those of a check hold for any prefix of it. No step kept: S_0 as it was."""
    scale, added = kept_terms(k, w, g, counts)
    return scale[..., None, None] * state.float() + added


def kept_terms(k: torch.Tensor, w: torch.Tensor, g: torch.Tensor, counts: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule_kept`'s S_c = scale * S_0 + added, without the state: (exp(G_c) [N,H], the sum [N,H,K,V])."""
    n, t = g.shape[:2]
    cum = g.float().cumsum(1)                                                   # G_t [N,T,H]
    last = (counts - 1).clamp(min=0)
    at_end = torch.where((counts > 0)[:, None], cum[torch.arange(n, device=g.device), last], 0.0)   # G_c [N,H]
    kept = torch.arange(t, device=g.device)[None, :] < counts[:, None]                            # [N,T]
    decay = (at_end[:, None] - cum).masked_fill(~kept[..., None], float("-inf")).exp()           # [N,T,H]
    scaled = (k.float() * decay[..., None]).permute(0, 2, 3, 1)                                  # [N,H,K,T]
    return at_end.exp(), scaled @ w.float().transpose(1, 2)


# -- short convolutions ----------------------------------------------------------------------------


def valid_mask(lengths: torch.Tensor, t_len: int) -> torch.Tensor:
    """[N,T] bool: position t < lengths[n]."""
    return torch.arange(t_len, device=lengths.device)[None, :] < lengths[:, None]


def causal_conv(u: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over [ring; u] (pre-activation). u [N,T,Q]; ring [N,W-1,Q]; weight [Q,W].

    out_t = sum_j weight[:, j] * x_{t-(W-1)+j}: weight[:, W-1] multiplies the current row.
    Written as W shifted products: for W = 4 this beats F.conv1d on CPU, forward and backward.
    """
    x = torch.cat([ring.to(u.dtype), u], dim=1)                                 # [N,W-1+T,Q]
    t_len, width = u.shape[1], weight.shape[1]
    out = x[:, width - 1:] * weight[:, width - 1]
    for j in range(width - 1):
        out = out + x[:, j: j + t_len] * weight[:, j]
    return out                                                                  # [N,T,Q]


def right_conv(u: torch.Tensor, lengths: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Right-context taps: out_t = sum_{d=1..W-1} right[:, d-1] * u_{t+d}, zero at or past lengths.

    u [N,T,Q]; lengths [N]; right [Q,W-1].
    """
    t_len = u.shape[1]
    u = u * valid_mask(lengths, t_len)[..., None].to(u.dtype)
    x = F.pad(u, (0, 0, 0, right.shape[1]))                                     # [N,T+W-1,Q]
    out = x[:, 1: 1 + t_len] * right[:, 0]
    for d in range(2, right.shape[1] + 1):
        out = out + x[:, d: d + t_len] * right[:, d - 1]
    return out


def next_ring(ring: torch.Tensor, u: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The last W-1 rows of [ring; u[:lengths]] per sequence: the conv state after a commit."""
    return rings_at(ring, u, lengths[:, None])[:, 0]


def rings_at(ring: torch.Tensor, u: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """The conv ring [N,k,W-1,Q] after before[n, j] rows of u [N,T,Q] from `ring` [N,W-1,Q]: the last W-1 rows
    of [ring; u[:before]] (`next_ring` at several points; a point outside 0..T gives rows of no meaning)."""
    width = ring.shape[1]
    rows = torch.cat([ring.to(u.dtype), u], dim=1)                              # [N,W-1+T,Q]
    idx = (before[..., None] + torch.arange(width, device=u.device)).clamp(0, rows.shape[1] - 1)   # [N,k,W-1]
    n, k = before.shape
    return rows.gather(1, idx.reshape(n, -1, 1).expand(-1, -1, rows.shape[-1])).reshape(n, k, width, -1)


def preview_conv_reference(
    u: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, right: torch.Tensor, length: int
) -> torch.Tensor:
    """Reference for one block (no batch): u [S,Q], ring [W-1,Q]; loops over positions and taps."""
    width = weight.shape[1]
    rows = torch.cat([ring, u], dim=0)
    out = torch.zeros_like(u)
    for t in range(u.shape[0]):
        for j in range(width):
            out[t] += weight[:, j] * rows[t + j]
        for d in range(1, width):
            if t + d < length:
                out[t] += right[:, d - 1] * u[t + d]
    return out


# -- preview: block softmax with a history slot ----------------------------------------------------


def block_preview(
    q_hat: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    log_scale: torch.Tensor, history_bias: torch.Tensor, lengths: torch.Tensor,
) -> torch.Tensor:
    """One block's GDN preview readout (spec section 3, step 3).

    q_hat, k_hat [N,S,H,K] unit-normalised; v [N,S,H,V]; state [N,H,K,V] fp32; log_scale,
    history_bias [H]; lengths [N] valid positions. Returns o [N,S,H,V] fp32.
    """
    q_hat, k_hat, v = (x.float().transpose(1, 2) for x in (q_hat, k_hat, v))   # [N,H,S,*]
    n, h, s_len, _ = q_hat.shape
    logits = (q_hat @ k_hat.transpose(-1, -2)) * log_scale.float().exp()[:, None, None]  # [N,H,S,S]
    key_valid = valid_mask(lengths, s_len)[:, None, None, :]                   # [N,1,1,S]
    logits = logits.masked_fill(~key_valid, float("-inf"))
    hist = history_bias.float()[None, :, None] + torch.log(lengths.clamp(min=1).float())[:, None, None]
    hist = hist.expand(n, h, s_len).unsqueeze(-1)                               # [N,H,S,1]
    probs = torch.softmax(torch.cat([hist, logits], dim=-1), dim=-1)           # [N,H,S,1+S]
    memory = q_hat @ state.float()                                              # m_t = S^T q_hat_t [N,H,S,V]
    o = probs[..., :1] * memory + probs[..., 1:] @ v
    return o.transpose(1, 2)


def block_preview_reference(
    q_hat: torch.Tensor, k_hat: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
    log_scale: torch.Tensor, history_bias: torch.Tensor, length: int,
) -> torch.Tensor:
    """Reference for one block (no batch), written as the spec states it, one (head, query) at a time.

    q_hat, k_hat [S,H,K]; v [S,H,V]; state [H,K,V]. Returns [S,H,V] fp32.
    """
    s_len, h, _ = q_hat.shape
    out = torch.zeros(s_len, h, v.shape[-1])
    for head in range(h):
        scale = math.exp(float(log_scale[head]))
        for t in range(s_len):
            logits = [float(history_bias[head]) + math.log(length)]
            logits += [scale * float(q_hat[t, head] @ k_hat[u, head]) for u in range(length)]
            p = torch.softmax(torch.tensor(logits, dtype=torch.float64), dim=0).float()
            out[t, head] = p[0] * (state[head].float().T @ q_hat[t, head].float())
            for u in range(length):
                out[t, head] += p[1 + u] * v[u, head].float()
    return out
