"""The generation engine: the scheduler and the output of batched decoding.

Each sequence owns a row of one shared `PrefixCache`. A step admits waiting requests, then hands the
running sequences of each decoding policy (`clover.engine.policies`: `ar`, `low_confidence`, `verify`) to that
policy, which runs its forwards over all of them at once; so sequences of different lengths, block
phases and algorithms advance together, join between steps and leave when done (their row is reset
and reused; the cache is dropped when idle). The engine owns what every policy shares: admission,
the batched forward call, emitting tokens and text (stop strings, limits, incremental text) and
finishing.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

from clover.engine.policies import POLICIES, Policy
from clover.engine.prefix_cache import PrefixStore, block_keys
from clover.engine.sampling import (
    SEED_BOUND,
    InvalidParameter,
    NoTokenAllowed,
    SamplingParams,
    TokenLogprob,
    has_penalties,
    token_logprobs,
)
from clover.engine.sequence import Event, GenerationResult, GenerationStats, SequenceState, StepRecord
from clover.engine.structured import Constraint, GrammarCompiler, GrammarError, GrammarState
from clover.model.cache import PrefixCache
from clover.model.config import GenerationConfig
from clover.model.modeling import CheckTrail, CloverForCausalLM, GDNTrace

__all__ = ["Engine", "Event", "GenerationResult", "GenerationStats", "StepRecord"]
log = logging.getLogger(__name__)
WARM_UP_MAX_BATCH = 32   # the largest batch `warm_up` decodes (the default --max-batch-size)


class Engine:
    def __init__(self, model: CloverForCausalLM, tokenizer: object | None = None, max_batch_size: int = 32,
                 policies: dict[str, Policy] | None = None, prefix_cache_bytes: int = 0,
                 max_prefill_tokens: int | None = None, prefix_state_every: int = 16) -> None:
        """`tokenizer` (optional) needs `decode(ids) -> str`; it enables text output and stop strings.
        `policies` replaces the decoding policies by algorithm name (default: `clover.engine.policies.POLICIES`).
        `prefix_cache_bytes` > 0 keeps committed prefixes for later requests (`clover.engine.prefix_cache`), with
        GDN states after every `prefix_state_every`-th block (and at prompts' ends, branch points and frontiers).
        `max_prefill_tokens` (chunked prefill): a step prefills at most this many prompt tokens in
        block-aligned chunks, so a long prompt never stalls the other sequences' steps (None: no limit)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"the prefix cache budget must be >= 0 bytes (0: off), got {prefix_cache_bytes}")
        PrefixStore(model.config.block_size, 0, prefix_state_every)   # (its settings checked, the cache on or off)
        if max_prefill_tokens is not None and max_prefill_tokens < model.config.block_size:
            raise ValueError(f"max_prefill_tokens must be at least the block size {model.config.block_size}, "
                             f"got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.prefilling: list[SequenceState] = []  # admitted, prompt still being prefilled in chunks
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.config = model.config
        self.device = model.device   # (read at every step; again by a request reaching an idle engine: the model
        # must not move while requests run)
        self.eos_ids = set(self.config.eos_token_ids)
        self.policies: dict[str, Policy] = {**{name: cls() for name, cls in POLICIES.items()}, **(policies or {})}
        self.cache: PrefixCache | None = None
        self.free_rows: list[int] = []
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._ids = itertools.count()
        self.forward_seconds = 0.0  # wall time inside model forwards, all sequences together
        self.prefix = (PrefixStore(self.config.block_size, prefix_cache_bytes, prefix_state_every)
                       if prefix_cache_bytes > 0 else None)
        self._grammars: GrammarCompiler | None = None   # built at the first constrained request
        self._grammars_lock = threading.Lock()

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None,
        grammar: GrammarState | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next step. Raises ValueError for bad input. `grammar`: the
        state `prepare_grammar` made for `params.constraint` (else it is made here)."""
        params = params or SamplingParams()
        params.validate(self.config.vocab_size)
        if params.algorithm not in self.policies:
            raise ValueError(f"algorithm must be one of {sorted(self.policies)}, got {params.algorithm!r}")
        prompt = self.check_prompt(prompt_ids)
        if any(p > len(prompt) for p in params.cache_points):
            raise InvalidParameter("cache_points", f"cache_points must be positions in the prompt (0 to {len(prompt)}), "
                                                   f"got {max(params.cache_points)}")
        limit = self.config.max_position_embeddings
        if len(prompt) + params.max_new_tokens > limit:
            raise ValueError(
                f"prompt of {len(prompt)} tokens plus max_new_tokens {params.max_new_tokens} exceeds the context "
                f"limit of {limit} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; give stop_token_ids instead")
        rid = request_id or f"req-{next(self._ids)}"
        if any(s.rid == rid for s in itertools.chain(self.waiting, self.running)):
            raise ValueError(f"request id {rid!r} is already in use")
        matcher = pending = None
        if params.constraint is not None:
            if self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer")
            # GrammarError (a ValueError) if it does not compile
            matcher, pending = grammar if grammar is not None else self._grammar_compiler().start(params.constraint)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(SEED_BOUND)
        if self.cache is None:   # idle (no cache held): the model may have moved since the last request
            self.device = self.model.device
        self.waiting.append(SequenceState(
            rid=rid, prompt=prompt, params=params, block_size=GenerationConfig.resolve_block_size(params.block_size, self.config),
            generator=torch.Generator().manual_seed(seed),
            counts=torch.zeros(self.config.vocab_size, device=self.device) if has_penalties(params) else None,
            started=time.perf_counter(), stats=GenerationStats(prompt_tokens=len(prompt)), matcher=matcher,
            pending=pending,
        ))
        return rid

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammars_lock:   # (built at the first constrained request, on whichever thread asks first)
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, sorted(self.eos_ids))
            return self._grammars

    def prepare_grammar(self, constraint: Constraint) -> GrammarState:
        """Compile a constraint's grammar now, on the caller's thread (any thread: the server's workers), and
        return a request's state in it, for `add_request(..., grammar=)`: the engine's thread then compiles
        nothing while the batch waits, even where the kept matchers let this one go meanwhile (a burst of large
        schemas). GrammarError (a ValueError) if it does not compile."""
        if self.tokenizer is None:
            raise ValueError("structured output needs a tokenizer")
        return self._grammar_compiler().start(constraint)

    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as ints; InvalidParameter("prompt") when it is empty, leaves the vocabulary or holds the
        mask token (the decoders would take a prompt token inside a block for a slot to fill)."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidParameter("prompt", "prompt is empty: give at least one token")
        bad = next((t for t in prompt if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise InvalidParameter("prompt", f"prompt token {bad} is outside the vocabulary [0, "
                                             f"{self.config.vocab_size})")
        if self.config.mask_token_id in prompt:
            raise InvalidParameter("prompt", f"the prompt holds the mask token ({self.config.mask_token_id}), "
                                             "which only the decoders place")
        return prompt

    @torch.inference_mode()
    def score(self, prompt_ids: Sequence[int], top_n: int = 0) -> list[TokenLogprob | None]:
        """The causal head's log-probability of every prompt token given the ones before it (None for the
        first, which nothing predicts) and the top `top_n` at each position: one causal forward, no cache
        (the prompt scoring of /v1/completions with echo and logprobs)."""
        ids = self.check_prompt(prompt_ids)
        if len(ids) > self.config.max_position_embeddings:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context limit of "
                             f"{self.config.max_position_embeddings} tokens")
        if len(ids) == 1:
            return [None]
        logits = self.model(torch.tensor([ids], device=self.model.device))[0, :-1]
        return [None, *token_logprobs(logits, ids[1:], top_n)]

    @torch.inference_mode()
    def abort(self, request_id: str) -> bool:
        """Drop a request (waiting or running) at once, freeing its cache row (in inference mode, as `step`: the
        rows compacted after it are written in place, and the cache was made in inference mode)."""
        for s in list(self.waiting):
            if s.rid == request_id:
                self.waiting.remove(s)
                return True
        for s in self.running:
            if s.rid == request_id and s.finish_reason is None:
                s.finish_reason = "abort"
                self._retire()
                return True
        return False

    def clear(self) -> None:
        """Drop every request, waiting or running, and the batch's cache (the server's way out of a failure
        whose state it cannot trust; the prefix cache holds only finished blocks and stays)."""
        self.waiting.clear()
        self.running, self.prefilling = [], []
        self.cache, self.free_rows = None, []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit waiting requests, then let each decoding policy advance its sequences by one step."""
        events: list[Event] = []
        admitted = [s for s in self._admit() if s not in self.prefilling] + self._prefill_chunks()
        for name, policy in self.policies.items():
            new = [s for s in admitted if s.params.algorithm == name]
            if new:
                policy.prefill(self, new, events)
            running = [s for s in self.running if s.params.algorithm == name and s.finish_reason is None
                       and s not in new and s not in self.prefilling]
            if running:
                policy.step(self, running, events)
        self._retire()
        return events

    def _prefill_chunks(self) -> list[SequenceState]:
        """Chunked prefill: advance the sequences whose prompts are too long for one step by block-aligned
        chunks, at most `max_prefill_tokens` tokens in all; returns those whose policy may now prefill the
        rest (at most one block and the prompt's tail) and start decoding."""
        if not self.prefilling:   # (an idle engine has no cache to measure)
            return []
        budget, size = self.max_prefill_tokens, self.config.block_size
        chunk: list[tuple[SequenceState, int]] = []
        for s in self.prefilling:
            take = min(self._chunk_limit(s) - s.pos, budget // size * size)
            if take <= 0:
                break
            chunk.append((s, take))
            budget -= take
        # the chunk forward pads its rows: it needs room for the furthest row plus the longest chunk
        need = max(s.pos for s, _ in chunk) + max(n for _, n in chunk) if chunk else 0
        if need > self.cache.capacity:
            # All rows share one K/V capacity, and growing it copies every row's keys and values. Grow
            # once, for every prompt being prefilled plus a block, in a step that runs no chunk: that
            # step's other work (decoding, newly admitted short prompts) is then delayed by the copy,
            # and no chunk step by a copy as well.
            whole = max(need, max(len(s.prompt) for s in self.prefilling) + size)
            self.cache.reserve(whole, self.config.max_position_embeddings)
            chunk = []
        if chunk:
            seqs = [s for s, _ in chunk]
            self.forward(seqs, "causal", self.pad([s.prompt[s.pos: s.pos + n] for s, n in chunk], 0),
                         [n for _, n in chunk], logits="none")
            for s, n in chunk:
                s.pos += n
                s.stats.prefill_forwards += 1
        ready = [s for s in self.prefilling if s.pos >= self._chunk_limit(s)]
        self.prefilling = [s for s in self.prefilling if s not in ready]
        return ready

    def _chunk_limit(self, s: SequenceState) -> int:
        """How far chunks prefill a prompt: the block boundary under what the policy's own prefill needs."""
        size = self.config.block_size
        return self.policies[s.params.algorithm].reusable(s) // size * size

    def warm_up(self) -> None:
        """Decode a short prompt with each policy, for one sequence, for two and for a full batch (of at most
        WARM_UP_MAX_BATCH), and drop the results: compiled passes (`model.compile_decode`) are built for the
        shapes decoding uses before the first request pays for it (a pass of a few tokens and a larger one can be
        different graphs: the experts' dispatch depends on the token count, `clover/model/moe.py`; by the third
        batch size dynamo has made the batch dimension dynamic). A larger --max-batch-size is not decoded whole
        here (`serve --compile --max-batch-size 100000000` would never start): a batch past the cap that needs a
        graph of its own builds it when it first runs, as vLLM captures graphs only up to a size and runs larger
        batches without. Leaves the engine idle."""
        b = self.config.block_size
        prompt = [i % self.config.mask_token_id for i in range(b + b // 2)]   # a prompt tail inside a block
        with torch.inference_mode():
            for algorithm in self.policies:
                for n in sorted({1, 2, min(self.max_batch_size, WARM_UP_MAX_BATCH)}):
                    self.generate([prompt] * n, SamplingParams(max_new_tokens=2 * b, algorithm=algorithm,
                                                               ignore_eos=True))

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Decode all prompts together (joined and retired as the batch limit allows), results in order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} parameter sets for {len(prompts)} prompts")
        ids: list[str] = []
        results: dict[str, GenerationResult] = {}
        try:
            for p, sp in zip(prompts, plist, strict=True):
                ids.append(self.add_request(p, sp))
            while self.has_unfinished():
                for ev in self.step():
                    if ev.finished and ev.result is not None:
                        results[ev.request_id] = ev.result
        except BaseException:   # a request refused (those added before it), an interrupt: none is left queued
            for rid in ids:     # or running, to be decoded for nobody by the next call (vLLM's LLM.generate)
                if rid not in results:
                    self.abort(rid)
            raise
        return [results[i] for i in ids]

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Event]:
        """Decode one prompt alone, yielding each block (or token, for `ar`) as it becomes final. A stream
        closed or dropped before the end (or an error) aborts its request."""
        rid = self.add_request(prompt_ids, params)
        try:
            while True:
                for ev in self.step():
                    if ev.request_id == rid:
                        yield ev
                        if ev.finished:
                            return
                if not any(s.rid == rid for s in itertools.chain(self.waiting, self.running)):
                    return  # aborted
        finally:
            self.abort(rid)   # (nothing to do once it finished)

    # -- admission -----------------------------------------------------------------------------------
    def _admit(self) -> list[SequenceState]:
        n = min(len(self.waiting), self.max_batch_size - len(self.running))
        if n <= 0:
            return []
        admitted = [self.waiting.popleft() for _ in range(n)]
        if len(self.free_rows) < n:
            extra = max(n - len(self.free_rows), 4)
            start = 0 if self.cache is None else self.cache.batch_size
            grown = self.model.new_cache(extra)
            self.cache = grown if self.cache is None else PrefixCache.concat([self.cache, grown])
            self.free_rows.extend(range(start, start + extra))
        for s in admitted:
            s.row = self.free_rows.pop(0)
        self.cache.reset_rows([s.row for s in admitted])
        if self.prefix is not None:
            for s in admitted:
                self._reuse_prefix(s)
        if self.max_prefill_tokens is not None:
            self.prefilling += [s for s in admitted if self._chunk_limit(s) - s.pos > self.max_prefill_tokens]
        self.running.extend(admitted)
        return admitted

    # -- prefix cache --------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop every cached prefix (e.g. before a cold measurement, or after the weights changed: entries are keyed
        by tokens only): (blocks, bytes) dropped. ValueError where the engine has no prefix cache."""
        if self.prefix is None:
            raise ValueError("the prefix cache is off (prefix_cache_bytes 0): there is nothing to reset")
        return self.prefix.clear()

    def _reuse_prefix(self, s: SequenceState) -> None:
        """Restore the longest cached block prefix of the prompt that the sequence's policy may reuse."""
        size = self.prefix.block_size
        limit = self.policies[s.params.algorithm].reusable(s) // size
        s.reuse_block = limit - 1
        keys = block_keys(s.prompt[: limit * size], size, salt=s.params.cache_salt)
        n, cached = self.prefix.match(keys, limit)
        s.branch = cached - 1 if cached > n else None   # states there next time: the next such prompt restores it all
        stats = self.prefix.stats
        stats.lookups += 1
        stats.tokens_looked_up += limit * size
        if n:
            self.prefix.restore(self.cache, s.row, keys[:n])
            s.pos = s.stats.cached_tokens = n * size
            s.chain = keys[:n]
            stats.hits += 1
            stats.tokens_reused += n * size

    def _keeps_state(self, s: SequenceState, block: int) -> bool:
        """Whether the prefix cache keeps the GDN states after block `block` of `s` for good (not only as its
        frontier): every `state_every`-th block, the prompt's last whole block (where its next turn goes on), the
        last one its policy may restore (where the same prompt's lookup stops: before the last token for `ar` and
        `verify`, whole request blocks for block diffusion), a branch its lookup found, the last one before each of
        its `cache_points` (a chat prompt's last turn: where the next turn's prompt diverges)."""
        size = self.prefix.block_size
        return (self.prefix.periodic(block) or block in (len(s.prompt) // size - 1, s.reuse_block) or block == s.branch
                or any(block == p // size - 1 for p in s.params.cache_points))

    def _snapshot_blocks(self, s: SequenceState, old: int, new: int) -> list[int]:
        """The blocks, ending inside a forward that takes `s` from `old` to `new` committed tokens, after which
        the prefix cache wants GDN states (those it keeps and the deepest: a block ending at `new` is the
        cache's own state)."""
        size = self.prefix.block_size
        ends_inside = range(old // size, (new - 1) // size)   # blocks ending after `old` and before `new`
        return [b for b in ends_inside if self._keeps_state(s, b) or b == new // size - 1]

    def _remember(self, seqs: list[SequenceState], before: list[int], trace: GDNTrace | None,
                  inside: dict[tuple[int, int], tuple[list, list]] | None = None) -> None:
        """Snapshot every block boundary the last cache-writing forward crossed (`before`: each row's
        length before it; `trace`: GDN states and rings at the chunks `_before` asked for; `inside`: a keep's
        states and rings at the boundaries before its end, by (row index, block)): K/V for every block, GDN
        states where `_snapshot_blocks` wants them. A request's frontier states are dropped as it goes past."""
        size, cache = self.prefix.block_size, self.cache
        n_layers = len(cache.states)
        gdn = [i for i, st in enumerate(cache.states) if st is not None]
        for idx, s in enumerate(seqs):
            old, new = before[idx], int(cache.lengths[s.row])
            if new // size == old // size:
                continue
            tokens = (s.prompt + s.generated)[:new]
            s.chain = block_keys(tokens, size, s.chain, s.params.cache_salt)
            last = new // size - 1
            for b in range(old // size, new // size):
                end, keep = (b + 1) * size, self._keeps_state(s, b)
                wanted = keep or b == last   # (`_snapshot_blocks`' choice, for a block ending inside the forward)
                states = ring = None
                if not gdn:   # (attention only: K/V are the whole state)
                    states, ring = [None] * n_layers, [None] * n_layers
                elif end == new:
                    states = [cache.states[i][s.row] if i in gdn else None for i in range(n_layers)]
                    ring = [cache.rings[i][s.row] if i in gdn else None for i in range(n_layers)]
                elif wanted and inside is not None and (idx, b) in inside:
                    states, ring = inside[idx, b]
                elif (wanted and trace is not None and b + 1 - old // size in trace.chunks
                      and all(i in trace.states for i in gdn)):
                    j = trace.chunks.index(b + 1 - old // size)   # (chunk c starts at the c-th boundary from old's)
                    states = [trace.states[i][idx, :, j] if i in gdn else None for i in range(n_layers)]
                    ring = [trace.rings[i][idx, j] if i in gdn else None for i in range(n_layers)]
                deepest = states is not None and bool(gdn) and b == last   # the request's new deepest block
                if deepest and s.frontier is not None:   # (its old frontier first: the budget need not hold both)
                    self.prefix.drop_frontier(*s.frontier)
                    s.frontier = None
                claim = self.prefix.insert(s.chain[b], s.chain[b - 1] if b else None, cache, s.row, b, states, ring,
                                           frontier=bool(gdn) and not keep)
                if deepest:
                    s.frontier = None if claim is None else (s.chain[b], claim)

    # -- what policies call --------------------------------------------------------------------------
    def forward(self, seqs: list[SequenceState], fn: str, ids: torch.Tensor, lengths: list[int],
                **kw: object) -> torch.Tensor | None:
        """model.<fn>(ids, cache, lengths=..., rows=<the sequences' rows>, **kw), timed."""
        rows = self._rows(seqs)
        remember = self.prefix is not None and fn == "causal" and kw.get("write", True)
        if remember:
            before, kw["gdn_trace"] = self._before(seqs, lengths)
        out = self._timed(seqs, lambda: getattr(self.model, fn)(
            ids, self.cache, lengths=torch.tensor(lengths, device=ids.device), rows=rows, **kw))
        if remember:
            self._remember(seqs, before, kw["gdn_trace"])
        return out

    def fused(self, seqs: list[SequenceState], clean: list[list[int]] | list[torch.Tensor],
              blocks: list[torch.Tensor], clean_logits: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """model.causal_and_preview over the sequences' rows (a commit fused with a preview), timed; the
        block's logits only at its mask slots (the unresolved ones: what the policies read)."""
        rows = self._rows(seqs)
        dev = self.device
        remember = self.prefix is not None
        clean_lengths = [len(c) for c in clean]
        before, trace = self._before(seqs, clean_lengths) if remember else (None, None)
        out = self._timed(seqs, lambda: self.model.causal_and_preview(
            self.pad(clean, 0), self.pad(blocks, self.config.mask_token_id), self.cache,
            clean_lengths=torch.tensor(clean_lengths, device=dev),
            block_lengths=torch.tensor([len(b) for b in blocks], device=dev), rows=rows,
            clean_logits=clean_logits, gdn_trace=trace, masked_only=True))
        if remember:
            self._remember(seqs, before, trace)
        return out

    def keep(self, seqs: list[SequenceState], trail: CheckTrail, counts: list[int]) -> None:
        """model.keep: commit the first counts[i] rows of the last check of seqs[i] (`verify`), timed."""
        before = self.cache.lengths[trail.rows].tolist() if self.prefix is not None else None
        inside = self._kept_inside(seqs, trail, counts, before) if before is not None else None
        self._timed(seqs, lambda: self.model.keep(self.cache, trail, counts))
        if before is not None:   # the boundary a keep ends on: the cache holds its state; those inside it: `inside`
            self._remember(seqs, before, None, inside)

    def _kept_inside(self, seqs: list[SequenceState], trail: CheckTrail, counts: list[int], before: list[int]
                     ) -> dict[tuple[int, int], tuple[list, list]]:
        """The GDN states and rings at the block boundaries a keep crosses before its last row (a request's
        block size that does not divide the model's) where the prefix cache wants them, by (row index, block
        ending there), from the check's steps (`model.kept_gdn`): the k-th such boundary of every row in one call."""
        size, n_layers = self.prefix.block_size, len(self.cache.states)
        ends = [[(b + 1) * size for b in self._snapshot_blocks(s, old, old + n)]
                for s, old, n in zip(seqs, before, counts, strict=True)]
        out: dict[tuple[int, int], tuple[list, list]] = {}
        for k in range(max(map(len, ends), default=0)):
            upto = [e[k] - old if k < len(e) else 0 for e, old in zip(ends, before, strict=True)]
            kept = self.model.kept_gdn(self.cache, trail, torch.tensor(upto, device=self.device))
            for idx, e in enumerate(ends):
                if k < len(e):
                    out[idx, e[k] // size - 1] = ([kept[i][0][idx] if i in kept else None for i in range(n_layers)],
                                                  [kept[i][1][idx] if i in kept else None for i in range(n_layers)])
        return out

    def _timed(self, seqs: list[SequenceState], call: Callable[[], object]) -> object:
        """Run one forward, adding its wall time to the engine's and to each sequence's model time."""
        t0 = time.perf_counter()
        out = call()
        dt = time.perf_counter() - t0
        self.forward_seconds += dt
        for s in seqs:
            s.stats.model_time += dt
        return out

    def _rows(self, seqs: list[SequenceState]) -> torch.Tensor | slice:
        """The sequences' cache rows: a slice when consecutive (the model then reads views of the cache)."""
        rows = [s.row for s in seqs]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return slice(rows[0], rows[0] + len(rows))
        return torch.tensor(rows, device=self.device)

    def _before(self, seqs: list[SequenceState], lengths: list[int]) -> tuple[list[int], GDNTrace | None]:
        """What `_remember` needs from before a forward writing `lengths` tokens per row: the rows' lengths, and
        a GDN trace asking for the chunks that end on the boundaries inside the forward where the prefix cache
        wants states (a prefill; else None: a step or a block's commit ends on the boundary it crosses, whose
        state the cache holds, and a pass without a trace may run compiled)."""
        before = self.cache.lengths[self._rows(seqs)].tolist()
        size = self.prefix.block_size
        chunks = sorted({b + 1 - old // size for s, old, n in zip(seqs, before, lengths, strict=True)
                         for b in self._snapshot_blocks(s, old, old + n)})
        return before, GDNTrace(chunks) if chunks and any(st is not None for st in self.cache.states) else None

    def pad(self, rows: list[list[int]] | list[torch.Tensor], fill: int) -> torch.Tensor:
        """Right-padded [N, max(1, longest)] long tensor on the model's device."""
        width = max(1, max(len(r) for r in rows))
        out = torch.full((len(rows), width), fill, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        return out.to(self.device)

    def greedy_picks(self, seqs: list[SequenceState], logits: torch.Tensor) -> list[int | list[int] | None]:
        """The causal head's pick for each row of logits [N,V] (row i: the next token of seqs[i]) where that
        pick is a plain argmax, for all such rows in one reduction: greedy, no penalties or logit bias, no
        grammar, no stop token held back (min_tokens), no logprobs asked for. None for the other rows, and
        for a row whose maximum is not finite: the policy picks those one by one (`pick_tokens`, which
        gives the same token for the plain rows). Logits [N,T,V] (the positions of a `verify` check): a
        list of T picks per plain row, where no grammar waits for its trigger either (the drafts may hold
        the trigger, and the rows after it would need the grammar's masks)."""
        several = logits.dim() == 3
        plain = [i for i, s in enumerate(seqs) if self.plain_greedy(s) and not (several and s.pending is not None)]
        picks: list[int | list[int] | None] = [None] * len(seqs)
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[plain]
            best, tokens = rows.max(dim=-1)
            # read back at once and checked here (each tensor op would cost more than the check)
            bests, argmaxes = best.tolist(), tokens.tolist()
            if not several:
                bests, argmaxes = [[b] for b in bests], [[t] for t in argmaxes]
            # the mask token is never an output: where it won, or where a maximum is not finite (which masking
            # it may change), the argmax again without it, for all such positions in one reduction; elsewhere
            # that is this argmax, with no copy of the logits (a check's [N, T, V] at every step)
            mask = self.config.mask_token_id
            redo = [(k, j) for k, (row_tokens, row_best) in enumerate(zip(argmaxes, bests, strict=True))
                    for j, (t, b) in enumerate(zip(row_tokens, row_best, strict=True)) if t == mask or not math.isfinite(b)]
            if redo:
                ks, js = torch.tensor([k for k, _ in redo]), torch.tensor([j for _, j in redo])
                again = rows[ks.to(rows.device), js.to(rows.device)] if several else rows[ks.to(rows.device)]
                values, indices = self.mask_out(again, copied=True).max(dim=-1)
                for (k, j), b, t in zip(redo, values.tolist(), indices.tolist(), strict=True):
                    bests[k][j], argmaxes[k][j] = b, t
            for k, i in enumerate(plain):
                if all(math.isfinite(b) for b in bests[k]):
                    picks[i] = argmaxes[k] if several else argmaxes[k][0]
        return picks

    @staticmethod
    def plain_greedy(s: SequenceState) -> bool:
        """Whether s's next picks are a plain argmax of the causal or preview logits (the mask token
        excluded): greedy, no penalties or logit bias, no grammar started, no stop token held back
        (min_tokens), no logprobs asked for."""
        p = s.params
        return (p.greedy and not has_penalties(p) and not p.logit_bias and s.matcher is None and p.logprobs is None
                and len(s.generated) >= p.min_tokens)

    def confident_picks(self, seqs: list[SequenceState], logits: torch.Tensor,
                        slots: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """`pick_tokens` with confidences for the plain greedy sequences (`plain_greedy`) of a preview, all
        in one reduction: for seqs[i], the argmax of logits[i, slots[i]] (the mask token excluded) and its
        probability, as (tokens [M], confidence [M]). None for the other sequences, and for one with a row
        whose maximum is not finite (its own `pick_tokens` then says so)."""
        plain = [i for i, s in enumerate(seqs) if self.plain_greedy(s) and len(slots[i])]
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(seqs)
        if not plain:
            return out
        sizes = [len(slots[i]) for i in plain]
        which = torch.repeat_interleave(torch.tensor(plain, device=logits.device),
                                        torch.tensor(sizes, device=logits.device))
        scores = self.mask_out(logits[which, torch.cat([slots[i] for i in plain])], copied=True)   # [M,V]
        best, tokens = scores.max(dim=-1)
        conf = torch.softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        ok = [bool(f.all()) for f in torch.isfinite(best).split(sizes)]
        for i, t, c, good in zip(plain, tokens.split(sizes), conf.split(sizes), ok, strict=True):
            if good:
                out[i] = t, c
        return out

    def mask_out(self, logits: torch.Tensor, copied: bool = False) -> torch.Tensor:
        """The mask token is never an output: fp32 logits with it at -inf, in one copy of `logits`, or none
        where `copied` says they are a copy already (advanced indexing), which is then changed in place."""
        logits = logits.float() if copied else logits.to(torch.float32, copy=True)
        logits[..., self.config.mask_token_id] = float("-inf")
        return logits

    @contextlib.contextmanager
    def isolated(self, s: SequenceState, events: list[Event]) -> Iterator[None]:
        """Run one sequence's share of a step; an exception ends that sequence alone (finish reason
        "error", the message in its last event), never the others of the batch."""
        try:
            yield
        except NoTokenAllowed as exc:   # the request's constraints, or the model's numbers: its error alone
            log.warning("request %s: %s", s.rid, exc)
            if s.finish_reason is None:
                self.finish(s, [], [], "error", events, error=str(exc), invalid=exc.invalid)
        except GrammarError as exc:   # the request's own grammar failed (a limit of the parser): its error
            log.warning("request %s: its grammar failed: %.500s", s.rid, exc)
            if s.finish_reason is None:
                self.finish(s, [], [], "error", events, error=f"its grammar failed: {exc}", invalid=True)
        except Exception as exc:
            log.exception("request %s failed", s.rid)
            if s.finish_reason is None:
                self.finish(s, [], [], "error", events, error=f"{type(exc).__name__}: {exc}")

    def is_stop_token(self, s: SequenceState, t: int) -> bool:
        return (t in self.eos_ids and not s.params.ignore_eos) or t in s.params.stop_token_ids

    def hold_stops(self, s: SequenceState, logits: torch.Tensor, positions: torch.Tensor | int,
                   complete: list[bool] | None = None) -> torch.Tensor:
        """min_tokens: logits [M,V] whose rows predict response positions `positions` [M] (an int: M
        consecutive positions from it), with every stop token at -inf where the position is below
        params.min_tokens. A complete grammar ends the reply: it wins over min_tokens, for the sequence's
        grammar now or, per row, where `complete[r]` says the drafts before row r complete it (a check)."""
        if s.params.min_tokens <= 0 or (s.matcher is not None and s.matcher.finished):
            return logits
        if isinstance(positions, int):
            positions = positions + torch.arange(logits.shape[0])
        early = positions < s.params.min_tokens
        if complete:
            early &= ~torch.tensor(complete + [False] * (len(early) - len(complete)), device=early.device)
        early = early.nonzero().squeeze(-1).to(logits.device)
        stops = sorted(t for t in (*self.eos_ids, *s.params.stop_token_ids) if self.is_stop_token(s, t))
        if not len(early) or not stops:   # (with ignore_eos and no stop ids nothing stops a reply)
            return logits
        stops = torch.tensor(stops, dtype=torch.long, device=logits.device)
        logits = logits.clone()
        logits[early[:, None], stops] = float("-inf")
        return logits

    def emit_final(self, s: SequenceState, tokens: list[int], steps: list[int], events: list[Event],
                   logits: torch.Tensor | None = None) -> None:
        """Emit final tokens, ending the sequence at the first stop token among them. `logits` [M,V]: the
        causal head's logits that predicted them (for params.logprobs)."""
        cut = next((j for j, t in enumerate(tokens) if self.is_stop_token(s, t)), None)
        keep = len(tokens) if cut is None else cut
        if s.params.logprobs is not None and logits is not None:
            scored = token_logprobs(logits[: keep + (cut is not None)], tokens[: keep + (cut is not None)],
                                    s.params.logprobs)
            s.logprobs.extend(scored[:keep])
            if cut is not None:   # the stop token is not output, but scorers (lm-eval) count its entry
                s.stop_logprob = (tokens[cut], scored[keep])
        self.emit(s, tokens[:keep], steps[:keep], events, stop_token=None if cut is None else tokens[cut])

    def emit(self, s: SequenceState, tokens: list[int], steps: list[int], events: list[Event],
             stop_token: int | None = None) -> None:
        """Append final tokens; finish on a stop string, then on `stop_token` (it followed them: the reply ends
        with it), then on max_new_tokens."""
        s.generated.extend(tokens)
        s.accept_steps.extend(steps)
        if self.tokenizer is not None:
            self._detokenize(s)
        if s.params.stop:
            hit = self._find_stop(s)
            if hit is not None:
                at, end = hit
                # keep the tokens up to the one that completes the stop string; the text ends before it
                m = s.ends_at[bisect.bisect_left(s.ends, end)]
                del s.generated[m:], s.accept_steps[m:], s.logprobs[m:]
                s.stop_logprob = None   # a stop token after it in the same run did not end the reply
                self.finish(s, [], [], "stop", events,
                            text=s.decoded[:end if s.params.include_stop_str_in_output else at])
                return
        if stop_token is not None:
            s.stop_token = stop_token
            self.finish(s, [], [], "stop", events)
            return
        if len(s.generated) >= s.params.max_new_tokens:
            self.finish(s, [], [], "length", events)
            return
        start = s.emitted
        events.append(Event(s.rid, self._new_tokens(s), self._text_delta(s, final=False),
                            logprobs=self._logprobs(s, start)))

    def _detokenize(self, s: SequenceState) -> None:
        """Extend `s.decoded` over the new tokens, one token at a time, each decoded only with the few
        before it (so the cost does not grow with the output): a token that ends inside a multi-byte
        character waits for the next one."""
        decode = self.tokenizer.decode
        for i in range(s.read_offset, len(s.generated)):
            text = decode(s.generated[s.prefix_offset: i + 1])
            if text.endswith("\ufffd") and i + 1 - s.read_offset < 4:
                continue  # an incomplete character (UTF-8 needs at most 4 bytes)
            s.decoded += text[len(s.prefix_text):]
            s.prefix_offset, s.read_offset = s.read_offset, i + 1
            s.prefix_text = decode(s.generated[s.prefix_offset: s.read_offset])
            s.ends.append(len(s.decoded))
            s.ends_at.append(i + 1)

    def _find_stop(self, s: SequenceState) -> tuple[int, int] | None:
        """The stop string that one-token decoding would stop at, in the text decoded since the last search:
        (start, end) or None. A run of several tokens (a block, a verified draft) can hold several stop
        strings; decoding token by token stops at the first decoded piece (`s.ends`) that completes one, and
        among those that piece completes, at the one that starts first. A stop string completed before
        params.min_tokens tokens does not count (vLLM's rule: no stop string is looked for before them)."""
        longest = max(len(stop) for stop in s.params.stop)
        start = max(0, s.searched - longest + 1)
        s.searched = len(s.decoded)
        # a stop counts where it ends in the first piece that reaches min_tokens or later (its end past the text
        # of the pieces before that one), so each stop is looked for from there
        first_counted = bisect.bisect_left(s.ends_at, s.params.min_tokens)
        if first_counted == len(s.ends_at):
            return None
        floor = s.ends[first_counted - 1] + 1 if first_counted else 0   # (the least end that counts)
        hits = [(at, at + len(stop)) for stop in s.params.stop
                if (at := s.decoded.find(stop, max(start, floor - len(stop)))) >= 0]
        if not hits:
            return None
        piece = {hit: bisect.bisect_left(s.ends, hit[1]) for hit in hits}
        first = min(piece.values())
        return min(hit for hit in hits if piece[hit] == first)

    @staticmethod
    def _stop_tail(s: SequenceState) -> int:
        """The longest tail of the decoded text that is a proper prefix of a stop string (it waits: a later token
        may complete the stop). Each stop's tail at the last call bounds the next (it grows by at most the text
        decoded since), so the work per call is the new text's length, amortised, not the stop strings'
        (scanning every prefix of 16 stops of 1 KiB on every event slowed the whole batch ~10x)."""
        text, new = s.decoded, len(s.decoded) - s.stop_tails_at
        if len(s.stop_tails) != len(s.params.stop):
            s.stop_tails = [0] * len(s.params.stop)
        for i, stop in enumerate(s.params.stop):
            k = min(len(stop) - 1, s.stop_tails[i] + new, len(text))
            while k > 0 and not text.endswith(stop[:k]):
                k -= 1
            s.stop_tails[i] = k
        s.stop_tails_at = len(text)
        return max(s.stop_tails, default=0)

    def _logprobs(self, s: SequenceState, start: int) -> list | None:
        """The log-probabilities of generated[start:] (the tokens an event carries), if requested."""
        return s.logprobs[start: len(s.generated)] if s.params.logprobs is not None else None

    def _new_tokens(self, s: SequenceState) -> list[int]:
        new = s.generated[s.emitted:]
        s.emitted = len(s.generated)
        return new

    def _text_delta(self, s: SequenceState, final: bool, text: str | None = None) -> str:
        if self.tokenizer is None:
            return ""
        if text is not None:
            full = text
        elif final:
            full = s.decoded + self.tokenizer.decode(s.generated[s.prefix_offset:])[len(s.prefix_text):]
        else:
            # whole characters only; hold back any tail that could start a stop string
            full = s.decoded
            full = full[: len(full) - self._stop_tail(s)]
        delta = full[len(s.text):] if full.startswith(s.text) else ""
        s.text = full if full.startswith(s.text) else s.text
        return delta

    def finish(self, s: SequenceState, tokens: list[int], steps: list[int], reason: str, events: list[Event],
               text: str | None = None, error: str | None = None, invalid: bool = False) -> None:
        s.generated.extend(tokens)
        s.accept_steps.extend(steps)
        s.finish_reason = reason
        delta = self._text_delta(s, final=True, text=text)
        s.stats.generated_tokens = len(s.generated)
        s.stats.wall_time = time.perf_counter() - s.started
        record = s.params.record_steps
        result = GenerationResult(
            request_id=s.rid, prompt_ids=s.prompt, token_ids=list(s.generated),
            text=s.text if self.tokenizer is not None else None, finish_reason=reason, stats=s.stats,
            accept_steps=list(s.accept_steps) if record else None, trace=s.trace if record else None,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            stop_logprob=s.stop_logprob, stop_token=s.stop_token,
        )
        start = s.emitted
        events.append(Event(s.rid, self._new_tokens(s), delta, True, result, error, self._logprobs(s, start), invalid))

    def _retire(self) -> None:
        for s in [s for s in self.running if s.finish_reason is not None]:
            self.running.remove(s)
            bisect.insort(self.free_rows, s.row)
            if s in self.prefilling:
                self.prefilling.remove(s)
        if not self.running and not self.waiting:
            self.cache, self.free_rows = None, []  # idle: give the memory back
        elif self.free_rows:
            self._compact()

    def _compact(self) -> None:
        """Keep the running sequences in the lowest rows, in row order: each sequence above a free row moves
        down into it (`PrefixCache.move_row`). A policy's sequences in consecutive rows are a slice of the
        cache, which the compiled passes need (over other rows they run eagerly): without this, the batch
        that is left when some sequences finish before the others decodes eagerly, at up to 3x the time
        of a compiled step (docs/measurements.md, session 45)."""
        for s in sorted(self.running, key=lambda s: s.row, reverse=True):
            if self.free_rows[0] > s.row:   # the rows below s are all taken: the running ones are consecutive
                break
            dst = self.free_rows.pop(0)
            self.cache.move_row(s.row, dst)
            bisect.insort(self.free_rows, s.row)
            s.row = dst
        self.running.sort(key=lambda s: s.row)
