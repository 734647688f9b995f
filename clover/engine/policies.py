"""Decoding policies: how a batch of running sequences advances by one engine step.

A policy is one small class behind one protocol: `prefill` the sequences just admitted, `step` the
others. It runs its forwards through the engine (`engine.forward`, `engine.fused`) over all its
sequences at once, decides tokens, and hands final ones to `engine.emit*`. A new decoding strategy
is one new class added to `POLICIES`.

- `ar` (spec section 5): one causal forward per token, which also commits it.
- `low_confidence` (spec section 5): blocks aligned to absolute positions, the prompt tail fixed in
  the first block; each preview picks a token and its confidence at every masked slot and accepts
  those at or above the threshold (at least the most confident, at most `max_accept_per_step`); an
  accepted end-of-sequence token fills the rest of the block. A resolved block is committed in the
  same forward as the next block's first preview, and the prompt prefill in the same forward as the
  first preview (`model.causal_and_preview`, equal to the separate passes): p forwards per block of
  p denoising steps, not p + 1.
- `verify` (spec section 5b): the preview drafts, the causal head decides. A block is previewed once
  (fused with the commit before it) and its drafts are checked a window at a time by causal forwards
  that write the cache only for the tokens they verify (`model.check` / `model.keep`): drafts are kept
  while they equal the `ar` decoder's choice, and the first disagreement is replaced by that choice,
  so every check yields at least one token and the output is `ar`'s (speculative sampling at
  temperature > 0). Nothing of a rejected draft reaches the cache. Drafts are checked only where the
  tokens a check is expected to keep pay for its cost over an `ar` step; elsewhere the forward is one.
  In a block decoded without a preview (one not worth its cost), greedy requests draft from their own
  context instead (`ContextLookup`: what followed the last earlier occurrence of the text's last few
  tokens), which costs no forward: agents copy arguments, paths and code they have read. A previewed
  block checks its context's drafts instead of the preview's where those have been kept more often.

Dimension letters: S block slots, V vocabulary.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from clover.engine.sampling import count_tokens, pick_tokens, sample_from, token_distribution, verify_drafts
from clover.engine.sequence import NO_DRAFT, Event, SequenceState, StepRecord

if TYPE_CHECKING:
    from clover.engine.engine import Engine


class Policy(Protocol):
    def reusable(self, s: SequenceState) -> int: ...
    def prefill(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None: ...
    def step(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None: ...


def prefill_prompts(engine: Engine, seqs: list[SequenceState]) -> torch.Tensor:
    """Prefill each prompt causally from where its restored prefix ends (s.pos, 0 without one): the
    causal logits [N,V] of each prompt's last token."""
    return engine.forward(seqs, "causal", engine.pad([s.prompt[s.pos:] for s in seqs], 0),
                          [len(s.prompt) - s.pos for s in seqs], logits="last")


def read_grammar(s: SequenceState, tokens: list[int]) -> None:
    """Advance the sequence's grammar over the tokens it emits next; a lazy grammar starts after its trigger."""
    if s.pending is not None:
        i = s.pending.read(tokens)
        if i is None:
            return
        s.matcher, s.pending = s.pending.fresh, None
        tokens = tokens[i + 1:]
    if s.matcher is not None:
        s.matcher.consume(tokens)


