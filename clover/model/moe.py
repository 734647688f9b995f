"""Sparse mixture of experts with a shared expert (the Qwen3.5-MoE `mlp`).

Dimension letters: T tokens, D model, E experts, K top-k, I expert width.
Tensor names match transformers: `gate.weight` [E,D], `experts.gate_up_proj` [E,2I,D],
`experts.down_proj` [E,D,I], `shared_expert.{gate,up,down}_proj.weight`, `shared_expert_gate.weight`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def route(router_logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 over all experts, top-k, renormalised. Returns (weights [T,K], experts [T,K])."""
    probs = torch.softmax(router_logits.float(), dim=-1)                        # [T,E]
    weights, experts = torch.topk(probs, top_k, dim=-1)                          # [T,K]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def experts_grouped(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Batched dispatch: (token, slot) pairs sorted by expert, one matmul per expert that has tokens.

    x [T,D]; gate_up [E,2I,D]; down [E,D,I]; weights, experts [T,K]. Returns [T,D].
    """
    top_k = experts.shape[1]
    flat = experts.reshape(-1)                                                  # [T*K]
    order = flat.argsort(stable=True)                                           # grouped by expert
    token = order // top_k                                                      # [T*K]
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, token).split(counts)   # per expert [n_e,D] (x[token]'s backward, index_put_
    # with accumulation, took 21 ms a layer of an 8 x 512 training step; index_select's, index_add_, ~3)
    slot_weights = weights.reshape(-1)[order, None].split(counts)               # per expert [n_e,1]
    outs = []
    for e, xe in enumerate(rows):
        if xe.shape[0] == 0:
            continue
        gate, up = F.linear(xe, gate_up[e]).chunk(2, dim=-1)                    # [n_e,I] each
        # The routing weight scales the [n_e,I] product before the down projection (linear, so the same
        # sum), not the [n_e,D] output: in bf16 autocast training the output-side product was a float32
        # [T*K,D] tensor times its float32 weights, and its backward a mixed-dtype product of the same size
        # (D = 3I on tiny-wide): 74 -> 56 ms for a layer's forward and backward of 8,192 tokens (session 53).
        # The weights take the product's dtype (bf16 under autocast, as transformers' Qwen MoE casts them).
        h = F.silu(gate) * up
        outs.append(F.linear(h * slot_weights[e].to(h.dtype), down[e]))        # [n_e,D]
    y = torch.cat(outs)                                                         # [T*K,D]
    return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def experts_dense(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token in two batched matmuls, mixed by the routing weights (zero for the
    experts a token does not use). Same arguments and result as `experts_grouped`, with no
    data-dependent shape: what a compiled decode step runs when experts are few (it wastes the
    arithmetic of the unused ones)."""
    h = torch.matmul(x, gate_up.transpose(1, 2))                                # [E,T,2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))                  # [E,T,D]
    mix = torch.zeros(x.shape[0], gate_up.shape[0], dtype=y.dtype, device=x.device)
    mix.scatter_(1, experts, weights.to(y.dtype))                               # [T,E]
    return torch.einsum("etd,te->td", y, mix).to(x.dtype)


