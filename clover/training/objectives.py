"""Training objectives (spec section 4): autoregressive, and block diffusion with its options.

Block diffusion: per block a mask ratio t ~ U(eps, 1); each eligible position is masked with
probability t (or exactly round(t * n) of them); the loss is the noisy-stream cross-entropy on masked
positions weighted by 1/t and normalised by the number of eligible tokens (the masked-diffusion
ELBO); the plain masked-token cross-entropy is reported too. Options: an AR loss on the clean
stream, the router load-balancing loss, complementary masking (a second noisy copy with the
complement mask, so every token is scored), and certainty forcing (in the spirit of dParallel: the
entropy of the noisy stream's prediction at masked positions it already predicts right, so that
right guesses become confident enough to commit in parallel; weighted by `certainty_weight`,
normalised like the ELBO by the eligible tokens). SFT is the same with only assistant tokens eligible;
with `eos_fill`, the noisy stream also learns the end-of-turn token at the positions after a reply's end
up to its block's end (`eos_tails`), where the decoder fills the block with it, instead of never seeing
them masked (LLaDA pads its SFT replies with |EOS| for the same reason).

All reductions are sums over the rows given, divided by a denominator computed from the whole
global batch, so that data-parallel ranks add up to exactly the single-process loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import FunctionCtx

from clover.model.modeling import CloverForCausalLM


@dataclass(frozen=True)
class ObjectiveConfig:
    kind: str = "ar"                  # "ar" or "diffusion"
    ar_loss_weight: float = 0.0       # diffusion: weight of the AR loss on the clean stream
    loss_weighting: str = "elbo"      # "elbo" (1/t) or "none"
    complementary: bool = False
    mask_mode: str = "bernoulli"      # "bernoulli" or "exact"
    eps: float = 1e-3
    aux_loss_coef: float | None = None  # None: the model config's router_aux_loss_coef
    certainty_weight: float = 0.0     # diffusion: weight of the entropy at right-predicted masked positions
    eos_fill: bool = False            # diffusion SFT: the noisy stream learns end-of-turn after a reply's end (eos_tails)

    def validate(self) -> None:
        if self.kind not in ("ar", "diffusion"):
            raise ValueError(f"objective must be 'ar' or 'diffusion', got {self.kind!r}")
        if self.loss_weighting not in ("elbo", "none"):
            raise ValueError(f"loss_weighting must be 'elbo' or 'none', got {self.loss_weighting!r}")
        if self.mask_mode not in ("bernoulli", "exact"):
            raise ValueError(f"mask_mode must be 'bernoulli' or 'exact', got {self.mask_mode!r}")
        if not 0 < self.eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        for name in ("ar_loss_weight", "certainty_weight"):
            if not 0 <= getattr(self, name) < math.inf:   # NaN fails too
                raise ValueError(f"{name} must be a finite number >= 0, got {getattr(self, name)}")
        if self.kind == "ar":   # settings of the diffusion loss would be ignored without a word
            plain = ObjectiveConfig()
            unused = [name for name in ("ar_loss_weight", "loss_weighting", "complementary", "mask_mode", "eps",
                                        "certainty_weight", "eos_fill") if getattr(self, name) != getattr(plain, name)]
            if unused:
                raise ValueError(f"{', '.join(unused)} only apply to the diffusion objective (--objective diffusion)")


@dataclass
class Noise:
    masked: torch.Tensor   # [N,T] bool
    t: torch.Tensor        # [N,T] the mask ratio of each position's block


def sample_noise(eligible: torch.Tensor, block_size: int, cfg: ObjectiveConfig, gen: torch.Generator) -> list[Noise]:
    """Masks for the rows of `eligible` [N,T]; two complementary ones when cfg.complementary."""
    n, t_len = eligible.shape
    nb = -(-t_len // block_size)
    t_block = cfg.eps + (1 - cfg.eps) * torch.rand(n, nb, generator=gen)                   # [N,nB]
    t_pos = t_block.repeat_interleave(block_size, dim=1)[:, :t_len]                        # [N,T]
    u = torch.rand(n, t_len, generator=gen)
    if cfg.mask_mode == "bernoulli":
        masked = eligible & (u < t_pos)
    else:  # exactly round(t * n_eligible) per block: the lowest random scores among eligible slots
        pad = nb * block_size - t_len
        scores = F.pad(torch.where(eligible, u, 2.0), (0, pad), value=2.0).view(n, nb, block_size)
        count = (F.pad(eligible, (0, pad)).view(n, nb, block_size).sum(-1) * t_block).round()  # [N,nB]
        rank = scores.argsort(-1).argsort(-1)
        masked = (rank < count[..., None]).view(n, -1)[:, :t_len] & eligible
    noises = [Noise(masked, t_pos)]
    if cfg.complementary:
        noises.append(Noise(eligible & ~masked, (1 - t_pos).clamp(min=cfg.eps)))
    return noises


def eos_tails(ids: torch.Tensor, eligible: torch.Tensor, lengths: torch.Tensor, block_size: int,
              end_id: int) -> torch.Tensor:
    """[N,T] long, -1 but at the positions after each reply's end: there `end_id` (the end-of-turn token,
    `<|im_end|>`, where it is eligible), from the position after it to its block's end. Only that token: in
    SFT, code and English rows are eligible throughout, and the `<|endoftext|>` between their documents is no
    reply's end (the next document must stay as it is). At inference the decoder fills the rest of a block
    with the token that ended the reply; in SFT rows those positions hold the next turn's prompt, never
    masked (not eligible), so the noisy stream never learns to end a block there. The reply's
    own tokens after its end token (the template's new line) are part of the tail. A block in which another
    reply starts after the end is left as it is: that reply's prompt tokens must stay what they are."""
    out = torch.full_like(ids, -1)
    for r in range(ids.shape[0]):
        n = int(lengths[r])
        row, ok = ids[r, :n].tolist(), eligible[r, :n].tolist()
        for e in (i for i in range(n) if ok[i] and row[i] == end_id):
            stop = min((e // block_size + 1) * block_size, n)
            j = e + 1
            while j < stop and ok[j]:   # the rest of this reply
                j += 1
            if e + 1 < stop and not any(ok[j:stop]):
                out[r, e + 1: stop] = row[e]
    return out


def noised_positions(eligible: torch.Tensor, tails: torch.Tensor | None) -> torch.Tensor:
    """[N,T] bool: the positions the noisy stream may mask and learns, the eligible ones and the `eos_tails`."""
    return eligible if tails is None else eligible | (tails >= 0)


LCE_CHUNK_ELEMENTS = 1 << 21   # logits per chunk of `linear_cross_entropy` (8 MiB in float32)


class _LinearCrossEntropy(torch.autograd.Function):
    """See `linear_cross_entropy`. The gradients of the weighted sum are computed with the loss, chunk by
    chunk (softmax minus the one-hot target, times the row's weight), and scaled in `backward`."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                targets: torch.Tensor, row_weights: torch.Tensor | None, grads: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = hidden.to(dtype), weight.to(dtype)
        rows, vocab = h.shape[0], w.shape[0]
        chunk = max(1, LCE_CHUNK_ELEMENTS // vocab)
        acc = torch.promote_types(dtype, torch.float32)   # the softmax's dtype: float32, or float64 inputs'
        ce = torch.empty(rows, dtype=acc, device=h.device)
        grad_h = torch.empty_like(hidden) if grads else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=w.device) if grads else None   # summed over chunks
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            logits = (h[start:end] @ w.T).to(acc)                                           # [c,V]
            lse = torch.logsumexp(logits, dim=-1)
            t = targets[start:end]
            ce[start:end] = lse - logits.gather(1, t[:, None])[:, 0]
            if grads:
                p = logits.sub_(lse[:, None]).exp_()                   # the softmax, in place of the logits
                p[torch.arange(end - start, device=p.device), t] -= 1
                if row_weights is not None:
                    p.mul_(row_weights[start:end, None].to(p.dtype))
                p = p.to(dtype)
                grad_h[start:end] = (p @ w).to(hidden.dtype)
                grad_w += (p.T @ h[start:end]).to(acc)
        total = (ce * row_weights).sum() if row_weights is not None else ce.sum()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if grads else None)
        ctx.mark_non_differentiable(ce)
        return total, ce

    @staticmethod
    def backward(ctx: FunctionCtx, grad_total: torch.Tensor, grad_ce: torch.Tensor) -> tuple:  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_total.to(grad_h.dtype), grad_w * grad_total.to(grad_w.dtype), None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         row_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of row_weights * CE, the CE of each row [M], not differentiable) of the logits
    hidden [M,H] @ weight[V,H].T against targets [M]: what `F.cross_entropy(F.linear(hidden, weight).float(),
    targets, reduction="none")` and its weighted sum give (the loss the objectives computed before), computed
    in row chunks, so that no [M,V] logits, log-softmax or gradient of them is ever held (an [M,V] zero fill
    and a log-softmax and its backward were 9% of an AR training step of the recipe, clover-tiny's 8192-token
    head over 4,088 rows, AMD EPYC with AVX2; docs/measurements.md, session 39). Under autocast the products
    run in its dtype, as F.linear's would; the softmax in float32 (float64 for float64 inputs). `row_weights`
    are constants (no gradient)."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets,
                                         None if row_weights is None else row_weights.detach(), grads, dtype)


def _ar_sums(model: CloverForCausalLM, hidden: torch.Tensor, ids: torch.Tensor, eligible: torch.Tensor
             ) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropies over positions whose target is eligible, and their count."""
    targets = eligible[:, 1:]
    ce, _ = linear_cross_entropy(hidden[:, :-1][targets], model.lm_head.weight, ids[:, 1:][targets])
    return ce, int(targets.sum())


def compute_loss(
    model: CloverForCausalLM, ids: torch.Tensor, eligible: torch.Tensor, lengths: torch.Tensor,
    cfg: ObjectiveConfig, noises: list[Noise] | None, denominators: dict[str, float],
    tails: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss of these rows; `denominators` ("tokens", "ar_targets") come from the global batch. `tails` (from
    `eos_tails`, diffusion): where >= 0, the token the noisy stream learns there instead of `ids` (its masks,
    and "tokens", count those positions as eligible); the clean stream and the AR loss keep `ids`.

    Returns (loss, sums): sums of the reported quantities over these rows, for the caller to
    add up across ranks and divide.
    """
    coef = model.config.router_aux_loss_coef if cfg.aux_loss_coef is None else cfg.aux_loss_coef
    if cfg.kind == "ar":
        hidden, aux = model.causal(ids, None, lengths, logits="train")
        ce, count = _ar_sums(model, hidden, ids, eligible)
        loss = ce / max(denominators["ar_targets"], 1)
        sums = {"ar_ce_sum": float(ce.detach()), "ar_targets": count}
        if coef > 0:
            loss = loss + coef * aux * ids.shape[0] / max(denominators["rows"], 1)
            sums["aux_sum"] = float(aux.detach()) * ids.shape[0]
        return loss, sums
    mask_id = model.config.mask_token_id
    copies = len(noises)
    x0 = ids if tails is None else torch.where(tails >= 0, tails, ids)     # what the noisy stream reconstructs
    noisy = torch.cat([torch.where(nz.masked, torch.full_like(ids, mask_id), x0) for nz in noises])
    clean = ids.repeat(copies, 1)
    out = model.training_forward(clean, noisy, lengths.repeat(copies), output="hidden")
    masked = torch.cat([nz.masked for nz in noises])
    t = torch.cat([nz.t for nz in noises])
    targets = x0.repeat(copies, 1)[masked]
    noised = noised_positions(eligible, tails)
    weight = 1.0 / t[masked] if cfg.loss_weighting == "elbo" else None
    if cfg.certainty_weight > 0:   # the certainty term reads the logits themselves
        logits = model.lm_head(out.noisy[masked]).float()                                      # [M,V]
        ce = F.cross_entropy(logits, targets, reduction="none")                                  # [M]
        elbo_sum = (ce * weight).sum() if weight is not None else ce.sum()
    else:
        elbo_sum, ce = linear_cross_entropy(out.noisy[masked], model.lm_head.weight, targets, weight)
    loss = elbo_sum / max(denominators["tokens"] * copies, 1)
    sums = {"diffusion_loss_sum": float(elbo_sum.detach()), "masked_ce_sum": float(ce.detach().sum()), "masked": int(masked.sum()),
            "tokens": int(noised.sum()) * copies}
    if cfg.certainty_weight > 0:
        right = logits.detach().argmax(-1) == targets                                            # [M]
        logp = F.log_softmax(logits[right], dim=-1)
        entropy_sum = -(logp.exp() * logp).sum()
        loss = loss + cfg.certainty_weight * entropy_sum / max(denominators["tokens"] * copies, 1)
        sums.update(certainty_entropy_sum=float(entropy_sum.detach()), masked_right=int(right.sum()))
    if cfg.ar_loss_weight > 0:
        ar_ce, count = _ar_sums(model, out.clean[: ids.shape[0]], ids, eligible)
        loss = loss + cfg.ar_loss_weight * ar_ce / max(denominators["ar_targets"], 1)
        sums.update(ar_ce_sum=float(ar_ce.detach()), ar_targets=count)
    if coef > 0:
        loss = loss + coef * out.aux_loss * ids.shape[0] / max(denominators["rows"], 1)
        sums["aux_sum"] = float(out.aux_loss.detach()) * ids.shape[0]
    return loss, sums