class AutoRegressive:
    """`ar`: the causal head picks each next token; the forward that reads a token also commits it."""

    def reusable(self, s: SequenceState) -> int:
        """Prompt tokens whose cache may be restored: all but the last, whose logits start decoding."""
        return len(s.prompt) - 1

    def prefill(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        """Prefill each prompt (`prefill_prompts`); its last logits give the first token."""
        logits = prefill_prompts(engine, seqs)
        for s, lg, pick in zip(seqs, logits, engine.greedy_picks(seqs, logits), strict=True):
            s.pos = len(s.prompt)
            with engine.isolated(s, events):
                self._token(engine, s, lg, events, pick)

    def step(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        ids = torch.tensor([[s.generated[-1]] for s in seqs], device=engine.device)
        logits = engine.forward(seqs, "causal", ids, [1] * len(seqs), logits="last")
        for s, lg, pick in zip(seqs, logits, engine.greedy_picks(seqs, logits), strict=True):
            s.pos += 1
            with engine.isolated(s, events):
                self._token(engine, s, lg, events, pick)

    def _token(self, engine: Engine, s: SequenceState, logits: torch.Tensor, events: list[Event],
               pick: int | None = None) -> None:
        """Pick the next token from the causal logits [V], or take `pick`, the batch's plain argmax
        (`engine.greedy_picks`: no grammar, hold or logprobs to apply)."""
        s.stats.commit_forwards += 1
        s.step += 1
        scored = None
        if pick is None:
            scored = engine.mask_out(logits[None])
            allowed = engine.hold_stops(s, scored if s.matcher is None else s.matcher.mask(scored), len(s.generated))
            pick = int(pick_tokens(allowed, s.params, s.counts, s.generator, confidence=False)[0][0])
        read_grammar(s, [pick])
        if not engine.is_stop_token(s, pick):
            count_tokens(s.counts, pick)
        engine.emit_final(s, [pick], [s.step], events, scored)   # logprobs: the model's, before the grammar


class _Blocks:
    """What the block policies share: block layout, the fused prefill / commit with the next preview."""

    def start_block(self, engine: Engine, s: SequenceState) -> None:
        fixed = max(len(s.prompt) - s.pos, 0)  # the prompt tail, inside the first block only
        room = min(s.block_size - fixed, s.params.max_new_tokens - len(s.generated))
        dev = engine.device
        s.fixed = s.verified = fixed
        s.block = torch.full((fixed + room,), engine.config.mask_token_id, dtype=torch.long, device=dev)
        s.resolved = torch.zeros(fixed + room, dtype=torch.bool, device=dev)
        if fixed:
            s.block[:fixed] = torch.tensor(s.prompt[s.pos:], device=dev)
            s.resolved[:fixed] = True
        s.block_steps = [0] * (fixed + room)

    def reusable(self, s: SequenceState) -> int:
        """Prompt tokens whose cache may be restored: the whole blocks the prefill would commit."""
        return len(s.prompt) // s.block_size * s.block_size

    def prefill(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        """Causal prefill of each prompt's whole blocks (from where a restored prefix ends, s.pos) fused
        with the preview of its first block."""
        start = [s.pos for s in seqs]
        for s in seqs:
            s.pos = len(s.prompt) // s.block_size * s.block_size
            self.start_block(engine, s)
        clean = [s.prompt[a: s.pos] for a, s in zip(start, seqs, strict=True)]
        last, logits = engine.fused(seqs, clean, [s.block for s in seqs], clean_logits="last")
        for i, s in enumerate(seqs):
            s.stats.prefill_forwards += int(len(clean[i]) > 0)
            s.stats.preview_forwards += 1
            with engine.isolated(s, events):
                self.after_preview(engine, s, logits[i, : len(s.block)], last[i] if clean[i] else None, events)

    def uncommitted(self, s: SequenceState) -> torch.Tensor:
        """The tokens of the finished block not yet in the cache: all of them (`verify` commits as it goes)."""
        return s.block

    def commit(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        """Commit what each finished block has not yet committed, fused with the first preview of the
        sequence's next block."""
        done = [self.uncommitted(s) for s in seqs]
        for s in seqs:
            s.pos += len(s.block)
            self.start_block(engine, s)
        last, logits = engine.fused(seqs, done, [s.block for s in seqs], clean_logits="last")
        for i, s in enumerate(seqs):
            s.stats.commit_forwards += 1
            with engine.isolated(s, events):
                self.after_preview(engine, s, logits[i, : len(s.block)], last[i], events)

    def after_preview(self, engine: Engine, s: SequenceState, logits: torch.Tensor, carry: torch.Tensor | None,
                      events: list[Event]) -> None:
        raise NotImplementedError


class LowConfidence(_Blocks):
    """`low_confidence`: accept confident slots of each preview until the block is resolved."""

    def prefill(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        super().prefill(engine, seqs, events)
        self._complete(engine, self._resolved(engine, seqs, events), events)

    def step(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        open_ = [s for s in seqs if not bool(s.resolved.all())]
        if open_:
            logits = engine.forward(open_, "preview", engine.pad([s.block for s in open_], engine.config.mask_token_id),
                                    [len(s.block) for s in open_], masked_only=True)
            slots = [(~s.resolved).nonzero().squeeze(-1) for s in open_]
            picks = engine.confident_picks(open_, logits, slots)    # the plain greedy ones, in one reduction
            for s, lg, masked, pick in zip(open_, logits, slots, picks, strict=True):
                s.stats.preview_forwards += 1
                with engine.isolated(s, events):
                    self._accept(engine, s, lg[: len(s.block)], masked, pick)
        self._complete(engine, self._resolved(engine, seqs, events), events)

    def after_preview(self, engine: Engine, s: SequenceState, logits: torch.Tensor, carry: torch.Tensor | None,
                      events: list[Event]) -> None:
        self._accept(engine, s, logits)

    def _resolved(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> list[SequenceState]:
        """The sequences whose block is resolved, once a lazy grammar started inside it has read it."""
        done = []
        for s in seqs:
            if s.finish_reason is None and bool(s.resolved.all()):
                with engine.isolated(s, events):
                    if self._settle(engine, s):
                        done.append(s)
        return done

    def _settle(self, engine: Engine, s: SequenceState) -> bool:
        """A resolved block under a lazy grammar not yet started: if the block emits its trigger, start it
        and let it read the slots after the trigger; the first it rejects and all after it are masked
        again (to be resolved in order, `_accept_in_order`). Whether the block is still resolved."""
        if s.pending is None:
            return True
        tokens = s.block[s.fixed:].tolist()
        i = s.pending.read(tokens)
        if i is None:
            return True
        s.matcher, s.pending = s.pending.fresh, None
        rest = tokens[i + 1:]
        n = s.matcher.valid_prefix(rest)
        if n == len(rest):
            s.matcher.consume(rest)
            return True
        s.matcher.consume(rest[:n])
        cut = s.fixed + i + 1 + n
        # forget the counts of the slots masked again (a slot filled by an earlier end of sequence was not counted)
        eos = [k for k, t in enumerate(tokens) if t in engine.eos_ids]
        last_counted = s.fixed + eos[0] if eos and not s.params.ignore_eos else len(s.block) - 1
        dropped = s.block[cut: last_counted + 1]
        count_tokens(s.counts, dropped, -1.0)
        s.block[cut:] = engine.config.mask_token_id
        s.resolved[cut:] = False
        s.block_steps[cut:] = [0] * (len(s.block) - cut)
        return False

    def _complete(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        """Emit resolved blocks; commit those whose sequence goes on (fused with their next preview)."""
        go_on = []
        for s in seqs:
            s.stats.blocks += 1
            with engine.isolated(s, events):
                engine.emit_final(s, s.block[s.fixed:].tolist(), s.block_steps[s.fixed:], events)
            if s.finish_reason is None:
                go_on.append(s)
        if go_on:
            self.commit(engine, go_on, events)

    def _accept(self, engine: Engine, s: SequenceState, logits: torch.Tensor, masked: torch.Tensor | None = None,
                pick: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One denoising step on s.block given its preview logits [S,V]. `masked`: its unresolved slots;
        `pick`: their tokens and confidences from `engine.confident_picks` (the batch's plain greedy ones)."""
        s.step += 1
        p = s.params
        if s.matcher is not None:
            self._accept_in_order(engine, s, logits)
            return
        if masked is None:
            masked = (~s.resolved).nonzero().squeeze(-1)                        # [M]
        if pick is not None:
            tokens, conf = pick
        else:
            # slot k holds response position len(generated) + k - fixed
            rows = engine.hold_stops(s, engine.mask_out(logits[masked]), len(s.generated) + masked.cpu() - s.fixed)
            tokens, conf = pick_tokens(rows, p, s.counts, s.generator)
        accept = conf >= p.threshold
        if not bool(accept.any()):
            accept[conf.argmax()] = True
        if p.max_accept_per_step is not None and int(accept.sum()) > p.max_accept_per_step:
            ranked = torch.where(accept, conf, torch.full_like(conf, -1.0))
            keep = ranked.topk(p.max_accept_per_step).indices
            accept = torch.zeros_like(accept)
            accept[keep] = True
        chosen, chosen_tokens = masked[accept], tokens[accept]
        s.block[chosen] = chosen_tokens
        s.resolved[chosen] = True
        for slot in chosen.tolist():
            s.block_steps[slot] = s.step
        count_tokens(s.counts, chosen_tokens)
        accepted = chosen.tolist()
        if not p.ignore_eos and engine.eos_ids:
            is_eos = torch.tensor([int(t) in engine.eos_ids for t in chosen_tokens.tolist()], dtype=torch.bool)
            if bool(is_eos.any()):
                first = int(chosen[is_eos.to(chosen.device)].min())
                later = torch.arange(first + 1, len(s.block), device=s.block.device)
                for slot in later[~s.resolved[later]].tolist():
                    s.block_steps[slot] = s.step
                    accepted.append(slot)
                s.block[later] = int(s.block[first])
                s.resolved[later] = True
        if p.record_steps:
            draft = s.block.clone()
            draft[masked] = tokens
            confidence = torch.ones(len(s.block))
            confidence[masked.cpu()] = conf.float().cpu()
            s.trace.append(StepRecord(
                step=s.step, block=s.pos // s.block_size, start=s.pos, fixed=s.fixed,
                tokens=torch.where(s.resolved, s.block, engine.config.mask_token_id).tolist(), draft=draft.tolist(),
                confidence=confidence.tolist(), accepted=sorted(accepted),
            ))


    def _accept_in_order(self, engine: Engine, s: SequenceState, logits: torch.Tensor) -> None:
        """A step under a grammar: the leftmost unresolved slot is accepted (its prediction masked by the
        grammar), then each following slot while its masked prediction is confident enough; the grammar
        reads each accepted token (slots resolve left to right, several per step)."""
        p = s.params
        first = int(s.resolved.sum())                                          # resolved slots are a prefix
        accepted: list[int] = []
        draft, confidence = s.block.clone(), torch.ones(len(s.block))
        for slot in range(first, len(s.block)):
            if p.max_accept_per_step is not None and len(accepted) == p.max_accept_per_step:
                break
            row = s.matcher.mask(engine.mask_out(logits[slot: slot + 1]))
            row = engine.hold_stops(s, row, len(s.generated) + slot - s.fixed)
            token, conf = pick_tokens(row, p, s.counts, s.generator)
            draft[slot], confidence[slot] = token[0], float(conf[0])
            if accepted and float(conf[0]) < p.threshold:
                break
            t = int(token[0])
            s.matcher.consume([t])
            s.block[slot], s.resolved[slot], s.block_steps[slot] = t, True, s.step
            accepted.append(slot)
            count_tokens(s.counts, t)
            if t in engine.eos_ids:                                            # the reply ends in this block
                rest = list(range(slot + 1, len(s.block)))
                s.block[slot + 1:], s.resolved[slot + 1:] = t, True
                for r in rest:
                    s.block_steps[r] = s.step
                accepted += rest
                break
        if p.record_steps:
            s.trace.append(StepRecord(
                step=s.step, block=s.pos // s.block_size, start=s.pos, fixed=s.fixed,
                tokens=torch.where(s.resolved, s.block, engine.config.mask_token_id).tolist(), draft=draft.tolist(),
                confidence=confidence.tolist(), accepted=accepted,
            ))


def lookup_match(context: np.ndarray, k: int, longest: int = 4, shortest: int = 1) -> tuple[list[int], int]:
    """(drafts, n): drafts from the context itself (prompt lookup, as n-gram speculation in vLLM): the k tokens that
    followed the last earlier occurrence of the context's final n tokens, for the largest n <= `longest`
    that occurred before; [] when no suffix of `shortest` tokens or more did. Where that continuation runs
    into the end of the context (a loop: the occurrence overlaps the suffix), it goes on with the loop's
    period. n: the length of the suffix matched (0: none). The reference of `ContextLookup`, which a
    decoder keeps up to date as its context grows."""
    t = len(context)
    for n in range(min(longest, t - 1), shortest - 1, -1):
        found = context[: t - n] == context[t - n]           # starts s < t - n of an earlier occurrence
        for i in range(1, n):
            found &= context[i: t - n + i] == context[t - n + i]
        hits = np.flatnonzero(found)
        if len(hits):
            return _continuation(context, int(hits[-1]) + n, k), n
    return [], 0


def _continuation(context: list[int] | np.ndarray, start: int, k: int) -> list[int]:
    """The k tokens of `context` from `start` on (what followed an occurrence), the loop from `start` to the
    context's end repeated where the context ends sooner."""
    after = context[start: start + k]
    after = after.tolist() if isinstance(after, np.ndarray) else after
    period = len(context) - start
    return after if len(after) >= k else [after[i % period] for i in range(k)]


class ContextLookup:
    """`lookup_match` over a context that only grows, indexed as it grows: for each suffix length n, the last
    start of every n-gram that is not the context's own suffix (a scan of the whole context per step cost
    ~50 us a sequence, 2% of a batch-8 step; indexing a prompt of 30,000 tokens takes ~20-45 ms, once)."""

    def __init__(self, tokens: list[int] | None = None, longest: int = 4, shortest: int = 1) -> None:
        self.tokens: list[int] = list(tokens or [])
        self.longest, self.shortest = longest, shortest
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(shortest, longest + 1)}
        self._indexed = dict.fromkeys(self._last, 0)   # per n: the n-grams starting before this are in _last

    def match(self, k: int) -> tuple[list[int], int]:
        """What `lookup_match(np.asarray(self.tokens), k, longest, shortest)` returns."""
        toks, t = self.tokens, len(self.tokens)
        for n in range(min(self.longest, t - 1), self.shortest - 1, -1):
            first, stop = self._indexed[n], t - n       # the n-grams starting in [first, stop): before the suffix's
            if stop > first:   # in order, so that each n-gram's entry ends at its last start
                grams = zip(*(toks[first + i: stop + i] for i in range(n)), strict=False)
                self._last[n].update(zip(grams, range(first, stop), strict=False))
                self._indexed[n] = stop
            s = self._last[n].get(tuple(toks[t - n:]))
            if s is not None:
                return _continuation(toks, s + n, k), n
        return [], 0


class VerifyPolicy(_Blocks):
    """`verify`: drafts from the block's preview, checked and corrected by the causal head (spec section 5b).

    A block is previewed once, fused with the commit of what precedes it, and its preview drafts
    every slot. Each check is then one causal forward over the verified tokens not yet in the cache
    (usually one: the last token the causal head picked) followed by the next `window` drafts
    (`model.check`): drafts are kept while they equal the `ar` decoder's choice, the first
    disagreement is replaced by that choice (speculative sampling at temperature > 0), and when all are
    kept the causal head adds the next token itself, so every check yields at least one token and the
    output is `ar`'s. `model.keep` then commits the verified rows of the check to the cache (the
    K/V already written, the GDN state of the last kept row), never a rejected draft's. The block is
    not re-previewed between checks (on clover-tiny a preview before every check kept more drafts but
    cost more than they saved: benchmarks/decode.py history in docs/measurements.md).

    Checking pays only when drafts are kept often enough, and the more drafts a check carries the
    more it costs (on 2 CPU cores a check of 1 + m tokens takes about 1.2x an `ar` step for m = 1 and 2x
    for m = 8: the matrix products read every weight either way, more slowly for several rows, and the
    MoE layers reach more experts). So before each forward the policy picks how many drafts to check,
    m = 0 (an `ar` step, whose pick still says whether the draft would have been kept) or m in 1, 2,
    4, ... up to `window` (with compiled passes 0 or `window` only: each check length is a graph to
    build), the one that maximises the tokens it expects per second: each sequence
    expects 1 + p + p^2 + ... + p^m tokens, with p a running estimate of how often its drafts are kept
    (a new sequence starts from the policy's estimate over the sequences before it: `prior`),
    and the forward of m drafts takes the fastest of its last 8 measured times (per batch size,
    the verification and the `keep` included; every m tried twice first: a first call may compile
    it; a batch size not measured yet scales the nearest one measured by the ratio of their steps).
    The output is `ar`'s whatever the choice. Deviation from the spec's "bit-identical" (5b): that holds
    in float32 (the CLI's default dtype; tested). In bfloat16 a check's forward over several rows rounds
    differently from a one-token step, and bf16 logits tie often (11.0 against 11.0): a review found greedy
    `verify` leave `ar` at a tie in 1 of 61 code prompts of 64 tokens, where `ar` at batch 1 and at batch 8
    already differ from each other in 3 of 61. One choice serves the batch (one forward). A fixed
    `cost_ratio` (the time of a `window`-draft check over a step) limits the choice to a step or a full
    check, the check iff a sequence expects more tokens than the ratio (0 always checks). Sampled
    requests (temperature > 0) always check `window` drafts, so that a seed gives the same tokens
    whatever the timings.

    A block decoded without a preview has no drafts of its own; a greedy sequence then
    drafts from its context (`lookup` on: `ContextLookup`, up to `window` tokens, within the block), with
    its own running estimate of how often those are kept (`lookup_hit`), and the same choice of how many
    to check. Such drafts cost nothing to make, and the check decides as for any draft. A previewed block
    checks them too, instead of the preview's, where they have been kept more often (`use_looked`: on
    code, clover-tiny's previews draft badly while its text repeats what it has read); the first token of
    each check says whether the source not checked would have kept its first draft, so that both
    estimates follow the text. The first block
    is no exception: where its preview would not pay (`preview_worth`), the prompt is prefilled as `ar`
    prefills it and the block drafts from the context.
    """

    _RATE = 0.25    # weight of each new observation in a sequence's running estimates
    _PRIOR = 0.05   # ... and in the policy's, which new sequences start from

    def __init__(self, window: int = 8, cost_ratio: float | None = None, lookup: bool = True) -> None:
        if window < 1:
            raise ValueError(f"window must be a positive number of drafts, got {window}")
        if cost_ratio is not None and cost_ratio < 0:
            raise ValueError(f"cost_ratio must be >= 0 or None, got {cost_ratio}")
        self.window, self.cost_ratio, self.lookup = window, cost_ratio, lookup
        self.choices = [0] + sorted({min(2 ** i, window) for i in range(window.bit_length() + 1)})
        self.seconds: dict[tuple[int | str, int], deque[float]] = {}   # recent forward times per (drafts, batch size)
        # what the sequences decoded so far found (draft_hit, lookup_hit, lookup_found): a new sequence starts
        # from it rather than from a guess, so that short replies (an agent's turn is one or two blocks) decide
        # well from their first block; it steers speed only, never the tokens
        self.prior = {"draft_hit": 0.5, "lookup_hit": 0.5, "lookup_found": 0.5}

    @staticmethod
    def expected(p: float, m: int) -> float:
        """Tokens a check of m drafts yields when each is kept with probability p: 1 + p + ... + p^m."""
        return sum(p ** i for i in range(m + 1))

    def drafts_to_check(self, seqs: list[SequenceState], compiled: bool = False,
                        looked: list[list[int]] | None = None, use: list[bool] | None = None) -> int:
        """How many drafts the batch's next forward checks per sequence (0: an `ar` step). `compiled`:
        the passes run compiled, where every check length is a graph to build (minutes on 2 CPU cores),
        so the choice is `window` drafts or none. `looked`: each sequence's drafts from its context
        (`looked_up`), checked where `use` says (default: `use_looked`)."""
        looked = looked or [[] for _ in seqs]
        use = use or [self.use_looked(s, look) for s, look in zip(seqs, looked, strict=True)]
        if any(not s.params.greedy for s in seqs):
            return self.window
        hit = [s.lookup_hit if u else s.draft_hit for s, u in zip(seqs, use, strict=True)]
        left = [len(look) if u else len(s.block) - s.verified for s, look, u in zip(seqs, looked, use, strict=True)]
        if not any(left):
            return 0
        if self.cost_ratio is not None:
            worth = any(self.expected(p, self.window) > self.cost_ratio for p, r in zip(hit, left, strict=True) if r)
            return self.window if worth else 0
        n, best, best_rate = len(seqs), 0, 0.0
        for m in self.choices if not compiled else (0, self.window):
            tried = len(self.seconds.get((0, n), ())) if m == 0 else sum(
                len(times) for key, times in self.seconds.items() if key[0] == m)
            took = self._time(m, n)
            if tried < 2 or took is None:
                return m                      # try each choice twice (a step at each batch size)
            rate = sum(self.expected(p, min(m, r)) for p, r in zip(hit, left, strict=True)) / took
            if rate > best_rate:
                best, best_rate = m, rate
        return best

    def prefill(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        """Start from the policy's prior; the first blocks worth a preview (`preview_worth`) are previewed
        fused with the prompts' prefill (as for block diffusion), the others prefilled as `ar` prefills (the
        whole prompt; its last logits fill the first free slot), then drafted from the context. (A deviation
        from spec section 5b, "same prefill as `low_confidence`", for blocks with nothing to preview: the
        output is `ar`'s either way, and this saves the prompt tail a forward of its own.)"""
        for s in seqs:
            s.draft_hit, s.lookup_hit, s.lookup_found = (self.prior[k]
                                                         for k in ("draft_hit", "lookup_hit", "lookup_found"))
        compiled = engine.model.decode_compiled
        n = sum(engine.policies.get(r.params.algorithm) is self and r not in engine.prefilling
                for r in engine.running)                      # the sequences that will step together
        plain = [s for s in seqs if not self.preview_worth(s, n, len(seqs), compiled, prefill=True)]
        previewed = [s for s in seqs if s not in plain]
        if previewed:
            # a prefill of at most one token a row is the forward of a commit with the preview: timed as one
            like_commit = all(len(s.prompt) // s.block_size * s.block_size - s.pos <= 1 for s in previewed)
            t0 = time.perf_counter()
            super().prefill(engine, previewed, events)
            if like_commit:
                self._record(("preview", len(previewed)), t0, engine.device)
        if plain:   # as `ar` prefills: the whole rest of the prompt, whose last logits give the first free slot
            for s, carry in zip(plain, prefill_prompts(engine, plain), strict=True):
                s.pos = len(s.prompt) // s.block_size * s.block_size
                self.start_block(engine, s)
                s.cached, s.drafts, s.draft_probs = len(s.prompt), None, None
                s.stats.prefill_forwards += 1
                s.stats.check_forwards += 1        # it gives the block's first token, as a step does
                s.stats.previews_skipped += 1
                with engine.isolated(s, events):
                    self._first_slot(engine, s, carry, events)

    def reusable(self, s: SequenceState) -> int:
        """As for block diffusion, but a prompt that ends on a block boundary keeps its last token to
        prefill: its causal logits predict the first slot of the first block."""
        whole = len(s.prompt) // s.block_size * s.block_size
        return whole - 1 if whole == len(s.prompt) else whole

    def step(self, engine: Engine, seqs: list[SequenceState], events: list[Event]) -> None:
        n, dev = len(seqs), engine.device
        t0 = time.perf_counter()
        # drafts from the context (with a prefix cache too: a keep that crosses a block boundary before its end,
        # as one that commits the block before's last token with drafts does, leaves that boundary's state to it)
        looked = [self.looked_up(s) for s in seqs]
        use = [self.use_looked(s, look) for s, look in zip(seqs, looked, strict=True)]
        chosen = self.drafts_to_check(seqs, engine.model.decode_compiled, looked, use)   # one forward serves the batch
        inputs, pending, drafted, sources = [], [], [], []
        for s, look, u in zip(seqs, looked, use, strict=True):
            j = s.verified                                   # slots < j are verified
            p = s.pos + j - s.cached                         # verified, not yet in the cache (>= 1)
            pend = s.block[j - p: j] if p <= j else torch.cat([s.behind[len(s.behind) - p + j:], s.block[:j]])
            # the preview's drafts, or those from the context (a block without a preview: else `ar` steps)
            source = torch.tensor(look, dtype=torch.long, device=dev) if u else s.drafts[j:]
            m = min(chosen, len(source))                     # drafts checked
            inputs.append(torch.cat([pend, source[:m]]) if m else pend)
            pending.append(p)
            drafted.append(m)
            sources.append(source if u else None)
        lengths = [len(x) for x in inputs]
        picks: list[int | None] = [None] * n
        if max(lengths) == 1:   # no drafts to check: an `ar` step, which commits its token
            logits = engine.forward(seqs, "causal", torch.stack(inputs), lengths, logits="all")
            trail, key = None, (0, n)
            picks = engine.greedy_picks(seqs, logits[:, 0])
        else:
            # one shape per choice (the pending token and the chosen drafts), padded to it; a prompt
            # tail's is wider (compiled: padded to a block, one shape), and not timed (it says nothing of
            # the usual cost)
            width = 1 + chosen if max(lengths) <= 1 + chosen else max(lengths)
            if width > 1 + chosen and engine.model.decode_compiled:
                width = max(width, engine.config.block_size)
            ids = engine.pad(inputs, 0)
            ids = torch.cat([ids, ids.new_zeros(n, width - ids.shape[1])], dim=1)
            logits, trail = engine.forward(seqs, "check", ids, lengths)
            key = (chosen, n) if width == 1 + chosen else None
            picks = engine.greedy_picks(seqs, logits)        # per plain row, the argmax of every position
        counts = [0] * len(seqs)
        for i, s in enumerate(seqs):
            p, m = pending[i], drafted[i]
            s.stats.check_forwards += 1
            s.stats.draft_checks += int(m > 0)
            before = len(s.generated)
            with engine.isolated(s, events):
                preds = logits[i, p - 1: p + m]              # row t predicts the slot after it
                if s.verified + m == len(s.block):
                    s.carry = preds[m].clone()               # the next block's first slot
                    preds = preds[:m]
                pick = picks[i][p - 1: p - 1 + len(preds)] if isinstance(picks[i], list) else picks[i]
                # (a block of one slot is full before its first check: the forward only commits)
                counts[i] = p + (self._check(engine, s, preds, m, events, pick, sources[i], looked[i])
                                 if len(preds) else 0)
            if s.finish_reason is not None:   # finished here: keep the rows of what it committed (pending, and
                # drafts up to the stop or max_tokens: the reply's last whole block is then in the prefix cache)
                counts[i] = max(0, min(counts[i], p + len(s.generated) - before))   # (0 when the check failed)
        if trail is not None:
            engine.keep(seqs, trail, counts)
        if key is not None:
            self._record(key, t0, dev)
        done = []
        for s, kept in zip(seqs, counts, strict=True):
            s.cached += kept
            if s.behind is not None and s.cached >= s.pos:
                s.behind = None
            full = s.verified == len(s.block)
            s.stats.blocks += int(full or s.finish_reason is not None)
            if s.finish_reason is None and full:
                done.append(s)
        if done:
            self.next_block(engine, done, events, n)

    def looked_up(self, s: SequenceState) -> list[int]:
        """Drafts from the sequence's context for the slots after its verified ones (`ContextLookup`, at
        most `window`, within the block), where the request is greedy; else [].
        Under a grammar the check masks each draft's row, so a draft the grammar forbids is rejected there."""
        if not self.lookup or not s.params.greedy:
            return []
        if s.context is None:
            s.context = ContextLookup(s.prompt)
        s.context.tokens += s.generated[len(s.context.tokens) - len(s.prompt):]
        found = s.context.match(min(self.window, len(s.block) - s.verified))[0]
        self._learn(s, "lookup_found", bool(found))
        return found

    def use_looked(self, s: SequenceState, looked: list[int]) -> bool:
        """Whether the next check takes the drafts from the context (`looked`, from `looked_up`; perhaps
        none) rather than the block's preview: where the block has no preview, or where the context offers
        drafts that have been kept more often (`lookup_hit` > `draft_hit`: on code the preview's often fail
        where the text repeats what it has read)."""
        return s.drafts is None or (bool(looked) and s.lookup_hit > s.draft_hit)

    def _learn(self, s: SequenceState, name: str, seen: float) -> None:
        """One observation of the running estimate `name` (draft_hit, lookup_hit, lookup_found): into the
        sequence's (weight _RATE) and, from greedy requests, into the policy's prior (weight _PRIOR: it
        follows the last few requests' checks, whichever they were)."""
        setattr(s, name, getattr(s, name) + self._RATE * (seen - getattr(s, name)))
        if s.params.greedy:   # (a sampled draft is kept by chance as well: not what a greedy one expects)
            self.prior[name] += self._PRIOR * (seen - self.prior[name])

    def _time(self, m: int | str, n: int) -> float | None:
        """The best recent time of a forward checking m drafts (0: a step; "preview", "preview alone": a
        preview fused with a commit, or of its own) for n sequences: measured twice or more, else that at
        the nearest batch size so measured, scaled by the ratio of the steps at the two sizes (so that a
        batch whose size changes as its sequences finish or start blocks apart does not try every choice at
        every size), or a single measurement where it is faster; None where there is neither."""
        exact = self.seconds.get((m, n), ())
        if len(exact) >= 2:
            return min(exact)
        sizes = sorted((abs(k - n), -k) for (key, k), times in self.seconds.items()
                       if key == m and k != n and len(times) >= 2 and (0, k) in self.seconds)
        scaled = None
        if sizes and (0, n) in self.seconds:
            k = -sizes[0][1]
            scaled = min(self.seconds[m, k]) * min(self.seconds[0, n]) / min(self.seconds[0, k])
        if exact:   # one sample alone may be a first call, or noise: not trusted over the scaled estimate
            return min(exact) if scaled is None else min(min(exact), scaled)
        return scaled

    def _record(self, key: tuple, t0: float, dev: torch.device) -> None:
        """Keep the time since t0 among the last 8 of `key` (on CUDA after the kernels finish: they run
        asynchronously, and their launch is not their cost)."""
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.seconds.setdefault(key, deque(maxlen=8)).append(time.perf_counter() - t0)

    @staticmethod
    def waiting(s: SequenceState) -> bool:
        """Whether the finished block's last verified token is not in the cache yet (its commit can carry
        the next block's preview); else the check that ended the block kept every draft."""
        return s.cached < s.pos + len(s.block)

    def preview_worth(self, s: SequenceState, n: int, k: int, compiled: bool = False, prefill: bool = False) -> bool:
        """Whether to preview this sequence's next block (`n` sequences step together, `k` finish a block
        now; `prefill`: its first block, whose preview the prompt's forward would carry). A preview costs
        a forward over the block's positions (`k` rows), fused with the commit of the block's last token
        where that one waits for the cache (less the `ar` step the fused logits save when the whole batch
        previews), else a forward of its own (timed apart); its drafts pay
        when the checks they make worthwhile save more: B * (t0 - t/E) over the block's B slots, t0 the
        time per token without a preview (a step, or a check of drafts from the context where those pay:
        `_plain_time`), t that of the best check and E = 1 + p + .. + p^m the tokens it yields. Blocks whose
        preview does not pay are decoded by checks of drafts from the context, or `ar` steps; after 1, 2, 4,
        then 8 such blocks in a row one is previewed again (a probe), so that the estimate p follows the text
        (after n times as many where the probe is a forward apart from the rest of the batch's n sequences,
        all of which it delays). Sampled requests and `cost_ratio` 0 preview every block; a fixed
        `cost_ratio` previews iff a full check would pay."""
        if not s.params.greedy or self.cost_ratio == 0:
            return True
        if self.cost_ratio is not None:
            worth = self.expected(s.draft_hit, self.window) > self.cost_ratio
        else:
            # the block's last verified token waits for the cache: its commit carries the preview, and its
            # logits give the first slot, which a block without a preview takes an `ar` step for (a step of
            # the batch saved if the whole batch previews now); else the preview is a forward of its own
            # and the check before it predicted the first slot anyway
            fused = prefill or self.waiting(s)
            t0, preview = self._time(0, n), self._time("preview" if fused else "preview alone", k)
            if t0 is None or preview is None:
                return True                                   # not measured yet: preview (and measure)
            times = {m: self._time(m, n) for m in self.choices[1:] if not compiled or m == self.window}
            rates = [self.expected(s.draft_hit, m) / t for m, t in times.items() if t is not None]
            if not rates:
                return True
            tail = len(s.prompt) % s.block_size if prefill else 0     # a prompt tail in the first block
            left = min(s.block_size - tail, s.params.max_new_tokens - len(s.generated))
            plain = self._plain_time(s, n, t0, compiled)
            saved = t0 if fused and k == n and not prefill else 0.0
            # previewed, a prompt tail takes a check of its own (else the prefill's logits give the first slot)
            worth = left * (plain - 1 / max(rates)) > preview - saved + (t0 if tail else 0.0)
        # a probe that needs a forward apart from the batch's delays all n sequences: n times as rare
        if worth or s.skipped >= s.skip_limit * (1 if k == n else n):
            s.skip_limit = 1 if worth else min(2 * s.skip_limit, 8)
            s.skipped = 0
            return True
        s.skipped += 1
        return False

    def _plain_time(self, s: SequenceState, n: int, t0: float, compiled: bool) -> float:
        """Seconds per token of s's next block decoded without a preview: an `ar` step (t0) for each, or
        checks of drafts from the context, found in a share `lookup_found` of the steps and kept as
        `lookup_hit` says, where those are faster."""
        best = t0
        if self.lookup:
            for m in self.choices[1:]:
                took = self._time(m, n) if not compiled or m == self.window else None
                if took is not None:
                    tokens = 1 + s.lookup_found * (self.expected(s.lookup_hit, m) - 1)
                    best = min(best, took / tokens)
        return best

    def next_block(self, engine: Engine, seqs: list[SequenceState], events: list[Event], n: int) -> None:
        """Start the next block of each finished one (`n` sequences step together). Previewed: fused with
        the commit of its last token when the causal head picked that one (else the check kept every row,
        and its last row predicts the slot). Not previewed (`preview_worth`): no forward; the next step
        commits the token left behind, or the causal prediction of the slot fills it now."""
        compiled = engine.model.decode_compiled
        plain = [s for s in seqs if not self.preview_worth(s, n, len(seqs), compiled)]
        for s in plain:
            s.stats.previews_skipped += 1
            behind = s.block[s.cached - s.pos:]
            s.pos += len(s.block)
            self.start_block(engine, s)
            s.drafts = s.draft_probs = None
            if len(behind):
                s.behind = behind.clone()
            else:
                s.cached = s.pos
                with engine.isolated(s, events):
                    self._first_slot(engine, s, s.carry, events)
        seqs = [s for s in seqs if s not in plain]
        commit = [s for s in seqs if self.waiting(s)]
        if commit:
            t0 = time.perf_counter()
            self.commit(engine, commit, events)
            self._record(("preview", len(commit)), t0, engine.device)
        rest = [s for s in seqs if s not in commit]
        for s in rest:
            s.pos += len(s.block)
            self.start_block(engine, s)
        if rest:
            t0 = time.perf_counter()
            logits = engine.forward(rest, "preview", engine.pad([s.block for s in rest], engine.config.mask_token_id),
                                    [len(s.block) for s in rest], masked_only=True)
            self._record(("preview alone", len(rest)), t0, engine.device)
            for s, lg in zip(rest, logits, strict=True):
                s.stats.preview_forwards += 1
                with engine.isolated(s, events):
                    self.after_preview(engine, s, lg[: len(s.block)], s.carry, events)

    def uncommitted(self, s: SequenceState) -> torch.Tensor:
        """The verified tokens of the block not yet in the cache (its last one)."""
        return s.block[s.cached - s.pos:]

    def after_preview(self, engine: Engine, s: SequenceState, logits: torch.Tensor, carry: torch.Tensor | None,
                      events: list[Event]) -> None:
        """Draft the block from its preview logits [S,V]; the cache now ends at the block's start. Without a
        prompt tail in the block, the causal prediction `carry` of its first slot gives that slot now."""
        s.cached = s.pos
        self._draft(engine, s, logits)
        if s.fixed == 0:
            self._first_slot(engine, s, carry, events)

    def _first_slot(self, engine: Engine, s: SequenceState, carry: torch.Tensor, events: list[Event]) -> None:
        """Fill the block's first slot from the causal logits `carry` [V] that predict it; a sequence that
        ends there (a stop) ends in this block, which no step of its own will count."""
        self._check(engine, s, carry[None], 0, events)
        s.stats.blocks += int(s.finish_reason is not None)

    def _draft(self, engine: Engine, s: SequenceState, logits: torch.Tensor) -> None:
        """Draft the unresolved slots from preview logits [S,V]: argmax, or a sample whose distribution
        is kept for the speculative acceptance."""
        masked = ~s.resolved
        lg = engine.mask_out(logits[masked])
        s.drafts = s.block.clone()
        if s.params.greedy:
            s.drafts[masked] = pick_tokens(lg, s.params, s.counts, s.generator, confidence=False)[0]
            s.draft_probs = None
        else:
            probs = token_distribution(lg, s.params, s.counts)                    # [M,V]
            s.drafts[masked] = sample_from(probs, s.generator)
            s.draft_probs = torch.zeros(len(s.block), probs.shape[-1], device=probs.device)
            s.draft_probs[masked] = probs

    def _check(self, engine: Engine, s: SequenceState, preds: torch.Tensor, m: int, events: list[Event],
               pick: int | list[int] | None = None, looked: torch.Tensor | None = None,
               alternative: list[int] | None = None) -> int:
        """Keep the drafts of slots j .. j+m-1 that the causal head agrees with (j: the first unverified
        slot), given the causal logits `preds` [m or m+1, V] that predict slots j .. When all are kept and
        a row predicts slot j+m, the causal head's own token for it follows. `pick`, where
        `engine.greedy_picks` found the batch's plain argmax: that token (m = 0, an `ar` step) or the argmax
        of each row of `preds` (a check), which decide as `verify_drafts` would. The drafts are `looked`, drafts
        looked up for slots j .. (`looked_up`), where given, else the preview's. `alternative`: the drafts looked
        up, whether checked or not (the causal head's first token says whether the source not checked would
        have kept its first draft). Returns the drafts kept."""
        j = s.verified
        end = j + m
        offered = looked if looked is not None else s.drafts[j:] if s.drafts is not None else s.block[j:j]
        drafts = offered[:m]
        probs = None if looked is not None or s.draft_probs is None else s.draft_probs[j:end]
        raw = None
        if isinstance(pick, int):
            tokens, kept = [pick], 0
            count_tokens(s.counts, pick)
        elif pick is not None:                       # the batch's plain argmax at each row: the greedy check
            listed = drafts.tolist()
            kept = next((r for r, t in enumerate(listed) if pick[r] != t), m)
            tokens = listed[:kept] + pick[kept: kept + 1]
            count_tokens(s.counts, tokens)
        else:
            preds = raw = engine.mask_out(preds)
            grammar = s.matcher if s.matcher is not None else s.pending
            complete: list[bool] = []
            if grammar is not None:   # each row masked by the grammar state after the drafts before it
                masks, complete = grammar.masks_along(drafts.tolist())   # None: no grammar there yet
                masks, complete = masks[: len(preds)], complete[: len(preds)]
                if any(a is not None for a in masks):
                    preds = preds.clone()
                    for r, allowed in enumerate(masks):
                        if allowed is not None:
                            preds[r] = preds[r].masked_fill(~allowed.to(preds.device), float("-inf"))
            preds = engine.hold_stops(s, preds, len(s.generated), complete)   # row i: response position len + i
            tokens, kept = verify_drafts(preds[:m], drafts, probs, s.params, s.counts, s.generator)
            if kept == m and len(preds) > m:                       # every draft kept: the causal head goes on
                t = int(pick_tokens(preds[m: m + 1], s.params, s.counts, s.generator, confidence=False)[0][0])
                tokens.append(t)                                   # (as `ar` picks it)
                count_tokens(s.counts, t)
        # drafts kept, then the one rejected; unchecked, whether the causal head's pick equals the draft
        if m:
            seen = [True] * kept + [False] * (kept < m)
        else:
            seen = [tokens[0] == int(offered[0])] if len(offered) else []
        for hit in seen:
            self._learn(s, "lookup_hit" if looked is not None else "draft_hit", hit)
        # the source not checked: whether its first draft equals the causal head's first token
        if looked is not None and s.drafts is not None:
            self._learn(s, "draft_hit", tokens[0] == int(s.drafts[j]))
        elif looked is None and alternative:                   # (`looked_up` offers none to sampled requests)
            self._learn(s, "lookup_hit", tokens[0] == alternative[0])
        if looked is not None:
            s.stats.lookup_drafts += m
            s.stats.lookup_accepted += kept
        read_grammar(s, tokens)
        s.step += 1
        stop = j + len(tokens)
        s.block[j:stop] = torch.tensor(tokens, device=s.block.device)
        s.resolved[j:stop] = True
        s.verified = stop
        s.block_steps[j:stop] = [s.step] * len(tokens)
        s.stats.drafts_proposed += m
        s.stats.drafts_accepted += kept
        if s.params.record_steps:   # slots with no draft (no preview, none from the context): NO_DRAFT, confidence 0
            draft = torch.where(s.resolved, s.block, NO_DRAFT if s.drafts is None else s.drafts)
            draft[j:end] = drafts
            conf = torch.ones(len(s.block)) if s.drafts is not None else s.resolved.float().cpu()
            conf[j:end] = 1.0
            if probs is not None:
                conf[j:end] = probs.gather(-1, drafts[:, None]).squeeze(-1).float().cpu()
            s.trace.append(StepRecord(
                step=s.step, block=s.pos // s.block_size, start=s.pos, fixed=s.fixed,
                tokens=torch.where(s.resolved, s.block, engine.config.mask_token_id).tolist(), draft=draft.tolist(),
                confidence=conf.tolist(), accepted=list(range(j, stop)), rejected=[j + kept] if kept < m else [],
            ))
        engine.emit_final(s, tokens, [s.step] * len(tokens), events, None if raw is None else raw[: len(tokens)])
        return kept


POLICIES: dict[str, type] = {"ar": AutoRegressive, "low_confidence": LowConfidence, "verify": VerifyPolicy}
