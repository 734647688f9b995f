"""The Clover model: the Qwen3.5-MoE text backbone extended for block diffusion (spec sections 2-3).

Architecture, read top to bottom:
- per layer: input_layernorm -> token mixer -> residual -> post_attention_layernorm -> sparse MoE
  (with shared expert) -> residual; RMSNorms scale by (1 + weight);
- token mixer, by `layer_types`: gated full attention (partial RoPE, GQA, per-head q/k norms,
  sigmoid output gate) or Gated DeltaNet (short conv, delta rule, gated RMSNorm);
- Clover extras (our design, spec section 3): GDN `conv_right` taps and a block softmax whose
  history slot reads the clean state; attention bidirectional within a block.

Three entry points, all batched (right padding; `lengths` gives the valid positions per row):
- `causal`   consumes tokens, updates a `PrefixCache` (prefill and block commits);
- `preview`  one block over a cache, bidirectional inside the block, the cache untouched;
- `training_forward`  clean + noisy streams, every block at once (noisy block j sees the clean
  prefix before it), identical to preview over a causal prefill of the first j blocks.

Dimension letters: N batch, T length, S block, D model, A attention heads, G kv heads, Dh head dim,
H GDN value heads, K / V GDN key / value dims, Q conv channels, W conv width, R rotary dim.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from clover.model.cache import PrefixCache
from clover.model.config import CloverConfig
from clover.model.gdn import (
    RECURRENT_STEPS,
    block_preview,
    causal_conv,
    delta_rule_chunked,
    delta_rule_recurrent,
    kept_terms,
    l2norm,
    next_ring,
    right_conv,
    rings_at,
    valid_mask,
)
from clover.model.moe import SparseMoE, keep_grouped_dispatch_out_of_graphs, load_balancing_loss

logger = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """Zero-initialised weight, output scaled by (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


def _building_a_shell() -> bool:
    """Whether modules are being built on the meta device (`with torch.device("meta")`): a shell whose
    parameters a checkpoint fills. Nothing is drawn for it, since `normal_` on meta runs torch's Python
    decompositions, which import dynamo (1.8 s on 2 cores) into a process that may never compile."""
    return torch.empty(0).device.type == "meta"   # (torch.get_default_device() sees the context from 2.8 only)


class GatedRMSNorm(nn.Module):
    """norm(x) * weight * silu(z), the GDN output norm (weight initialised to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(z.float())).to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        r = config.rotary_dim
        inv_freq = torch.empty((r + 1) // 2) if _building_a_shell() else \
            1.0 / (config.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float) / r))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N,T] -> cos, sin [N,T,R]."""
        freqs = positions[..., None].float() * self.inv_freq.float()            # [N,T,R/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first R dims of x [N,heads,T,Dh] (partial RoPE); cos, sin [N,T,R]."""
    r = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., : r // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


class GatedAttention(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        d, a, g, dh = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = a, g, dh
        self.q_proj = nn.Linear(d, a * dh * 2, bias=False)  # query and output gate, interleaved per head
        self.k_proj = nn.Linear(d, g * dh, bias=False)
        self.v_proj = nn.Linear(d, g * dh, bias=False)
        self.o_proj = nn.Linear(a * dh, d, bias=False)
        self.q_norm = RMSNorm(dh, config.rms_norm_eps)
        self.k_norm = RMSNorm(dh, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
        past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
        join: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N,T,D]; mask [N,1,T,P+T] bool over [past; own] keys, or None: causal over its own keys alone
        (SDPA's is_causal, whose kernel skips the blocks above the diagonal). Returns (out [N,T,D], k, v [N,G,T,Dh]).
        The keys attended are [past_k; k], or what `join(k, v)` returns (the cache's, without a copy)."""
        n, t, _ = x.shape
        q, gate = self.q_proj(x).view(n, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)               # [N,A,T,Dh]
        k = apply_rope(self.k_norm(self.k_proj(x).view(n, t, self.kv_heads, self.head_dim)).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(n, t, self.kv_heads, self.head_dim).transpose(1, 2)     # [N,G,T,Dh]
        if join is not None:
            keys, vals = join(k, v)
        else:
            keys = k if past_k is None else torch.cat([past_k, k], dim=2)
            vals = v if past_v is None else torch.cat([past_v, v], dim=2)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=self.heads != self.kv_heads)
        o = o.transpose(1, 2).reshape(n, t, -1) * torch.sigmoid(gate.reshape(n, t, -1))
        return self.o_proj(o), k, v


@dataclass
class GDNCausalOut:
    out: torch.Tensor                 # [N,T,D]
    state: torch.Tensor               # [N,H,K,V] after the valid rows
    ring: torch.Tensor                # [N,W-1,Q] after the valid rows
    u: torch.Tensor                   # [N,T,Q] pre-conv rows (the training forward builds rings from them)
    chunk_states: torch.Tensor | None  # [N,H,nC,K,V] state before every chunk (or the `keep_chunks` asked)
    steps: tuple[torch.Tensor, ...] | None = None  # every row's k, written row w and g (`keep_steps`)
    chunk_rings: torch.Tensor | None = None  # [N,len(keep_chunks),W-1,Q] conv ring before each chunk asked


@dataclass
class GDNTrace:
    """What a cache-writing pass reports of its GDN layers, by layer index. For a prefix cache, the state and
    conv ring at the block boundaries `chunks` (ascending; chunk c starts at the c-th boundary from the one at
    or before each row's start, see `GatedDeltaNet.causal`'s `align`): states [N,H,len(chunks),K,V] and rings
    [N,len(chunks),W-1,Q]; nothing else of the pass is held (every layer's state at every boundary of a long
    prefill was, ~60 MiB a boundary for the 35B preset). Under write="kv" (a `verify` check): every row's
    steps and pre-conv rows, for `keep`."""

    chunks: list[int] = field(default_factory=list)
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    rings: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    u: dict[int, torch.Tensor] = field(default_factory=dict)

    def causal_args(self, past: torch.Tensor, block_size: int) -> dict:
        """`GatedDeltaNet.causal`'s arguments for the snapshots asked (none: {}), rows `past` tokens in."""
        if not self.chunks:
            return {}
        return {"return_chunk_states": True, "align": past % block_size, "keep_chunks": self.chunks}

    def record(self, layer: int, res: GDNCausalOut) -> None:
        if res.steps is not None:
            self.steps[layer], self.u[layer] = res.steps, res.u
        elif res.chunk_states is not None:
            self.states[layer], self.rings[layer] = res.chunk_states, res.chunk_rings


@dataclass
class CheckTrail:
    """What a `check` leaves for `keep`: the cache rows it ran on and, per layer (None for attention
    layers), every row's delta-rule key, written row and log decay (k, w [N,T,H,*], g [N,T,H], fp32;
    `gdn.delta_rule_kept` makes the state after any prefix of them from the cached state, far cheaper
    than the state after every row, T x H x K x V numbers per layer) and the rows' pre-conv `u` [N,T,Q]."""

    rows: torch.Tensor | slice | None
    lengths: torch.Tensor                  # [N] valid input rows
    steps: list[tuple[torch.Tensor, ...] | None]
    u: list[torch.Tensor | None]


class GatedDeltaNet(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.key_heads, self.heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        q_ch, w = config.linear_conv_dim, config.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(d, q_ch, bias=False)
        self.in_proj_z = nn.Linear(d, config.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.heads, bias=False)
        self.conv1d = nn.Conv1d(q_ch, q_ch, w, groups=q_ch, bias=False)       # weight [Q,1,W]
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        a_log = torch.empty(self.heads)
        self.A_log = nn.Parameter(a_log if _building_a_shell() else a_log.uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, d, bias=False)
        # Clover extras at their neutral init (spec section 3).
        self.conv_right = nn.Parameter(torch.zeros(q_ch, w - 1))
        self.preview_log_scale = nn.Parameter(torch.full((self.heads,), math.log(math.sqrt(self.key_dim))))
        self.history_bias = nn.Parameter(torch.zeros(self.heads))
        self.use_recurrent_reference = False  # tests flip this to run the step-by-step delta rule

    def _heads(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output [N,T,Q] -> q, k [N,T,H,K] (key heads repeated to the value heads), v [N,T,H,V]."""
        n, t, _ = c.shape
        kd = self.key_heads * self.key_dim
        q, k, v = c.split([kd, kd, self.heads * self.value_dim], dim=-1)
        rep = self.heads // self.key_heads
        q = q.reshape(n, t, self.key_heads, self.key_dim).repeat_interleave(rep, dim=2)
        k = k.reshape(n, t, self.key_heads, self.key_dim).repeat_interleave(rep, dim=2)
        return q, k, v.reshape(n, t, self.heads, self.value_dim)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o [N,T,H,V] -> gated RMSNorm with z = in_proj_z(x) -> out_proj -> [N,T,D]."""
        n, t, _ = x.shape
        z = self.in_proj_z(x).reshape(n, t, self.heads, self.value_dim)
        return self.out_proj(self.norm(o.to(x.dtype), z).reshape(n, t, -1))

    def causal(
        self, x: torch.Tensor, state: torch.Tensor | None, ring: torch.Tensor, lengths: torch.Tensor,
        chunk_size: int, return_chunk_states: bool = False, keep_steps: bool = False,
        align: torch.Tensor | None = None, keep_chunks: list[int] | None = None,
    ) -> GDNCausalOut:
        """x [N,T,D] from `state` / `ring`; rows t >= lengths[n] leave the state and ring untouched.
        `keep_steps`: also every row's key, written row and decay (a `verify` check, for `keep`). Unless chunk
        states are asked, up to RECURRENT_STEPS rows run step by step and inputs shorter than a chunk as
        one chunk of their length (no padding). `align` [N]: how far into a chunk each row starts (its
        cached length modulo chunk_size); with chunk states asked, row n then runs after align[n] steps
        that change nothing, so that its chunks start at multiples of chunk_size of the whole sequence
        (chunk_states[n, :, c]: the state at the c-th such boundary from the one at or before its start).
        `keep_chunks` (with chunk states asked): only those chunks' states, and their conv rings (chunk_rings)."""
        u = self.in_proj_qkv(x)                                                  # [N,T,Q]
        c = F.silu(causal_conv(u, ring, self.conv1d.weight.squeeze(1)))
        q, k, v = self._heads(c)
        q = l2norm(q.float()) / math.sqrt(self.key_dim)
        k = l2norm(k.float())
        t = x.shape[1]
        live = valid_mask(lengths, t)[..., None].float()                        # [N,T,1]
        beta = torch.sigmoid(self.in_proj_b(x).float()) * live
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()) * live
        chunk_states = None
        # compiled, a check runs step by step (faster there than one chunk; its length is fixed per graph)
        compiling = torch.compiler.is_compiling()
        if (self.use_recurrent_reference or (t == 1 and not return_chunk_states) or (keep_steps and compiling)
                or (not compiling and t <= RECURRENT_STEPS and not return_chunk_states)):
            o, new_state, *w = delta_rule_recurrent(q, k, v, g, beta, state, return_written=keep_steps)
        elif return_chunk_states and align is not None and bool((align > 0).any()):
            # each row shifted right by its align[n] zero steps (g = 0, beta = 0: the state stays), then back
            at = (torch.arange(x.shape[0], device=x.device)[:, None],
                  align[:, None] + torch.arange(t, device=x.device)[None, :])          # [N,1], [N,T]
            width = t + int(align.max())

            def shifted(y: torch.Tensor) -> torch.Tensor:
                out = y.new_zeros(y.shape[0], width, *y.shape[2:])
                out[at] = y
                return out

            o, new_state, chunk_states, *w = delta_rule_chunked(*map(shifted, (q, k, v, g, beta)), state, chunk_size,
                                                                True, keep_steps, keep_chunks)
            o, w = o[at], [y[at] for y in w]
        else:
            size = chunk_size if return_chunk_states else min(chunk_size, t)
            o, new_state, chunk_states, *w = delta_rule_chunked(q, k, v, g, beta, state, size, return_chunk_states,
                                                                keep_steps, keep_chunks)
        chunk_rings = None
        if return_chunk_states and keep_chunks is not None:   # ring before chunk c: the W-1 rows before its start
            before = torch.tensor(keep_chunks, device=x.device)[None, :] * chunk_size - (0 if align is None else
                                                                                         align[:, None])   # [N,k]
            chunk_rings = rings_at(ring, u, before)
        return GDNCausalOut(self._output(o, x), new_state, next_ring(ring, u, lengths), u, chunk_states,
                            (k, w[0], g) if keep_steps else None, chunk_rings)

    def preview(self, x: torch.Tensor, state: torch.Tensor, ring: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One block x [N,S,D] over `state` [N,H,K,V] / `ring` [N,W-1,Q]; lengths [N] valid positions."""
        u = self.in_proj_qkv(x)
        c = causal_conv(u, ring, self.conv1d.weight.squeeze(1)) + right_conv(u, lengths, self.conv_right)
        q, k, v = self._heads(F.silu(c))
        o = block_preview(l2norm(q.float()), l2norm(k.float()), v, state, self.preview_log_scale,
                          self.history_bias, lengths)
        return self._output(o, x)


class DecoderLayer(nn.Module):
    def __init__(self, config: CloverConfig, layer_type: str) -> None:
        super().__init__()
        self.is_attention = layer_type == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.shared_expert_intermediate_size,
                             config.num_experts, config.num_experts_per_tok)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)   # (nn.Embedding draws its weight unless given one)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if _building_a_shell() else None)
        self.layers = nn.ModuleList([DecoderLayer(config, t) for t in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


@dataclass
class TrainingOutput:
    clean: torch.Tensor        # [N,T,V] logits (or [N,T,D] final hidden states)
    noisy: torch.Tensor        # [N,T,V] logits (or hidden states)
    aux_loss: torch.Tensor     # router load-balancing loss (unweighted), over valid tokens of both streams


Rope = tuple[torch.Tensor, torch.Tensor]
Mixer = Callable[[int, DecoderLayer, torch.Tensor, Rope], torch.Tensor]


def _raise_recompile_limit(limit: int) -> None:
    """Let dynamo compile each function for up to `limit` guard sets (a global setting; never lowered)."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"   # (older torch)
    if getattr(dynamo_config, name) < limit:
        setattr(dynamo_config, name, limit)


def _is_compile_error(exc: BaseException) -> bool:
    """Whether `exc` says torch.compile could not build a graph (dynamo or inductor, a C++ compiler
    failing), as opposed to an error of the computation itself."""
    import torch._dynamo.exc
    import torch._inductor.exc

    return isinstance(exc, (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.CppCompileError))


class _CacheRows:
    """The cache rows a pass reads and writes, through the `PrefixCache` methods (any rows: a tensor of
    rows is gathered and scattered)."""

    def __init__(self, cache: PrefixCache, rows: torch.Tensor | slice | None) -> None:
        self.cache, self.rows = cache, rows

    def kv(self, i: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.kv(i, self.rows, p)

    def kv_with(self, i: int, p: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.kv_with(i, self.rows, p, k, v)

    def write_kv(self, i: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache.write_kv(i, k, v, lengths, self.rows)

    def gdn(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.gdn(i, self.rows)

    def set_gdn(self, i: int, state: torch.Tensor, ring: torch.Tensor) -> None:
        self.cache.set_gdn(i, self.rows, state, ring)


class _RowViews:
    """The same over per-layer views of consecutive cache rows, written in place and without host
    synchronisation (what the compiled passes run on). The caller has reserved room in the K/V buffers
    for every position written: `write_kv` writes every step of its input, those of padded steps into
    positions past the row's new length, which nothing reads."""

    def __init__(self, keys: list, values: list, states: list, rings: list, past: torch.Tensor | None) -> None:
        self.keys, self.values, self.states, self.rings, self.past = keys, values, states, rings, past

    def kv(self, i: int, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i][:, :, :p], self.values[i][:, :, :p]

    def kv_with(self, i: int, p: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        self.keys[i][:, :, p: p + t] = k.to(self.keys[i].dtype)
        self.values[i][:, :, p: p + t] = v.to(self.values[i].dtype)
        return self.keys[i][:, :, : p + t], self.values[i][:, :, : p + t]

    def write_kv(self, i: int, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> None:
        at = (self.past[:, None] + torch.arange(k.shape[2], device=k.device)[None, :])[:, None, :, None]
        self.keys[i].scatter_(2, at.expand_as(k), k.to(self.keys[i].dtype))
        self.values[i].scatter_(2, at.expand_as(v), v.to(self.values[i].dtype))

    def gdn(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.states[i], self.rings[i]

    def set_gdn(self, i: int, state: torch.Tensor, ring: torch.Tensor) -> None:
        self.states[i].copy_(state)
        self.rings[i].copy_(ring.to(self.rings[i].dtype))


def check_gdn_init(gdn_gate_z: float, gdn_dt_max: float) -> None:
    """The from-scratch GDN init settings (`CloverForCausalLM.from_scratch`), refused with the flag's name."""
    if not math.isfinite(gdn_gate_z):
        raise ValueError(f"gdn_gate_z must be a finite number, got {gdn_gate_z}")
    if not (gdn_dt_max == 0 or (math.isfinite(gdn_dt_max) and gdn_dt_max >= 1e-3)):
        raise ValueError(f"gdn_dt_max must be 0 (off) or a finite number of at least 0.001, got {gdn_dt_max}")


@torch.library.custom_op("clover::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [T,D] times a weight that `LMHead.pack` laid out for oneDNN -> [T,out_features]. One opaque op to a
    compiled graph: inductor (torch 2.13) lowers neither oneDNN's own op on such a weight nor packs the
    head itself (it emits a plain mm there)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class LMHead(nn.Linear):
    """The vocabulary projection (`lm_head`, an nn.Linear without bias). Where it runs on CPU in float32
    without autograd or autocast (decoding, evaluation), it multiplies by a copy of its weight that oneDNN
    has reordered once into its blocked layout (`pack`), kept until the weight changes: a plain `F.linear`
    goes to MKL's sgemm, which repacks the whole weight on every call, and at decoding's few rows that costs
    more than the product itself (clover-tiny's 8192 x 384 head, 2026-12-04, AMD EPYC with AVX2, 2 threads:
    1.6 -> 0.8 ms for 1 row, 5.1 -> 1.4 for 8, 11.7 -> 6.6 for 72; docs/measurements.md, session 27). It
    costs a second copy of the head's weight while the head runs so. Results agree with `F.linear` to
    float32 rounding (a different order of summation). A compiled pass multiplies by the packed copy
    through `packed_linear` (`compile_decode` packs before building its graphs; as for every compiled pass,
    the weights must not change afterwards). A change of the weight is seen by its storage and version:
    an optimizer step, `copy_`, `load_state_dict`, `.to()`; not a write through `.data`, which bypasses
    the version (call `pack()` after one). Where oneDNN's ops are missing or fail, the head falls back to
    `F.linear` with a warning."""

    _packing = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._drop_packed()

    def _drop_packed(self) -> None:
        # the weight as packed (held, so that its storage is not reused by another weight), its version, copy
        self._packed_of: tuple[torch.Tensor, int] | None = None
        self._packed_weight: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed copy behind (it has no storage to copy; the copy repacks)."""
        state = dict(super().__getstate__())
        state["_packed_of"], state["_packed_weight"] = None, None
        return state

    @staticmethod
    def _reorder(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 8)   # laid out for about 8 rows: the fastest
        # of 1, 8 and 32 at 1 to 72 rows on the machine above

    def _usable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return (self._packing and torch.backends.mkldnn.enabled and x.device.type == "cpu"
                and w.dtype == x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
                and not (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def pack(self) -> bool:
        """Lay the weight out for oneDNN, again if it has changed since; whether a packed copy is in place
        (none on other devices and dtypes, or where packing is unavailable)."""
        w = self.weight
        if not (self._packing and w.device.type == "cpu" and w.dtype == torch.float32):
            self._drop_packed()
            return False
        version = w._version if not w.is_inference() else 0   # (an inference tensor carries no version)
        held = self._packed_of
        if held is not None and held[0].data_ptr() == w.data_ptr() and held[1] == version:
            return True
        self._drop_packed()
        try:
            self._packed_weight = self._reorder(w.detach())
        except RuntimeError as exc:
            self._unavailable(exc)
            return False
        self._packed_of = (w.detach(), version)
        return True

    def _unavailable(self, exc: Exception) -> None:
        logger.warning("prepacked lm_head unavailable, using F.linear: %s", exc)
        type(self)._packing = False
        self._drop_packed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not self._usable(x):
            return F.linear(x, w)
        if torch.compiler.is_compiling():
            if self._packed_weight is None:
                return F.linear(x, w)
            y = packed_linear(x.reshape(-1, x.shape[-1]), self._packed_weight, w.shape[0])
            return y.reshape(*x.shape[:-1], w.shape[0])
        if not x.numel() or x.shape[-1] != w.shape[1] or not self.pack():
            return F.linear(x, w)   # (which raises on a wrong shape)
        try:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self._packed_weight, None, "none",
                                                   [], "")
        except RuntimeError as exc:
            self._unavailable(exc)
            return F.linear(x, w)
        return y.reshape(*x.shape[:-1], w.shape[0])


class CloverForCausalLM(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config)
        if not _building_a_shell():
            self.apply(self._init_weights)
        self._compiled: dict[str, Callable] = {}   # compiled passes by name, see compile_decode
        self._compiled_ran: set[str] = set()        # the passes that have completed a compiled call
        self._train_run: Callable | None = None     # the compiled layer stack of training, see compile_training

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, SparseMoE):
            for p in (module.gate.weight, module.experts.gate_up_proj, module.experts.down_proj):
                nn.init.normal_(p, std=std)

    @classmethod
    def from_scratch(
        cls, config: CloverConfig, seed: int, gdn_gate_z: float = 0.0, gdn_dt_max: float = 0.0,
    ) -> CloverForCausalLM:
        """Random weights to train from (seeded through torch's global generator): the constructor's
        transformers-style init, then, where asked, the GDN heads set to remember (`slow_gdn_decay`,
        gdn_dt_max > 0) and their output gates opened (`open_gdn_gates`, gdn_gate_z != 0). Both are off by
        default: at 1,800 AR steps of tiny-wide (two seeds) together they copied numbers worse than the
        constructor's init (0.745 / 0.656 against 0.811 / 0.736 teacher-forced) at bits per byte within 1%, and a
        recipe built from them answered less than half the agent turns (docs/measurements.md, sessions 33-34)."""
        check_gdn_init(gdn_gate_z, gdn_dt_max)
        torch.manual_seed(seed)
        model = cls(config)
        if gdn_dt_max != 0:
            model.slow_gdn_decay(dt_max=gdn_dt_max)
        model.open_gdn_gates(gdn_gate_z)
        return model

    @torch.no_grad()
    def slow_gdn_decay(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """Start every GDN head with a slow decay, as Mamba-2 and fla initialise theirs (our init for training
        from scratch; the weight format is unchanged).

        A head's state decays by exp(-exp(A_log) * softplus(a(x) + dt_bias)) per token. transformers starts
        dt_bias at 1 (softplus 1.31) and exp(A_log) uniform in (0.01, 16): most heads keep a fraction
        exp(-1.31 * 8) ~ 3e-5 of their state per token, so nothing written survives to be read a few tokens
        later, and Adam moves dt_bias and A_log by about the learning rate per step. Here softplus(dt_bias) is
        drawn log-uniform in [dt_min, dt_max] per head (A_log kept): the median head keeps ~0.9 of its state
        per token. Measured on `tiny-wide` with the gates opened (docs/measurements.md, session 24): the copy
        probe (LLLF) learned on seeds 0-2 within 2,000 steps, not shown to be sooner than with the gates alone;
        bits per byte after 400 AR steps within 2% (code 1.000x / 0.996x, English 1.011x / 1.007x, two seeds)."""
        if not (math.isfinite(dt_min) and math.isfinite(dt_max) and 0 < dt_min <= dt_max):
            raise ValueError(f"GDN decay steps need 0 < dt_min <= dt_max, got [{dt_min}, {dt_max}]")
        lo, hi = math.log(dt_min), math.log(dt_max)
        for layer in self.model.layers:
            if not layer.is_attention:
                mix = layer.linear_attn
                dt = torch.exp(torch.rand(mix.dt_bias.shape) * (hi - lo) + lo)
                mix.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))     # softplus^-1(dt)

    @torch.no_grad()
    def open_gdn_gates(self, z: float = 2.0, sample: tuple[int, int] = (4, 64)) -> None:
        """Open the GDN output gates of a model about to be trained from scratch (our init, on top of the
        transformers-style one the constructor gives; the weight format is unchanged).

        A GDN layer's output is out_proj(norm(o) * silu(z)), z = in_proj_z(x). At a normal init z is a small
        number of random sign for every token and channel, so whatever the layer reads out reaches the
        residual multiplied by noise. Here every token's embedding gets one shared direction u, as long as
        its random part, and each GDN layer's in_proj_z reads along u a weight calibrated on `sample` rows of
        random tokens, in one pass, so that z averages `z` at every GDN layer: silu(2) ~ 1.8, the same sign
        for every token. Attention layers and the LM head see u too (a per-token bias). Measured on
        `tiny-wide` after 400 AR steps: 4-5% lower bits per byte on code and English, two seeds; copying
        (`benchmarks/copy_probe.py`) not learned sooner (docs/measurements.md, session 23).

        Known limit: the deeper the layer, the less of u its input carries (layer outputs dilute it, and with
        `slow_gdn_decay` they can cancel it), and a small reading makes the calibration noisy. Mean z on held-out
        random tokens: 1.2-3.6 at the three GDN layers of `tiny-wide` (seeds 0-3, with the slow decay), but
        between -13 and 17 at some later layers of the six-GDN-layer `tiny` preset (with or without it). Only
        the first GDN layer's gate is open for every token: at the later ones of `tiny-wide` 53-87% of held-out
        tokens have z > 0.5 (seeds 0-3, 8 x 128 random tokens; 69-88% without the slow decay). A calibration
        along each layer's own mean input direction (tried, session 25) evened the means (0.9-2.1 on `tiny`) but
        not the share of open tokens (60-89%; 54-94% on `tiny-wide`), and was not kept.
        """
        gdn = [layer.linear_attn for layer in self.model.layers if not layer.is_attention]
        if not gdn or z == 0:
            return
        emb = self.model.embed_tokens.weight
        d = emb.shape[1]
        u = F.normalize(torch.randn(d, device=emb.device), dim=0)                   # fp32
        emb += (emb.float().std() * math.sqrt(d) * u).to(emb.dtype)

        def calibrate(proj: nn.Linear, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].float()
            along = float((x @ u).mean())   # ~ sqrt(d / 2) at the first layer, less after (even negative)
            if abs(along) <= 1e-3:   # nothing to calibrate along (never seen): the layer keeps its gate as made
                return
            now = float(F.linear(x, proj.weight.float()).mean())
            proj.weight += ((z - now) / along * u).to(proj.weight.dtype)

        # one pass: each layer is calibrated as it runs, on what the calibrated layers before it give it
        hooks = [mix.in_proj_z.register_forward_pre_hook(calibrate) for mix in gdn]
        try:
            self.causal(torch.randint(0, self.config.vocab_size, sample, device=emb.device), logits="train")
        finally:
            for hook in hooks:
                hook.remove()

    # -- shared pieces -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def decode_compiled(self) -> bool:
        """Whether the decoding passes run compiled (`compile_decode`; each input length its own graph)."""
        return bool(self._compiled)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, batch_size: int) -> PrefixCache:
        return PrefixCache.empty(self.config, batch_size, self.device, self.dtype)

    def _check_ids(self, ids: torch.Tensor, name: str) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an int64 or int32 tensor of token ids, got {getattr(ids, 'dtype', type(ids))}")
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"{name} must have shape [batch, length] with length >= 1, got {tuple(ids.shape)}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {self.config.vocab_size})")

    def _lengths(self, ids: torch.Tensor, lengths: torch.Tensor | None, past: torch.Tensor | None) -> torch.Tensor:
        n, t = ids.shape
        if lengths is None:
            lengths = torch.full((n,), t, dtype=torch.long, device=ids.device)
        else:
            lengths = torch.as_tensor(lengths, dtype=torch.long, device=ids.device)
            if lengths.shape != (n,) or int(lengths.min()) < 0 or int(lengths.max()) > t:
                raise ValueError(f"lengths must be {n} integers in [0, {t}], got {lengths.tolist()}")
        end = lengths if past is None else past + lengths
        if int(end.max()) > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence of {int(end.max())} positions exceeds the context limit of "
                f"{self.config.max_position_embeddings} (max_position_embeddings)"
            )
        return lengths

    def _cache_rows(self, cache: PrefixCache, n: int, rows: torch.Tensor | list[int] | slice | None
                    ) -> torch.Tensor | slice | None:
        """Check that the n input rows map onto the cache (all of it, or the given cache rows). A slice of
        consecutive rows is kept as a slice: the cache is then read through views, never copied."""
        if rows is None:
            if cache.batch_size != n:
                raise ValueError(f"cache holds {cache.batch_size} sequences but the input has {n} rows")
            return None
        if isinstance(rows, slice):
            start, stop, step = rows.indices(cache.batch_size)
            if step != 1 or stop - start != n:
                raise ValueError(f"rows must be {n} consecutive cache rows, got {rows}")
            return slice(start, stop)
        rows = torch.as_tensor(rows, dtype=torch.long, device=cache.lengths.device)
        if rows.shape != (n,) or int(rows.min()) < 0 or int(rows.max()) >= cache.batch_size:
            raise ValueError(f"rows must be {n} distinct cache rows in [0, {cache.batch_size}), got {rows.tolist()}")
        if rows.unique().numel() != n:
            raise ValueError(f"rows must be distinct, got {rows.tolist()}")
        return rows

    def compile_training(self, enabled: bool = True) -> None:
        """Run the layer stack of passes that record gradients (training's forward: `causal(...,
        logits="train")`, `training_forward`) through `torch.compile` (inductor, static shapes; the grouped
        experts run eagerly between the compiled pieces, as their shapes depend on the routing). Passes under
        `no_grad` (validation, decoding) stay eager. A training step of `tiny-wide` at 8 x 512 in fp32 took
        0.93x the time for AR and 0.83-0.88x for block diffusion on 2 AVX2 cores, after a first step that
        compiles for ~3 minutes (~30 s when inductor's cache on disk already holds the graphs;
        docs/measurements.md, session 40); results equal the eager pass's up to float rounding. Each new input
        shape compiles again. The graph breaks at every layer's experts, and the code after a break is compiled
        once per layer: dynamo's recompile limit is raised to leave room for a few shapes of this model. Where
        the forward cannot be compiled (torch.compile unsupported here, no C++ compiler, a dynamo error) training
        goes on eagerly with a warning; a failure to compile the backward (built lazily, in the first
        `backward()`) is raised. `enabled` False returns to eager."""
        self._train_run = None
        if not enabled:
            return
        try:
            self._train_run = torch.compile(self._run_layers, dynamic=False)
            keep_grouped_dispatch_out_of_graphs()
        except RuntimeError as exc:   # e.g. a Python that dynamo does not support
            logger.warning("torch.compile unavailable, training eagerly: %s", exc)
            return
        _raise_recompile_limit(4 * (len(self.model.layers) + 1))   # a few shapes: each compiles once per layer

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mixer: Mixer, used: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, list]:
        """Embed, run every layer with `mixer` as its token mixer, final norm. Returns (h, router logits).
        `used` [N,T] bool: the mixture of experts runs on those positions only (the others' outputs are
        zero and their router logits left out: padding whose results nobody reads)."""
        if self._train_run is not None and torch.is_grad_enabled():
            try:
                return self._train_run(ids, positions, mixer, used)
            except Exception as exc:
                if not _is_compile_error(exc):   # (a forward writes no state: rerunning it eagerly is safe)
                    raise
                logger.warning("compiled training forward unavailable, training eagerly: %s", exc)
                self._train_run = None
        return self._run_layers(ids, positions, mixer, used)

    def _run_layers(self, ids: torch.Tensor, positions: torch.Tensor, mixer: Mixer, used: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, list]:
        """`_run`, always eager (what `compile_training` compiles)."""
        h = self.model.embed_tokens(ids)
        rope = self.rotary(positions, h.dtype)
        at = None if used is None else used.nonzero(as_tuple=True)
        router_logits = []
        for i, layer in enumerate(self.model.layers):
            h = h + mixer(i, layer, layer.input_layernorm(h), rope)
            x = layer.post_attention_layernorm(h)
            if at is None:
                y, logits = layer.mlp(x)
            else:
                y = torch.zeros_like(x)
                y[at], logits = layer.mlp(x[at])
            router_logits.append(logits)
            h = h + y
        return self.model.norm(h), router_logits

    def _head(self, h: torch.Tensor, wanted: torch.Tensor | None = None) -> torch.Tensor:
        """LM-head logits [N,T,V] of h [N,T,D]; with `wanted` [N,T] bool, only those rows go through the head
        and the others are zero (at a large vocabulary the head is the largest single product of a block's
        forward, and a block whose slots are mostly resolved, or a padded check, needs few of its rows)."""
        at = None if wanted is None else wanted.nonzero(as_tuple=True)
        if at is None or len(at[0]) == wanted.numel():
            return self.lm_head(h)
        out = h.new_zeros(*h.shape[:-1], self.lm_head.out_features)
        out[at] = self.lm_head(h[at]).to(out.dtype)
        return out

    @staticmethod
    def _prefix_mask(past: torch.Tensor, p: int, t: int) -> torch.Tensor:
        """[N,1,T,P] bool: cached key j is visible to every new row when j < past[n]."""
        return (torch.arange(p, device=past.device)[None, :] < past[:, None])[:, None, None, :].expand(-1, 1, t, -1)

    # -- causal mode: prefill and commit -------------------------------------------------------------
    def causal(
        self, input_ids: torch.Tensor, cache: PrefixCache | None = None, lengths: torch.Tensor | None = None,
        logits: str = "all", rows: torch.Tensor | list[int] | slice | None = None, write: bool | str = True,
        gdn_trace: GDNTrace | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """Run input_ids [N,T] causally after the cache (if any) and append them to it (`write` False:
        read the cache only, leaving it as it was; "kv": what `check` does, K/V written past the lengths,
        the rest left as it was). `gdn_trace`, when given, receives each GDN layer's state and conv ring at
        the block boundaries it names (a prefix cache snapshots them), or, under "kv", every row's steps.

        `logits`: "all" -> [N,T,V]; "valid" -> the same with zeros at the positions past each row's length
        (their LM head skipped); "last" -> [N,V] at each row's last valid position; "none" -> None
        (a commit needs no logits); "train" -> (final hidden states [N,T,D], router aux loss). `rows`: the cache rows the N input rows belong to (default: all,
        in order), so that a sub-batch runs over a shared cache without copying it.
        """
        if logits not in ("all", "valid", "last", "none", "train"):
            raise ValueError(f"logits must be 'all', 'valid', 'last', 'none' or 'train', got {logits!r}")
        self._check_ids(input_ids, "input_ids")
        n, t = input_ids.shape
        if cache is not None:
            rows = self._cache_rows(cache, n, rows)
            past = cache.past(rows)
        else:
            past = torch.zeros(n, dtype=torch.long, device=input_ids.device)
        lengths = self._lengths(input_ids, lengths, past)
        if ("step" in self._compiled and t == 1 and write is True and cache is not None and logits in ("last", "all", "valid")
                and gdn_trace is None   # (the compiled step fills no trace: a caller that asks for one runs eagerly)
                and not isinstance(rows, torch.Tensor) and bool((lengths == 1).all())):
            cache.reserve(int(past.max()) + 1, self.config.max_position_embeddings)
            out = self._call_compiled("step", cache, rows, input_ids, past, lengths, False)
            if out is not None:
                cache.advance(rows, lengths)
                return out[:, 0] if logits == "last" else out
        p = int(past.max()) if cache is not None else 0
        kv_only = write == "kv"
        write = bool(write) and cache is not None
        if write:   # room for the padded input too: attention reads the new keys from the buffer
            cache.reserve(max(int((past + lengths).max()), p + t), self.config.max_position_embeddings)
        steps = torch.arange(t, device=input_ids.device)
        mask = None   # no row has a past: plain causal attention (padding comes after a row's tokens)
        if p > 0:
            causal = (steps[None, :] <= steps[:, None])[None, None].expand(n, 1, t, t)
            mask = torch.cat([self._prefix_mask(past, p, t), causal], dim=-1)  # [N,1,T,P+T]
        zero_ring = None
        snap = {} if gdn_trace is None or kv_only else gdn_trace.causal_args(past, self.config.block_size)

        def mixer(i: int, layer: DecoderLayer, x: torch.Tensor, rope: Rope) -> torch.Tensor:
            nonlocal zero_ring
            if layer.is_attention:
                join = (lambda k, v: cache.kv_with(i, rows, p, k, v)) if cache is not None and p > 0 else None
                out, k, v = layer.self_attn(x, *rope, mask, join=join)
                if write:
                    cache.write_kv(i, k, v, lengths, rows)
                return out
            if cache is not None:
                state, ring = cache.gdn(i, rows)
            else:
                zero_ring = zero_ring if zero_ring is not None else x.new_zeros(n, self.config.linear_conv_kernel_dim - 1,
                                                                             self.config.linear_conv_dim)
                state, ring = None, zero_ring
            res = layer.linear_attn.causal(x, state, ring, lengths, self.config.block_size, keep_steps=kv_only, **snap)
            if gdn_trace is not None:
                gdn_trace.record(i, res)
            if write and not kv_only:
                cache.set_gdn(i, rows, res.state, res.ring)
            return res.out

        valid = valid_mask(lengths, t) if t > 1 or logits == "train" else None   # (an `ar` step reads none)
        # padding (rows of different lengths: a check's drafts, prompts admitted together) skips the experts, which
        # hold most of a position's products, where no logits of it are returned (nor read by later positions)
        used = valid if t > 1 and logits in ("valid", "last", "none") else None
        if used is not None and int(used.sum()) in (0, used.numel()):   # (no padding; or nothing valid at all)
            used = None
        h, router_logits = self._run(input_ids, past[:, None] + steps[None, :], mixer, used)
        if write and not kv_only:
            cache.advance(rows, lengths)
        if logits == "train":
            aux = load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok,
                                      valid.reshape(-1))
            return h, aux
        if logits == "none":
            return None
        if logits == "last":
            h = h[torch.arange(n, device=h.device), (lengths - 1).clamp(min=0)]
        elif logits == "valid" and t > 1:
            return self._head(h, valid)
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Plain causal logits [N,T,V], no cache."""
        return self.causal(input_ids, None, lengths)

    # -- compiled decoding passes --------------------------------------------------------------------
    def compile_decode(self, enabled: bool = True, warmup: bool = False) -> None:
        """Run the decoding passes through `torch.compile` (inductor, weights frozen as constants, C++
        wrapper) over views of the sequences' cache rows, with no host synchronisation inside: the
        one-token cache-writing `causal` call (the `ar` step), `preview`, and `causal_and_preview` (block
        commits fused with a preview; at most a block of clean tokens, so not prefills) and `check`
        (`verify`'s causal check of a few drafts) with `keep` (the GDN state and ring after its kept rows),
        each where its rows are all or a slice and no `gdn_trace` is asked for. On 2 CPU
        cores the `ar` step takes about half the time (benchmarks/forward.py --compile). Each new shape
        class compiles once (tens of seconds to minutes on 2 cores; inductor keeps the result on disk for
        the next process). The weights and the modules' attributes must not change afterwards (the graphs hold the
        weights, and do not guard on the modules). `enabled` False returns to eager
        passes. `warmup`: compile the `ar` step now, for one row and for several (`Engine.warm_up` builds
        every policy's passes). Should a pass fail to compile on its first call (no C++ compiler, an
        unsupported torch), the GDN rows it may have written are restored and every pass falls back to
        eager with a warning; any other error, or a compile error after a pass has run, is raised."""
        self._compiled, self._compiled_ran = {}, set()
        if not enabled:
            return
        self.lm_head.pack()   # the graphs take the head's packed copy as it is now (LMHead)
        options: dict[str, object] = {"freezing": True, "cpp_wrapper": True}
        if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):   # (newer torch only)
            # no guards on the modules' attributes: the weights are frozen into the graphs already (they must
            # not change), and checking the modules' guards took ~0.2 ms of a compiled step's 4.8 (2 cores)
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        try:
            self._compiled = {name: torch.compile(fn, dynamic=True, options=dict(options)) for name, fn in  # (pops keys)
                              (("step", self._steps), ("check", self._check_views), ("keep", self._keep_views),
                               ("preview", self._preview_views), ("fused", self._fused_views))}
            keep_grouped_dispatch_out_of_graphs()
        except RuntimeError as exc:   # e.g. a Python that dynamo does not support
            logger.warning("torch.compile unavailable, decoding eagerly: %s", exc)
            self._compiled = {}
            return
        # A pass's graphs are specialised by the experts' dispatch (by token count) and a few shapes: a benchmark
        # of `verify` windows 4, 8 and 16 at batches 1 and 8 reached dynamo's default limit of 8 for the check,
        # whose later shapes then ran eagerly (session 53).
        _raise_recompile_limit(32)
        if warmup:
            with torch.inference_mode():
                for n in (1, 2):
                    ids = torch.zeros(n, 1, dtype=torch.long, device=self.device)
                    self.causal(ids, self.new_cache(n), logits="last")

    def _call_compiled(self, name: str, cache: PrefixCache, rows: slice | None, *args: object) -> object:
        """Compiled pass `name` over views of the cache rows (written in place), or None if it could not
        be compiled on its first call (then every pass is eager from now on). A graph broken in pieces
        (the grouped experts) runs its first pieces before the later ones compile, so the first call
        keeps a copy of the rows' GDN state and conv ring to put back before the eager rerun; K/V are
        only written past the rows' lengths, where the rerun writes them again."""
        r = slice(None) if rows is None else rows
        views = [[None if x is None else x[r] for x in xs] for xs in (cache.keys, cache.values, cache.states,
                                                                       cache.rings)]
        first = name not in self._compiled_ran
        saved = [None if x is None else x.clone() for x in views[2] + views[3]] if first else []
        try:
            out = self._compiled[name](*args, *views)
        except Exception as exc:
            if not first or not _is_compile_error(exc):
                raise
            for x, copy in zip(views[2] + views[3], saved, strict=True):
                if x is not None:
                    x.copy_(copy)
            logger.warning("compiled decoding passes unavailable, decoding eagerly: %s", exc)
            self._compiled = {}
            return None
        self._compiled_ran.add(name)
        return out

    def _steps(self, ids: torch.Tensor, past: torch.Tensor, lengths: torch.Tensor, check: bool, keys: list,
               values: list, states: list, rings: list) -> torch.Tensor | tuple[torch.Tensor, list, list]:
        """ids [n,T] run causally at positions past .. past+T-1 over per-layer cache views of their rows,
        without host synchronisation (what `compile_decode` compiles): K/V are written at those positions
        and attention reads the whole buffer with the positions after each row masked. The `ar` step (T = 1,
        `check` False) updates the GDN states and conv rings in place and returns logits [n,1,V]; a
        `verify` check leaves them and returns (logits [n,T,V], per layer every row's key, written row and
        decay, per layer the rows' pre-conv `u`) for `keep`. The cache lengths are the caller's."""
        n, t = ids.shape
        at_steps = past[:, None] + torch.arange(t, device=ids.device)[None, :]          # [n,T]
        mask = None
        for k in keys:
            if k is not None:
                mask = (torch.arange(k.shape[2], device=ids.device)[None, None, :] <= at_steps[:, :, None])[:, None]
                break
        trail_steps: list = [None] * len(states)
        trail_u: list = [None] * len(states)

        def mixer(i: int, layer: DecoderLayer, x: torch.Tensor, rope: Rope) -> torch.Tensor:
            if layer.is_attention:
                def join(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                    at = at_steps[:, None, :, None].expand(n, k.shape[1], t, k.shape[3])
                    keys[i].scatter_(2, at, k.to(keys[i].dtype))
                    values[i].scatter_(2, at, v.to(values[i].dtype))
                    return keys[i], values[i]

                return layer.self_attn(x, *rope, mask, join=join)[0]
            res = layer.linear_attn.causal(x, states[i], rings[i], lengths, self.config.block_size,
                                           keep_steps=check)
            if check:
                trail_steps[i], trail_u[i] = res.steps, res.u
            else:
                states[i].copy_(res.state)
                rings[i].copy_(res.ring.to(rings[i].dtype))
            return res.out

        h, _ = self._run(ids, at_steps, mixer)
        logits = self.lm_head(h)
        return (logits, trail_steps, trail_u) if check else logits

    def _check_views(self, *args: object) -> tuple[torch.Tensor, list, list]:
        return self._steps(*args)   # its own function: compiled shapes are counted per function

    # -- verify's causal check: run drafts, keep the verified rows -----------------------------------
    def check(
        self, input_ids: torch.Tensor, cache: PrefixCache, lengths: torch.Tensor | None = None,
        rows: torch.Tensor | list[int] | slice | None = None,
    ) -> tuple[torch.Tensor, CheckTrail]:
        """`verify`'s causal pass (spec section 5b): logits [N,T,V] of input_ids [N,T] (a few tokens) run
        causally after each row's cached prefix: row t predicts the token after it (rows past a row's
        length: zero, or their logits where the pass runs compiled). The rows' K/V are
        written past each cache row's length, where nothing reads them, and its GDN state, conv ring and
        length stay as they were: `keep` then takes the first rows of each input into the cache (those
        the causal head verified), so no state of a rejected draft is ever committed."""
        self._check_ids(input_ids, "input_ids")
        n, t = input_ids.shape
        rows = self._cache_rows(cache, n, rows)
        past = cache.past(rows)
        lengths = self._lengths(input_ids, lengths, past)
        cache.reserve(int(past.max()) + t, self.config.max_position_embeddings)
        if "check" in self._compiled and not isinstance(rows, torch.Tensor):
            out = self._call_compiled("check", cache, rows, input_ids, past, lengths, True)
            if out is not None:
                logits, steps, u = out
                return logits, CheckTrail(rows, lengths, steps, u)
        trace = GDNTrace()
        logits = self.causal(input_ids, cache, lengths=lengths, logits="valid", rows=rows, write="kv", gdn_trace=trace)
        layers = range(len(cache.states))
        return logits, CheckTrail(rows, lengths, [trace.steps.get(i) for i in layers], [trace.u.get(i) for i in layers])

    def keep(self, cache: PrefixCache, trail: CheckTrail, counts: torch.Tensor | list[int]) -> None:
        """Commit the first counts[n] rows of the last `check` input of each row (0 keeps none, at most
        the row's length): the lengths advance by them, each GDN state becomes the one after the last
        kept row (`gdn.delta_rule_kept`, from the cached state) and each conv ring holds the last W-1
        rows before it. The K/V of the kept rows are already in place."""
        kept, lengths = torch.as_tensor(counts).tolist(), trail.lengths.tolist()
        if len(kept) != len(lengths) or any(not 0 <= c <= n for c, n in zip(kept, lengths, strict=False)):
            raise ValueError(f"counts must be {len(lengths)} integers in [0, the checked lengths {lengths}], "
                             f"got {kept}")
        counts = torch.tensor(kept, dtype=torch.long, device=cache.lengths.device)
        if any(kept):
            compiled = "keep" in self._compiled and not isinstance(trail.rows, torch.Tensor)
            if not compiled or self._call_compiled("keep", cache, trail.rows, trail.steps, trail.u, counts) is None:
                self._keep_body(trail.steps, trail.u, counts, _CacheRows(cache, trail.rows))
        cache.advance(trail.rows, counts)

    def _keep_views(self, steps: list, us: list, counts: torch.Tensor, keys: list, values: list, states: list,
                    rings: list) -> bool:
        self._keep_body(steps, us, counts, _RowViews(keys, values, states, rings, None))
        return True   # (the compiled call returns None only when it could not compile)

    def kept_gdn(self, cache: PrefixCache, trail: CheckTrail, counts: torch.Tensor) -> dict[int, tuple[torch.Tensor,
                                                                                                  torch.Tensor]]:
        """What `keep` with these counts would make each GDN layer's state [N,H,K,V] and ring [N,W-1,Q], by
        layer index, leaving the cache as it is (a prefix cache snapshots a block boundary inside the kept
        rows)."""
        return self._kept(trail.steps, trail.u, counts, _CacheRows(cache, trail.rows))

    @staticmethod
    def _keep_body(steps: list, us: list, counts: torch.Tensor, rows: _CacheRows | _RowViews) -> None:
        for i, (state, ring) in CloverForCausalLM._kept(steps, us, counts, rows).items():
            rows.set_gdn(i, state, ring)

    @staticmethod
    def _kept(steps: list, us: list, counts: torch.Tensor, rows: _CacheRows | _RowViews
              ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every GDN layer's state and ring after the kept rows (`gdn.delta_rule_kept`), the layers' steps and
        rings stacked along the batch: one `kept_terms` and one `next_ring` for all of them (run layer by layer,
        a keep was dozens of small ops, 0.9 ms of a batch-1 check of ~12 ms on 2 cores)."""
        layers = [i for i, layer_steps in enumerate(steps) if layer_steps is not None]
        if not layers:
            return {}
        n, many = len(counts), counts.repeat(len(layers))
        scale, added = kept_terms(*(torch.cat([steps[i][j] for i in layers]) for j in range(3)), many)
        old = [rows.gdn(i) for i in layers]
        rings = next_ring(torch.cat([ring for _, ring in old]), torch.cat([us[i] for i in layers]), many)
        out = {}
        for j, (i, (state, _)) in enumerate(zip(layers, old, strict=True)):
            at = slice(j * n, (j + 1) * n)
            out[i] = ((scale[at, :, None, None] * state.float() + added[at]).to(state.dtype), rings[at])
        return out

    # -- preview mode: one denoising step over the current block -------------------------------------
    def preview(
        self, block_ids: torch.Tensor, cache: PrefixCache, lengths: torch.Tensor | None = None,
        rows: torch.Tensor | list[int] | None = None, masked_only: bool = False,
    ) -> torch.Tensor:
        """Logits [N,S,V] for a block [N,S] placed right after each cached prefix (of the cache `rows`,
        default all); the cache is not written. `masked_only`: the logits a decoder reads, those of the
        block's mask slots (within its length); the others are zero (or computed, where the pass runs
        compiled)."""
        self._check_ids(block_ids, "block_ids")
        n, s = block_ids.shape
        rows = self._cache_rows(cache, n, rows)
        past = cache.past(rows)
        lengths = self._lengths(block_ids, lengths, past)
        p = int(past.max())
        if "preview" in self._compiled and not isinstance(rows, torch.Tensor):
            cache.reserve(p + s, self.config.max_position_embeddings)    # the block's keys go past the prefix
            out = self._call_compiled("preview", cache, rows, block_ids, past, lengths, p)
            if out is not None:
                return out
        return self._preview_body(block_ids, past, lengths, p, _CacheRows(cache, rows),
                                  self._masked(block_ids, lengths) if masked_only else None)

    def _preview_views(self, block_ids: torch.Tensor, past: torch.Tensor, lengths: torch.Tensor, p: int,
                       keys: list, values: list, states: list, rings: list) -> torch.Tensor:
        return self._preview_body(block_ids, past, lengths, p, _RowViews(keys, values, states, rings, past))

    def _masked(self, block_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[N,S] bool: the block's mask slots within each row's length."""
        return (block_ids == self.config.mask_token_id) & valid_mask(lengths, block_ids.shape[1])

    def _preview_body(self, block_ids: torch.Tensor, past: torch.Tensor, lengths: torch.Tensor, p: int,
                      rows: _CacheRows | _RowViews, wanted: torch.Tensor | None = None) -> torch.Tensor:
        n, s = block_ids.shape
        steps = torch.arange(s, device=block_ids.device)
        inside = (steps[None, :] < lengths[:, None])[:, None, None, :].expand(n, 1, s, s)
        inside = inside | torch.eye(s, dtype=torch.bool, device=block_ids.device)  # padded rows see themselves
        mask = torch.cat([self._prefix_mask(past, p, s), inside], dim=-1)      # [N,1,S,P+S]

        def mixer(i: int, layer: DecoderLayer, x: torch.Tensor, rope: Rope) -> torch.Tensor:
            if layer.is_attention:
                join = (lambda k, v: rows.kv_with(i, p, k, v)) if p > 0 else None
                return layer.self_attn(x, *rope, mask, join=join)[0]
            return layer.linear_attn.preview(x, *rows.gdn(i), lengths)

        h, _ = self._run(block_ids, past[:, None] + steps[None, :], mixer)
        return self._head(h, wanted)

    # -- fused decoding pass: a causal stream and a preview in one forward ----------------------------
    def causal_and_preview(
        self, clean_ids: torch.Tensor, block_ids: torch.Tensor, cache: PrefixCache,
        clean_lengths: torch.Tensor | None = None, block_lengths: torch.Tensor | None = None,
        rows: torch.Tensor | list[int] | None = None, clean_logits: str = "last",
        gdn_trace: GDNTrace | None = None, masked_only: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One forward that does what `causal` and `preview` do apart (spec section 3: a fusion is
        allowed only where its results equal the separate passes; tests compare them): clean_ids [N,Tc]
        are appended to the cache (a block commit, or a prefill) and the block [N,S] is previewed right
        after them, over the cache they leave; this is the commit of one block and the first denoising
        step of the next. Returns (clean logits per `clean_logits` "all" / "last" / "none", block logits [N,S,V]).
        `gdn_trace` as in `causal`, for the clean stream; `masked_only` as in `preview`, for the block.
        """
        if clean_logits not in ("all", "last", "none"):
            raise ValueError(f"clean_logits must be 'all', 'last' or 'none', got {clean_logits!r}")
        self._check_ids(clean_ids, "clean_ids")
        self._check_ids(block_ids, "block_ids")
        n, tc = clean_ids.shape
        rows = self._cache_rows(cache, n, rows)
        past = cache.past(rows)
        clean_lengths = self._lengths(clean_ids, clean_lengths, past)
        block_lengths = self._lengths(block_ids, block_lengths, past + clean_lengths)
        p = int(past.max())
        # compiled for a block's commit, not for a prefill: the chunked scan's chunk count is a
        # Python loop bound, so every prompt length would compile its own graph
        if ("fused" in self._compiled and tc <= self.config.block_size and not isinstance(rows, torch.Tensor)
                and gdn_trace is None):
            cache.reserve(p + tc, self.config.max_position_embeddings)   # padded clean steps are written too
            out = self._call_compiled("fused", cache, rows, clean_ids, block_ids, past, clean_lengths, block_lengths,
                                      p, clean_logits)
            if out is not None:
                cache.advance(rows, clean_lengths)
                return out
        cache.reserve(int((past + clean_lengths).max()), self.config.max_position_embeddings)
        out = self._fused_body(clean_ids, block_ids, past, clean_lengths, block_lengths, p, clean_logits,
                               _CacheRows(cache, rows), gdn_trace,
                               self._masked(block_ids, block_lengths) if masked_only else None)
        cache.advance(rows, clean_lengths)
        return out

    def _fused_views(self, clean_ids: torch.Tensor, block_ids: torch.Tensor, past: torch.Tensor,
                     clean_lengths: torch.Tensor, block_lengths: torch.Tensor, p: int, clean_logits: str,
                     keys: list, values: list, states: list, rings: list) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self._fused_body(clean_ids, block_ids, past, clean_lengths, block_lengths, p, clean_logits,
                                _RowViews(keys, values, states, rings, past), None)

    def _fused_body(self, clean_ids: torch.Tensor, block_ids: torch.Tensor, past: torch.Tensor,
                    clean_lengths: torch.Tensor, block_lengths: torch.Tensor, p: int, clean_logits: str,
                    rows: _CacheRows | _RowViews, gdn_trace: GDNTrace | None,
                    wanted: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        (n, tc), s = clean_ids.shape, block_ids.shape[1]
        block_start = past + clean_lengths
        dev = clean_ids.device
        tc_steps, s_steps = torch.arange(tc, device=dev), torch.arange(s, device=dev)
        # keys: [cached prefix P | clean Tc | block S]; clean rows causal, block rows bidirectional inside
        # the block and over the valid clean rows too
        clean_rows = torch.cat([
            self._prefix_mask(past, p, tc),
            (tc_steps[None, :] <= tc_steps[:, None])[None, None].expand(n, 1, tc, tc),
            torch.zeros(n, 1, tc, s, dtype=torch.bool, device=dev)], dim=-1)
        sees_clean = tc_steps[None, :] < clean_lengths[:, None]
        inside = (s_steps[None, :] < block_lengths[:, None])[:, None, None, :].expand(n, 1, s, s)
        inside = inside | torch.eye(s, dtype=torch.bool, device=dev)
        block_rows = torch.cat([self._prefix_mask(past, p, s), sees_clean[:, None, None, :].expand(n, 1, s, tc),
                                inside], dim=-1)
        mask = torch.cat([clean_rows, block_rows], dim=2)                       # [N,1,Tc+S,P+Tc+S]
        snap = {} if gdn_trace is None else gdn_trace.causal_args(past, self.config.block_size)

        def mixer(i: int, layer: DecoderLayer, x: torch.Tensor, rope: Rope) -> torch.Tensor:
            if layer.is_attention:
                pk, pv = rows.kv(i, p) if p > 0 else (None, None)
                out, k, v = layer.self_attn(x, *rope, mask, pk, pv)
                rows.write_kv(i, k[:, :, :tc], v[:, :, :tc], clean_lengths)
                return out
            gdn = layer.linear_attn
            state, ring = rows.gdn(i)
            clean = gdn.causal(x[:, :tc], state, ring, clean_lengths, self.config.block_size, **snap)
            if gdn_trace is not None:
                gdn_trace.record(i, clean)
            rows.set_gdn(i, clean.state, clean.ring)
            return torch.cat([clean.out, gdn.preview(x[:, tc:], clean.state, clean.ring, block_lengths)], dim=1)

        positions = torch.cat([past[:, None] + tc_steps[None, :], block_start[:, None] + s_steps[None, :]], dim=1)
        h, _ = self._run(torch.cat([clean_ids, block_ids], dim=1), positions, mixer)
        hc, hb = h[:, :tc], h[:, tc:]
        if clean_logits == "none":
            out_clean = None
        elif clean_logits == "last":
            out_clean = self.lm_head(hc[torch.arange(n, device=dev), (clean_lengths - 1).clamp(min=0)])
        else:
            out_clean = self.lm_head(hc)
        return out_clean, self._head(hb, wanted)

    # -- training mode: both streams, every block in one pass ----------------------------------------
    def training_forward(
        self, clean_ids: torch.Tensor, noisy_ids: torch.Tensor, lengths: torch.Tensor | None = None,
        output: str = "logits",
    ) -> TrainingOutput:
        """Clean stream x [N,T] in causal mode and noisy stream x~ [N,T] as per-block previews over the
        clean prefix (spec section 3). `output` "hidden" returns final hidden states instead of logits."""
        self._check_ids(clean_ids, "clean_ids")
        self._check_ids(noisy_ids, "noisy_ids")
        if clean_ids.shape != noisy_ids.shape:
            raise ValueError(f"clean {tuple(clean_ids.shape)} and noisy {tuple(noisy_ids.shape)} shapes differ")
        n, t = clean_ids.shape
        b = self.config.block_size
        w = self.config.linear_conv_kernel_dim
        lengths = self._lengths(clean_ids, lengths, None)
        nb = -(-t // b)
        dev = clean_ids.device
        pos = torch.arange(t, device=dev)
        blk = pos // b
        # visibility: clean rows causal over clean keys (and no noisy key); noisy rows see the clean keys of
        # earlier blocks and the noisy keys of their own block (valid ones; padded rows see themselves). The
        # two kinds of rows attend apart: the clean rows as plain causal attention (whose kernel skips the
        # blocks above the diagonal), the noisy rows over [clean; noisy] keys with this [N,1,T,2T] mask.
        key_ok = pos[None, :] < lengths[:, None]                                 # [N,T]
        nc = (blk[None, :] < blk[:, None])[None].expand(n, t, t)
        nn_ = (blk[None, :] == blk[:, None])[None] & key_ok[:, None, :]
        nn_ = nn_ | torch.eye(t, dtype=torch.bool, device=dev)[None]
        noisy_mask = torch.cat([nc, nn_], dim=-1)[:, None]                      # [N,1,T,2T]
        block_len = (lengths[:, None] - torch.arange(nb, device=dev)[None, :] * b).clamp(0, b)  # [N,nB]

        def mixer(i: int, layer: DecoderLayer, x: torch.Tensor, rope: Rope) -> torch.Tensor:
            if layer.is_attention:
                (cos_c, cos_n), (sin_c, sin_n) = (r.split(t, dim=1) for r in rope)
                out_c, k_c, v_c = layer.self_attn(x[:, :t], cos_c, sin_c, None)
                out_n = layer.self_attn(x[:, t:], cos_n, sin_n, noisy_mask, past_k=k_c, past_v=v_c)[0]
                return torch.cat([out_c, out_n], dim=1)
            gdn = layer.linear_attn
            xc, xn = x[:, :t], x[:, t:]
            ring0 = x.new_zeros(n, w - 1, self.config.linear_conv_dim)
            clean = gdn.causal(xc, None, ring0, lengths, b, return_chunk_states=True)
            states = clean.chunk_states.transpose(1, 2).flatten(0, 1)            # [N*nB,H,K,V]
            # ring before block j: clean u rows jB-W+1 .. jB-1 (zeros before position 0)
            u = F.pad(clean.u, (0, 0, w - 1, nb * b - t))                      # [N,W-1+nB*S,Q]
            rings = u.unfold(1, w - 1, b)[:, :nb].transpose(-1, -2).reshape(n * nb, w - 1, -1)
            xn = F.pad(xn, (0, 0, 0, nb * b - t)).reshape(n * nb, b, -1)         # [N*nB,S,D]
            out = gdn.preview(xn, states, rings, block_len.reshape(-1)).reshape(n, nb * b, -1)[:, :t]
            return torch.cat([clean.out, out], dim=1)

        h, router_logits = self._run(torch.cat([clean_ids, noisy_ids], dim=1), torch.cat([pos, pos])[None].expand(n, -1),
                                     mixer)
        valid = torch.cat([key_ok, key_ok], dim=1).reshape(-1)
        aux = load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok, valid)
        if output == "logits":
            h = self.lm_head(h)
        elif output != "hidden":
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        return TrainingOutput(h[:, :t], h[:, t:], aux)
