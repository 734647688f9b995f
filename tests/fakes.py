"""A scripted stand-in for the model: the engine sees known confidences and we see every call."""

from __future__ import annotations

import math

import torch

from clover.model.cache import PrefixCache
from clover.model.config import CloverConfig


def row_list(rows) -> list[int]:
    """Cache rows as the engine passes them (a slice of consecutive rows, or a tensor) as a list."""
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


class ScriptedModel:
    """preview logits come from `script(j, position) -> (token, probability)`, where j counts the
    previews of the current block of that cache row (0 first) and position is absolute; AR logits
    come from `ar_script(position) -> (token, probability)`. Every call is logged."""

    def __init__(self, script=None, ar_script=None, config: CloverConfig | None = None) -> None:
        self.config = config or CloverConfig.preset("debug", vocab_size=64, mask_token_id=63, eos_token_id=62)
        self.script = script or (lambda j, pos: (pos % 50, 0.5))
        self.ar_script = ar_script or (lambda pos: (pos % 50, 0.5))
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.calls: list[tuple] = []
        self.previews: dict[int, int] = {}

    def new_cache(self, n: int) -> PrefixCache:
        return PrefixCache.empty(self.config, n)

    def _logits(self, token: int, prob: float) -> torch.Tensor:
        v = self.config.vocab_size
        rest = math.log((1 - prob) / (v - 2)) if prob < 1 else -1e9
        out = torch.full((v,), rest)
        out[token] = math.log(prob)
        out[self.config.mask_token_id] = float("-inf")
        return out

    def causal(self, ids, cache, lengths, logits="all", rows=None, write=True, gdn_trace=None):
        rows = row_list(rows)
        self.calls.append(("causal", [ids[i, : int(n)].tolist() for i, n in enumerate(lengths)], rows))
        starts = cache.lengths[rows].tolist()
        cache.lengths[rows] += lengths
        for r in rows:
            self.previews[r] = 0
        if logits == "none":
            return None
        return torch.stack([self._logits(*self.ar_script(s + int(n))) for s, n in zip(starts, lengths, strict=True)])

    def causal_and_preview(self, clean, block, cache, clean_lengths, block_lengths, rows, clean_logits="last",
                           gdn_trace=None, masked_only=False):
        """The fused pass as its two parts: a commit of the clean rows that have any (logged as a causal
        call, as the separate passes would be), then the preview of every block."""
        some = [i for i, n in enumerate(clean_lengths.tolist()) if n > 0]
        last = torch.zeros(clean.shape[0], self.config.vocab_size)
        if some:
            idx = torch.tensor(some)
            out = self.causal(clean[idx], cache, clean_lengths[idx], "none" if clean_logits == "none" else "last",
                              torch.tensor(row_list(rows))[idx])
            if out is not None:
                last[idx] = out
        return last, self.preview(block, cache, block_lengths, rows, masked_only)

    def preview(self, block, cache, lengths, rows=None, masked_only=False):
        rows = row_list(rows)
        self.calls.append(("preview", [block[i, : int(n)].tolist() for i, n in enumerate(lengths)], rows))
        out = torch.zeros(block.shape[0], block.shape[1], self.config.vocab_size)
        for i, r in enumerate(rows):
            j = self.previews.get(r, 0)
            self.previews[r] = j + 1
            start = int(cache.lengths[r])
            for t in range(block.shape[1]):
                out[i, t] = self._logits(*self.script(j, start + t))
        if masked_only:   # rows the caller said it would not read: NaN, so that reading one shows
            inside = torch.arange(block.shape[1])[None, :] < torch.as_tensor(lengths)[:, None]
            out[(block != self.config.mask_token_id) | ~inside] = float("nan")
        return out


class CharTokenizer:
    """ids 0..25 are the letters a..z, 26 is a space; everything else decodes to '#'."""

    def decode(self, ids):
        return "".join(chr(97 + i) if i < 26 else " " if i == 26 else "#" for i in ids)


class TextScriptModel(ScriptedModel):
    """Autoregressive fake that writes `target` (token ids) after any prompt, then end-of-sequence."""

    def __init__(self, target: list[int], config: CloverConfig) -> None:
        super().__init__(config=config)
        self.target = list(target)
        self.prompt_len: dict[int, int] = {}

    def __call__(self, ids):
        """A whole causal pass without a cache (prompt scoring): each position predicts the script's first
        token, with the same confidence as decoding."""
        first = self.target[0] if self.target else self.config.eos_token_ids[0]
        return self._logits(first, 0.99).expand(ids.shape[0], ids.shape[1], -1)

    def causal(self, ids, cache, lengths, logits="all", rows=None, write=True, gdn_trace=None):
        rows_l = row_list(rows)
        starts = cache.lengths[rows_l].tolist()
        for r, s, n in zip(rows_l, starts, lengths.tolist(), strict=True):
            if s == 0:
                self.prompt_len[r] = n
        cache.lengths[rows_l] += lengths
        if logits == "none":
            return None
        eos = self.config.eos_token_ids[0]
        out = []
        for r, s, n in zip(rows_l, starts, lengths.tolist(), strict=True):
            k = s + n - self.prompt_len[r]
            out.append(self._logits(self.target[k] if k < len(self.target) else eos, 0.99))
        return torch.stack(out)
