"""Prefix cache across requests: snapshots of committed prefixes at block boundaries (issue 13).

A hybrid model cannot keep per-token state for its Gated DeltaNet layers, only one recurrent state,
so prefixes are snapshotted where Clover commits anyway: at block boundaries (blocks are aligned to
absolute positions). One entry per block, keyed by a hash chain over the token blocks so far (the key
of block k covers every token before it): the block's attention K/V, and each GDN layer's state and
conv ring after the block. A request whose prompt starts with cached blocks restores them into its
cache row (copies of K/V, state and ring) and prefills only the rest; entries come from prefills
(per-block states from the chunked scan, its chunks on the sequence's boundaries), block commits and AR
steps that end a block, and the boundaries inside a commit or a `verify` keep of a request whose block
size does not divide the model's (the keep's from its check's steps, `model.kept_gdn`).

Bounded by a byte budget; eviction takes the least recently used block among those that no cached
block continues (a leaf of the tree of prefixes, as a radix cache does), so a shared beginning such
as a system prompt outlives the conversations that grew from it; a block whose parent is gone is not
kept (no lookup could reach it). An eviction makes a later lookup reuse less, never something wrong. Restored states are the very tensors an earlier
forward computed; a continuation is as exact as the forward that made the snapshot (an AR-made
snapshot went through the recurrent form, a prefill through the chunked one: equal to about 1e-6).

Dimension letters: G kv heads, S block size, D head dim, H GDN value heads, K / V GDN key / value
dims, W conv width, Q conv channels.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from clover.model.cache import PrefixCache


def block_keys(tokens: Sequence[int], block_size: int, start: list[bytes] | None = None) -> list[bytes]:
    """Chain keys of every complete block of `tokens` (extending `start`, the keys already known)."""
    keys = list(start or [])
    for b in range(len(keys), len(tokens) // block_size):
        h = hashlib.blake2b(keys[-1] if keys else b"clover", digest_size=16)
        h.update(np.asarray(tokens[b * block_size: (b + 1) * block_size], dtype=np.int64).tobytes())
        keys.append(h.digest())
    return keys


@dataclass
class Entry:
    keys: list[torch.Tensor | None]      # per attention layer [G,S,D] (None for GDN layers)
    values: list[torch.Tensor | None]
    states: list[torch.Tensor | None]    # per GDN layer [H,K,V] after the block (None for attention)
    rings: list[torch.Tensor | None]     # per GDN layer [W-1,Q] after the block
    nbytes: int
    parent: bytes | None                 # the key of the block before (None for block 0)
    children: int = 0                    # cached blocks that continue this one


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0                 # lookups that reused at least one block
    tokens_reused: int = 0
    tokens_looked_up: int = 0     # prompt tokens that could have been reused
    inserted: int = 0
    evictions: int = 0

    def to_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "tokens_reused": self.tokens_reused,
                "tokens_looked_up": self.tokens_looked_up, "inserted": self.inserted, "evictions": self.evictions}


@dataclass
class PrefixStore:
    block_size: int
    max_bytes: int
    entries: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    nbytes: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {self.max_bytes}")

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    # -- lookup and restore ------------------------------------------------------------------------
    def match(self, keys: list[bytes], limit_blocks: int) -> int:
        """How many leading blocks (at most `limit_blocks`) are cached, marking them recently used."""
        n = 0
        while n < min(len(keys), limit_blocks) and keys[n] in self.entries:
            self.entries.move_to_end(keys[n])
            n += 1
        return n

    def restore(self, cache: PrefixCache, row: int, keys: list[bytes]) -> None:
        """Write the cached blocks `keys` (a chain from block 0) into an empty cache row."""
        s = self.block_size
        cache.reserve(len(keys) * s)
        for b, key in enumerate(keys):
            e = self.entries[key]
            for layer, k in enumerate(e.keys):
                if k is not None:
                    cache.keys[layer][row, :, b * s:(b + 1) * s] = k
                    cache.values[layer][row, :, b * s:(b + 1) * s] = e.values[layer]
        last = self.entries[keys[-1]]
        for layer, st in enumerate(last.states):
            if st is not None:
                cache.states[layer][row] = st
                cache.rings[layer][row] = last.rings[layer]
        cache.lengths[row] = len(keys) * s

    # -- insert --------------------------------------------------------------------------------------
    def insert(self, key: bytes, parent: bytes | None, cache: PrefixCache, row: int, block: int,
               states: list[torch.Tensor | None], rings: list[torch.Tensor | None]) -> None:
        """Keep block `block` of cache row `row` (its K/V) with the GDN `states` / `rings` after it;
        `parent` is the key of the block before it."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if parent is not None and parent not in self.entries:
            return  # unreachable: lookups walk the chain from block 0
        s = self.block_size
        keys = [None if k is None else k[row, :, block * s:(block + 1) * s].clone() for k in cache.keys]
        values = [None if v is None else v[row, :, block * s:(block + 1) * s].clone() for v in cache.values]
        states = [None if x is None else x.detach().clone() for x in states]
        rings = [None if x is None else x.detach().clone() for x in rings]
        nbytes = sum(t.numel() * t.element_size() for ts in (keys, values, states, rings) for t in ts if t is not None)
        if nbytes > self.max_bytes:
            return
        self.entries[key] = Entry(keys, values, states, rings, nbytes, parent)
        if parent is not None:
            self.entries[parent].children += 1
            self.entries.move_to_end(parent)
        self.nbytes += nbytes
        self.stats.inserted += 1
        while self.nbytes > self.max_bytes:
            self._evict_one()

    def _evict_one(self) -> None:
        """Drop the least recently used leaf (a block no cached block continues)."""
        victim = next(k for k, e in self.entries.items() if e.children == 0)
        old = self.entries.pop(victim)
        if old.parent is not None and old.parent in self.entries:
            self.entries[old.parent].children -= 1
        self.nbytes -= old.nbytes
        self.stats.evictions += 1