def experts_gathered(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Each token through its own top-k experts, their weights indexed per (token, slot): T*K experts'
    products and no data-dependent shape. Same arguments and result as `experts_grouped`. What a compiled
    pass of few tokens runs (T*K <= E: it reads no more expert weights than the dense mix, which reads
    every expert's, and in a decode step far fewer); eagerly, the indexing copies the weights."""
    h = torch.einsum("td,tkjd->tkj", x, gate_up[experts])                      # [T,K,2I]
    gate, up = h.chunk(2, dim=-1)
    y = torch.einsum("tki,tkdi->tkd", F.silu(gate) * up, down[experts])        # [T,K,D]
    return (y * weights[..., None].to(y.dtype)).sum(1).to(x.dtype)


# The grouped dispatch reads its per-expert counts on the host: a graph that records gradients (training)
# breaks there (another compiled region, its guards, the eager dispatch); a pass without gradients calls it as
# an opaque operator (`_register_grouped_operator`), still eager inside, without a break. The dense mix is kept up
# to a block's commit fused with the next block's preview on the shipped clover-tiny (64 tokens x 6 unused
# experts of 384 x 128; even eager, dense and grouped take the same time there, 1.36 ms, and grouped leads
# from 72 tokens on); the bound counts the multiply-adds it wastes, so a model with many or wide experts
# (the 35B shape: 248 unused experts of 2048 x 512 for one token) takes the grouped dispatch above E / K
# tokens. Up to E / K tokens (an `ar` step of up to E / K sequences, a short `verify` check; for the 35B
# shape 32 tokens) a pass indexes each token's own experts (`experts_gathered`), which reads no more expert
# weights than the dense mix: a compiled batch-1 `ar` step of clover-tiny took 1.05 ms against 1.52 with the
# dense mix (session 30, AVX-512 EPYC: the dense mix read 19 of the step's ~45 MB of weights, more than its L3
# holds). The indexed weights may be copied (eagerly they are; inductor's matmuls may want them contiguous),
# T x K experts where tokens share some: near E / K tokens of wide experts that is more traffic than the
# grouped dispatch's reads (not measured on such a shape). Eagerly the grouped dispatch stays.
_COMPILED_DENSE_WASTE = 64 * 6 * 384 * 128
_grouped_outside_graph: Callable[..., torch.Tensor] | None = None   # set by `keep_grouped_dispatch_out_of_graphs`
_grouped_operator: Callable[..., torch.Tensor] | None = None        # the same, as an operator (no gradient)
_registering = threading.Lock()


def keep_grouped_dispatch_out_of_graphs() -> None:
    """Wrap the grouped dispatch in `torch.compiler.disable` for the graphs compiled from now on (a graph breaks
    there and runs it eagerly), and register it as an operator for the passes without gradients. Called where
    this package compiles a pass, not when this module is imported:
    the wrapper imports dynamo, which took 1.8 of the command's ~4.1 s of start-up on 2 cores (2026-12-06). A model
    that a user passes to `torch.compile` directly, before this ran, traces `experts_grouped` itself: dynamo
    breaks the graph at its `tolist()` and may recompile per routing (slower, the same results)."""
    global _grouped_outside_graph, _grouped_operator
    with _registering:   # (two threads compiling at once would register the operator twice: an error)
        if _grouped_outside_graph is None:
            _grouped_outside_graph = torch.compiler.disable(experts_grouped)
        if _grouped_operator is None:
            _grouped_operator = _register_grouped_operator()


def _register_grouped_operator() -> Callable[..., torch.Tensor]:
    """The grouped dispatch as an opaque operator (`clover::experts_grouped`) for compiled passes without
    gradients (decoding): a graph calls it as one node, its output shaped as its input, with no graph break.
    A break inside the layer loop made dynamo give up the loop ("graph break in loop": the whole pass of a batch-8
    block preview or `verify` check ran eagerly, with each layer's code after the break compiled on its own up to
    the recompile limit; session 53). Training keeps the break (the operator has no backward)."""
    try:   # (registered already: this module imported again, e.g. reloaded)
        return torch.ops.clover.experts_grouped.default
    except (AttributeError, RuntimeError):
        pass

    @torch.library.custom_op("clover::experts_grouped", mutates_args=())
    def grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        return experts_grouped(x, gate_up, down, weights, experts)

    @grouped.register_fake
    def _(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
          experts: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return grouped


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """Reference: loop over experts, each finds its (token, slot) pairs with a boolean mask."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        token, slot = torch.where(experts == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[token, slot, None]
        out = out.index_add(0, token, y.to(x.dtype))
    return out


def load_balancing_loss(
    router_logits: list[torch.Tensor], num_experts: int, top_k: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all layers: E * sum_e f_e * P_e.

    f_e is the share of (token, slot) assignments routed to expert e, P_e the mean router
    probability of e; both averaged over the layers' valid tokens (token_mask [T], True = counted).
    """
    logits = torch.cat(router_logits, dim=0).float()                            # [L*T,E]
    mask = None if token_mask is None else token_mask.float().repeat(len(router_logits))
    probs = torch.softmax(logits, dim=-1)
    _, chosen = torch.topk(probs, top_k, dim=-1)
    assigned = F.one_hot(chosen, num_experts).sum(dim=1).float()               # [L*T,E]
    if mask is None:
        tokens_per_expert = assigned.mean(0)
        prob_per_expert = probs.mean(0)
    else:
        denom = mask.sum().clamp(min=1)
        tokens_per_expert = (assigned * mask[:, None]).sum(0) / denom
        prob_per_expert = (probs * mask[:, None]).sum(0) / denom
    return num_experts * (tokens_per_expert * prob_per_expert).sum()


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))


class Experts(nn.Module):
    def __init__(self, hidden: int, width: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, width))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, width: int, shared_width: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = Router(hidden, num_experts)
        self.experts = Experts(hidden, width, num_experts)
        self.shared_expert = SwiGLU(hidden, shared_width)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.use_reference = False  # tests flip this to run the loop reference through the whole model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [...,D] -> (output [...,D], router logits [T,E] over the flattened tokens)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])                                         # [T,D]
        router_logits = F.linear(flat, self.gate.weight)                        # [T,E]
        weights, experts = route(router_logits, self.top_k, flat.dtype)
        if self.use_reference:
            dispatch = experts_reference
        elif torch.compiler.is_compiling():   # no data-dependent shapes in a compiled graph
            e, d, width = self.experts.down_proj.shape
            if flat.shape[0] * self.top_k <= e:
                dispatch = experts_gathered   # a decode step: only the experts its tokens use are read
            else:
                dense = flat.shape[0] * (e - self.top_k) * d * width <= _COMPILED_DENSE_WASTE
                if dense:
                    dispatch = experts_dense
                elif torch.is_grad_enabled() or _grouped_operator is None:
                    dispatch = _grouped_outside_graph or experts_grouped
                else:
                    dispatch = _grouped_operator
        else:
            dispatch = experts_grouped
        routed = dispatch(flat, self.experts.gate_up_proj, self.experts.down_proj, weights, experts)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(shape), router_logits
