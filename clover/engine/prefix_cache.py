"""Prefix cache across requests: snapshots of committed prefixes at block boundaries (issue 13).

A hybrid model cannot keep per-token state for its Gated DeltaNet layers, only one recurrent state,
so prefixes are snapshotted where Clover commits anyway: at block boundaries (blocks are aligned to
absolute positions). One entry per block, keyed by a hash chain over the token blocks so far (the key
of block k covers every token before it): the block's attention K/V, and at some blocks each GDN
layer's state and conv ring after the block. A request whose prompt starts with cached blocks restores
them, up to the deepest one holding GDN states, into its cache row (copies of K/V, state and ring) and
prefills only the rest; entries come from prefills (states from the chunked scan, its chunks on the
sequence's boundaries), block commits and AR steps that end a block, and the boundaries inside a commit
or a `verify` keep of a request whose block size does not divide the model's (the keep's from its
check's steps, `model.kept_gdn`).

GDN states are sparse: a layer's state is a whole [H,K,V] matrix, ~6.6x a block's K/V for clover-tiny
in fp32 and ~98x for the 35B preset in bf16 (~61 MiB a block), so a state at every block would spend
the budget on states (a 256 MiB cache would hold ~130 tokens of a 35B model's prefixes). States are
kept after every `state_every`-th block of a sequence, after the last whole block of each prompt (where
the next turn of a conversation goes on, or diverges: e.g. a chat template that drops earlier reasoning),
after the last block the request's lookup could restore (where the same prompt's lookup stops: before
its last token for `ar` and `verify`, whole request blocks for block diffusion), after the deepest
cached block a lookup found beyond the states it could restore (a branch point, such as the end of a
shared system prompt: the next request that shares it restores it whole), after the last block before
each of the request's `cache_points` (the server and `clover chat` give a chat prompt's last
<|im_start|>: the next turn renders the reply after it otherwise, without its reasoning or an empty
think block, so the two prompts part there), and after the deepest block each request has reached
(its frontier: requests claim it, and the states go when the last claimant has gone past it; a request
that finishes keeps its claim, so its end stays). This is the choice vLLM and SGLang make for
Mamba-style layers (states at coarse blocks or at the ends of inserted sequences, K/V for every token);
a lookup reuses at most `state_every` blocks less than dense states would.

Bounded by a byte budget. Eviction frees the least recently used of two things: a block that no cached
block continues (a leaf of the tree of prefixes, as a radix cache does), taken whole, or the GDN states
of a block that others continue, its K/V kept (SGLang's MambaRadixCache keeps such K/V-only nodes too),
the latter only while the cache's K/V and two states fit the budget. A conversation's deeper blocks are
used more recently than its earlier ones, so while states are what overflows, its earlier states go
first and the deepest, where its next turn restores from, stays; once its K/V is what overflows, its
newest blocks go and the inner states left are where it restores from. (Taking leaves only, a single
conversation over the budget lost its newest blocks at once: the cache stopped growing and every later
turn restored the prefix it had stopped at. Taking inner states whatever the K/V, a conversation whose
K/V and one state outgrew the budget kept no state at all, and restored nothing from then on.) States
kept "for good" (`Entry.pinned`) and a finished request's end are kept until an eviction takes them. A
shared system prompt's states go before those of a conversation used after it, and come back as a
branch point with the next request that shares it. A block whose parent is gone is not kept (no lookup
could reach it). An eviction makes a later lookup reuse less, never something wrong.
Restored states are the very tensors an earlier forward computed; a continuation is as exact as the
forward that made the snapshot (an AR-made snapshot went through the recurrent form, a prefill through
the chunked one: equal to about 1e-6).

Dimension letters: G kv heads, S block size, D head dim, H GDN value heads, K / V GDN key / value
dims, W conv width, Q conv channels.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from clover.model.cache import PrefixCache

log = logging.getLogger(__name__)


def block_keys(tokens: Sequence[int], block_size: int, start: list[bytes] | None = None,
               salt: str | None = None) -> list[bytes]:
    """Chain keys of every complete block of `tokens` (extending `start`, the keys already known). A `salt` (a
    request's cache_salt) goes into the first block's key, so only requests with the same salt share blocks."""
    keys = list(start or [])
    seed = b"clover" if salt is None else b"clover-salt\0" + salt.encode()
    for b in range(len(keys), len(tokens) // block_size):
        h = hashlib.blake2b(keys[-1] if keys else seed, digest_size=16)
        h.update(np.asarray(tokens[b * block_size: (b + 1) * block_size], dtype=np.int64).tobytes())
        keys.append(h.digest())
    return keys


@dataclass
class Entry:
    keys: list[torch.Tensor | None]      # per attention layer [G,S,D] (None for GDN layers)
    values: list[torch.Tensor | None]
    states: list[torch.Tensor | None] | None  # per GDN layer [H,K,V] after the block (None for attention);
    rings: list[torch.Tensor | None] | None   # per GDN layer [W-1,Q] after the block; both None: K/V only
    nbytes: int
    parent: bytes | None                 # the key of the block before (None for block 0)
    children: int = 0                    # cached blocks that continue this one
    pinned: bool = False                 # its states are kept for good, eviction aside (else only while
    owners: int = 0                      # requests claim them as their frontier: how many claims are out, on
                                         # these states or on states eviction dropped; `drop_frontier` gives
                                         # each back)

    @property
    def snapshot(self) -> bool:
        """Whether it holds GDN states (a model with none restores from any block: K/V are its whole state)."""
        return self.states is not None and any(t is not None for t in self.states)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (self.states or [], self.rings or []) for t in ts
                   if t is not None)


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0                 # lookups that reused at least one block
    tokens_reused: int = 0
    tokens_looked_up: int = 0     # prompt tokens that could have been reused
    inserted: int = 0
    evictions: int = 0            # blocks evicted whole
    state_evictions: int = 0      # GDN states evicted from blocks that others continue (their K/V kept)
    snapshots: int = 0            # GDN states kept (entries holding them; a frontier dropped takes one away)

    def to_dict(self) -> dict:
        return {"lookups": self.lookups, "hits": self.hits, "tokens_reused": self.tokens_reused,
                "tokens_looked_up": self.tokens_looked_up, "inserted": self.inserted, "evictions": self.evictions,
                "state_evictions": self.state_evictions, "snapshots": self.snapshots}


@dataclass
class PrefixStore:
    block_size: int
    max_bytes: int
    state_every: int = 16                # GDN states after every state_every-th block (and where `Engine` asks)
    entries: OrderedDict[bytes, Entry] = field(default_factory=OrderedDict)
    nbytes: int = 0
    state_nbytes: int = 0                # of which GDN states and rings
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _warned: bool = False                # (a budget below one block with its states, said once)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes, got {self.max_bytes}")
        if isinstance(self.state_every, bool) or not isinstance(self.state_every, int) or self.state_every < 1:
            raise ValueError(f"the prefix cache's state interval must be a whole number of blocks >= 1, "
                             f"got {self.state_every!r}")

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    # -- lookup and restore ------------------------------------------------------------------------
    def periodic(self, block: int) -> bool:
        """Whether block `block` (0-based) of every sequence keeps its GDN states: every `state_every`-th."""
        return (block + 1) % self.state_every == 0

    def match(self, keys: list[bytes], limit_blocks: int) -> tuple[int, int]:
        """(how many leading blocks, at most `limit_blocks`, can be restored: a chain of cached blocks whose
        last holds GDN states; how many are cached, states or not), marking the chain recently used."""
        n = usable = 0
        while n < min(len(keys), limit_blocks) and keys[n] in self.entries:
            self.entries.move_to_end(keys[n])
            n += 1
            if self.entries[keys[n - 1]].states is not None:
                usable = n
        return usable, n

    def restore(self, cache: PrefixCache, row: int, keys: list[bytes]) -> None:
        """Write the cached blocks `keys` (a chain from block 0, the last holding GDN states) into an empty
        cache row."""
        s = self.block_size
        cache.reserve(len(keys) * s)
        for b, key in enumerate(keys):
            e = self.entries[key]
            for layer, k in enumerate(e.keys):
                if k is not None:
                    cache.keys[layer][row, :, b * s:(b + 1) * s] = k
                    cache.values[layer][row, :, b * s:(b + 1) * s] = e.values[layer]
        last = self.entries[keys[-1]]
        if last.states is None or last.rings is None:
            raise ValueError("the last block restored must hold GDN states (PrefixStore.match says how far)")
        for layer, st in enumerate(last.states):
            if st is not None:
                cache.states[layer][row] = st
                cache.rings[layer][row] = last.rings[layer]
        cache.lengths[row] = len(keys) * s

    # -- insert --------------------------------------------------------------------------------------
    def insert(self, key: bytes, parent: bytes | None, cache: PrefixCache, row: int, block: int,
               states: list[torch.Tensor | None] | None, rings: list[torch.Tensor | None] | None,
               frontier: bool = False) -> Entry | None:
        """Keep block `block` of cache row `row` (its K/V), with the GDN `states` / `rings` after it where
        given (None: K/V only; a cached block without states takes them); `parent` is the key of the block
        before it. `frontier`: the states are wanted only as a request's deepest point: the entry is returned
        holding that request's claim on them, which `drop_frontier` gives back (states kept for good, and
        blocks kept without states, return None)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
            if states is None or rings is None:
                return None
            if entry.states is not None:
                if not frontier:
                    entry.pinned = True   # (kept for good once some request wants it so)
                    return None
                if entry.pinned:
                    return None
                entry.owners += 1
                return entry
        else:
            if parent is not None and parent not in self.entries:
                return None  # unreachable: lookups walk the chain from block 0
            s = self.block_size
            keys = [None if k is None else k[row, :, block * s:(block + 1) * s].clone() for k in cache.keys]
            values = [None if v is None else v[row, :, block * s:(block + 1) * s].clone() for v in cache.values]
            entry = Entry(keys, values, None, None, 0, parent)
            entry.nbytes = sum(t.numel() * t.element_size() for ts in (keys, values) for t in ts if t is not None)
            if entry.nbytes > self.max_bytes:
                return None
            if parent is not None:   # (touched before the block is added: a chain's deeper blocks are the more recent)
                self.entries[parent].children += 1
                self.entries.move_to_end(parent)
            self.entries[key] = entry
            self.nbytes += entry.nbytes
            self.stats.inserted += 1
        if states is not None and rings is not None:
            self._attach(entry, states, rings, frontier)
        self._fit()   # (K/V alone grow the cache too; the budget may take these states again, or the block)
        if frontier and entry.states is not None and self.entries.get(key) is entry:
            entry.owners += 1
            return entry
        return None

    def _attach(self, entry: Entry, states: list[torch.Tensor | None], rings: list[torch.Tensor | None],
                frontier: bool) -> None:
        """Give a block without states these (copies), unless the block with them would exceed the whole budget
        (then it stays K/V only: nothing can be restored from it, said once)."""
        entry.states, entry.rings = _copies(states), _copies(rings)
        added = entry.state_bytes()
        if entry.nbytes + added > self.max_bytes:
            entry.states = entry.rings = None
            if not self._warned:
                self._warned = True
                log.warning("the prefix cache's budget (%d bytes) is below one block with its GDN states (%d bytes): "
                            "no prefix can be restored; raise it (clover serve --prefix-cache-bytes)",
                            self.max_bytes, entry.nbytes + added)
            return
        entry.nbytes += added
        self.nbytes += added
        self.state_nbytes += added
        entry.pinned = not frontier
        self.stats.snapshots += entry.snapshot

    def drop_frontier(self, key: bytes, entry: Entry) -> None:
        """Give back a request's claim on the states of block `key` (`insert`'s `entry`): it has gone past them.
        They are dropped, K/V kept, when no request claims them and none wants them for good."""
        if self.entries.get(key) is not entry:
            return   # (evicted, perhaps cached again since: not this claim's entry)
        entry.owners -= 1
        if entry.owners == 0 and entry.states is not None and not entry.pinned:
            self._drop_states(entry)

    def _drop_states(self, entry: Entry) -> None:
        """Keep only the block's K/V (states wanted for good are wanted again by the next insert that brings them)."""
        freed, held = entry.state_bytes(), entry.snapshot
        entry.states = entry.rings = None
        entry.pinned = False
        entry.nbytes -= freed
        self.nbytes -= freed
        self.state_nbytes -= freed
        self.stats.snapshots -= held

    def clear(self) -> tuple[int, int]:
        """Drop every cached block (the statistics' counters go on): (blocks, bytes) dropped. Requests running keep
        their rows; their frontier claims then name entries no longer cached, which `drop_frontier` ignores."""
        dropped = len(self.entries), self.nbytes
        self.entries.clear()
        self.nbytes = self.state_nbytes = self.stats.snapshots = 0
        return dropped

    def _fit(self) -> None:
        while self.nbytes > self.max_bytes:
            self._evict_one()

    def _evict_one(self) -> None:
        """Free the least recently used of: a leaf (a block no cached block continues), dropped whole, and the
        GDN states of a block others continue, dropped alone, while the cache's K/V and two states fit the budget
        (past that the K/V is what overflows: dropping inner states would leave a chain whose leaf must go next
        with no state above it to restore from, so leaves go, the tail first, and the inner states left, the
        deepest, are the points to fall back to). A model without GDN layers has no states to drop: every block restores."""
        kv = self.nbytes - self.state_nbytes
        victim = next(k for k, e in self.entries.items()
                      if e.children == 0 or (e.snapshot and kv + 2 * e.state_bytes() <= self.max_bytes))
        old = self.entries[victim]
        if old.children > 0:
            self._drop_states(old)
            self.stats.state_evictions += 1
            return
        del self.entries[victim]
        if old.parent is not None and old.parent in self.entries:
            self.entries[old.parent].children -= 1
        self.nbytes -= old.nbytes
        self.state_nbytes -= old.state_bytes()
        self.stats.evictions += 1
        self.stats.snapshots -= old.snapshot


def _copies(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if x is None else x.detach().clone() for x in tensors]
