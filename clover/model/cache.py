"""The prefix cache of a batch of sequences (spec section 3): what a commit writes and a preview reads.

Dimension letters: N sequences, G kv heads, P capacity (positions), D head dim, H GDN value heads,
K / V GDN key / value dims, W conv width, Q conv channels.

Per attention layer: keys / values [N,G,P,D] (positions >= lengths[n] are unused).
Per GDN layer: the recurrent state [N,H,K,V] in fp32 and the conv ring [N,W-1,Q], the pre-conv
`in_proj_qkv` rows of the last W-1 committed positions (zeros before the sequence start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clover.model.config import CloverConfig

_GROW = 256  # capacity grows in steps of this many positions


@dataclass
class PrefixCache:
    lengths: torch.Tensor                    # [N] committed positions per sequence
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    states: list[torch.Tensor | None]
    rings: list[torch.Tensor | None]

    @classmethod
    def empty(
        cls, config: CloverConfig, batch_size: int, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> PrefixCache:
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        states: list[torch.Tensor | None] = []
        rings: list[torch.Tensor | None] = []
        for kind in config.layer_types:
            if kind == "full_attention":
                shape = (batch_size, config.num_key_value_heads, 0, config.head_dim)
                keys.append(torch.zeros(shape, device=device, dtype=dtype))
                values.append(torch.zeros(shape, device=device, dtype=dtype))
                states.append(None)
                rings.append(None)
            else:
                keys.append(None)
                values.append(None)
                states.append(torch.zeros(
                    batch_size, config.linear_num_value_heads, config.linear_key_head_dim,
                    config.linear_value_head_dim, device=device, dtype=torch.float32,
                ))
                rings.append(torch.zeros(
                    batch_size, config.linear_conv_kernel_dim - 1, config.linear_conv_dim, device=device, dtype=dtype
                ))
        lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(lengths, keys, values, states, rings)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        for k in self.keys:
            if k is not None:
                return k.shape[2]
        return 1 << 62  # no attention layer: unbounded

    def reserve(self, positions: int, limit: int | None = None) -> None:
        """Grow the K/V buffers so that `positions` positions fit: to twice the capacity (so that a sequence
        growing a block at a time copies each position's K/V O(1) times, not once per 256 positions), in
        steps of 256, but not past `limit` (the model's context) beyond what `positions` needs."""
        if positions <= self.capacity:
            return
        target = 2 * self.capacity if limit is None else min(2 * self.capacity, limit)
        new_cap = -(-max(positions, target) // _GROW) * _GROW
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    grown = t.new_zeros(t.shape[0], t.shape[1], new_cap, t.shape[3])
                    grown[:, :, : t.shape[2]] = t
                    store[i] = grown

    def _rows(self, rows: torch.Tensor | slice | None) -> torch.Tensor | slice:
        """Index of `rows`: all rows, a slice (views: nothing copied) or a tensor of rows (copies)."""
        return slice(None) if rows is None else rows

    def past(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Committed lengths [n] of `rows` (all rows when None)."""
        return self.lengths[self._rows(rows)]

    def kv(self, layer: int, rows: torch.Tensor | None, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first p positions of K and V [n,G,p,D] of `rows`."""
        r = self._rows(rows)
        return self.keys[layer][r, :, :p], self.values[layer][r, :, :p]

    def kv_with(self, layer: int, rows: torch.Tensor | slice | None, p: int, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [n,G,p+T,D] of `rows`: the first p cached positions followed by k, v [n,G,T,D]. Where the
        buffer has room and the rows are all or a slice, k and v are written into the unused positions
        p .. p+T-1 of the buffer (beyond every row's committed length, so nothing committed changes) and
        views are returned: no copy of the cached positions. Otherwise the two are concatenated."""
        t = k.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(rows, torch.Tensor) or keys.dtype != k.dtype or p + t > keys.shape[2]:
            pk, pv = self.kv(layer, rows, p)
            return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        r = self._rows(rows)
        keys[r, :, p: p + t] = k
        values[r, :, p: p + t] = v
        return keys[r, :, : p + t], values[r, :, : p + t]

    def gdn(self, layer: int, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The GDN state [n,H,K,V] and conv ring [n,W-1,Q] of `rows`."""
        r = self._rows(rows)
        return self.states[layer][r], self.rings[layer][r]

    def set_gdn(self, layer: int, rows: torch.Tensor | None, state: torch.Tensor, ring: torch.Tensor) -> None:
        if rows is None:
            self.states[layer], self.rings[layer] = state, ring.to(self.rings[layer].dtype)
        else:
            self.states[layer][rows] = state
            self.rings[layer][rows] = ring.to(self.rings[layer].dtype)

    def write_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, new_lengths: torch.Tensor, rows: torch.Tensor | None = None
    ) -> None:
        """Append k, v [n,G,T,D] at each row's current length; steps t >= new_lengths are dropped."""
        t_len = k.shape[2]
        valid = torch.arange(t_len, device=k.device)[None, :] < new_lengths[:, None]     # [n,T]
        seq, step = valid.nonzero(as_tuple=True)
        row = seq if rows is None else seq + rows.start if isinstance(rows, slice) else rows[seq]
        pos = self.lengths[row] + step
        self.keys[layer][row, :, pos] = k[seq, :, step].to(self.keys[layer].dtype)
        self.values[layer][row, :, pos] = v[seq, :, step].to(self.values[layer].dtype)

    def advance(self, rows: torch.Tensor | None, new_lengths: torch.Tensor) -> None:
        if rows is None:
            self.lengths = self.lengths + new_lengths
        else:
            self.lengths[rows] += new_lengths

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Empty the given rows so that new sequences can use them (K/V past the length are never read)."""
        r = torch.as_tensor(rows, dtype=torch.long, device=self.lengths.device)
        self.lengths[r] = 0
        for xs in (self.states, self.rings):
            for x in xs:
                if x is not None:
                    x[r] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move the sequence in row `src` to row `dst`: its committed K/V, GDN state, conv ring and length
        (K/V past the length are never read, so they stay behind). Row `src` is then free."""
        n = int(self.lengths[src])
        for store in (self.keys, self.values):
            for x in store:
                if x is not None:
                    x[dst, :, :n] = x[src, :, :n]
        for xs in (self.states, self.rings):
            for x in xs:
                if x is not None:
                    x[dst] = x[src]
        self.lengths[dst] = n

    def select(self, index: torch.Tensor | list[int]) -> PrefixCache:
        """A cache holding only the sequences at `index` (in that order)."""
        idx = torch.as_tensor(index, dtype=torch.long, device=self.lengths.device)

        def pick(xs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            return [None if x is None else x.index_select(0, idx) for x in xs]

        return PrefixCache(self.lengths[idx], pick(self.keys), pick(self.values), pick(self.states), pick(self.rings))

    @staticmethod
    def concat(caches: list[PrefixCache]) -> PrefixCache:
        """One cache holding the sequences of all `caches`, in order."""
        cap = max(c.capacity for c in caches)
        for c in caches:
            c.reserve(cap)

        def cat(xs: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
            return [None if col[0] is None else torch.cat(col, dim=0) for col in zip(*xs, strict=True)]

        return PrefixCache(
            torch.cat([c.lengths for c in caches]),
            cat([c.keys for c in caches]), cat([c.values for c in caches]),
            cat([c.states for c in caches]), cat([c.rings for c in caches]),
        )
