"""The generation engine: batched block-diffusion (`low_confidence`) and autoregressive (`ar`) decoding.

Each sequence owns a row of one shared `PrefixCache`; a step runs at most one prefill, one preview
and one commit forward (diffusion rows) and one causal forward (AR rows) over the rows that need
them, so sequences of different lengths, block phases and algorithms advance together, join between
steps and leave when done (their row is reset and reused; the cache is dropped when idle).

`low_confidence`, exactly as in spec section 5: blocks are aligned to absolute positions with the
prompt tail fixed inside the first block; every preview picks a token and its confidence at each
masked position, accepts those at or above the threshold (at least the most confident one, at most
`max_accept_per_step`), and an accepted end-of-sequence token turns every later position of the
block into end-of-sequence. A resolved block is committed causally, and its tokens are emitted.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import torch

from clover.cache import PrefixCache
from clover.model import CloverForCausalLM
from clover.sampling import SamplingParams, pick_tokens


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    blocks: int = 0
    preview_forwards: int = 0
    commit_forwards: int = 0   # diffusion: block commits; ar: the causal forwards that produced tokens
    prefill_forwards: int = 0  # prompt-only forwards that produce no token (diffusion prefill)
    wall_time: float = 0.0     # seconds from admission to finish
    model_time: float = 0.0    # seconds inside model forwards this sequence took part in

    @property
    def nfe(self) -> int:
        return self.preview_forwards + self.commit_forwards

    @property
    def tpf(self) -> float:
        return self.generated_tokens / self.nfe if self.nfe else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "nfe": self.nfe, "tpf": self.tpf, "tokens_per_s": self.tokens_per_s}


@dataclass
class StepRecord:
    """One denoising step of one block (kept when `record_steps` is set)."""

    step: int                 # 1-based step count within the generation
    block: int                # absolute block index
    start: int                # absolute position of the block's first slot
    fixed: int                # leading slots holding prompt tokens
    tokens: list[int]         # the block after this step (mask id where still unknown)
    draft: list[int]          # this step's prediction at every slot (resolved slots keep their token)
    confidence: list[float]   # confidence of each prediction (1.0 for resolved slots)
    accepted: list[int]       # slots accepted at this step (end-of-sequence fill included)


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str        # "stop" (end of sequence, stop token or stop string), "length", "abort"
    stats: GenerationStats
    accept_steps: list[int] | None = None   # per generated token: the step that accepted it
    trace: list[StepRecord] | None = None


@dataclass
class Event:
    """What one step produced for one request: newly final tokens and text, and the end."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    result: GenerationResult | None = None


@dataclass
class _Sequence:
    rid: str
    prompt: list[int]
    params: SamplingParams
    block_size: int
    generator: torch.Generator
    counts: torch.Tensor                       # [V] response-token counts for the penalties
    started: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    row: int = -1
    generated: list[int] = field(default_factory=list)
    accept_steps: list[int] = field(default_factory=list)
    trace: list[StepRecord] = field(default_factory=list)
    text: str = ""                             # text already emitted
    emitted: int = 0                           # tokens already emitted
    step: int = 0
    pos: int = 0                               # committed positions in the cache
    block: torch.Tensor | None = None          # current block token ids [S]
    resolved: torch.Tensor | None = None       # [S] bool
    block_steps: list[int] = field(default_factory=list)
    fixed: int = 0
    finish_reason: str | None = None

    @property
    def is_ar(self) -> bool:
        return self.params.algorithm == "ar"


class Engine:
    def __init__(self, model: CloverForCausalLM, tokenizer: object | None = None, max_batch_size: int = 32) -> None:
        """`tokenizer` (optional) needs `decode(ids) -> str`; it enables text output and stop strings."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.config = model.config
        self.eos_ids = set(self.config.eos_token_ids)
        self.cache: PrefixCache | None = None
        self.free_rows: list[int] = []
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self._ids = itertools.count()
        self.forward_seconds = 0.0  # wall time inside model forwards, all sequences together

    # -- requests ------------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; it joins the batch at the next step. Raises ValueError for bad input."""
        params = params or SamplingParams()
        params.validate(self.config.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {self.config.vocab_size})")
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
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.waiting.append(_Sequence(
            rid=rid, prompt=prompt, params=params, block_size=params.block_size or self.config.block_size,
            generator=torch.Generator().manual_seed(seed), counts=torch.zeros(self.config.vocab_size,
                                                                              device=self.model.device),
            started=time.perf_counter(), stats=GenerationStats(prompt_tokens=len(prompt)),
        ))
        return rid

    def abort(self, request_id: str) -> bool:
        """Drop a request (waiting or running) at once, freeing its cache row."""
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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit waiting requests, then advance every running sequence by one forward of its kind."""
        events: list[Event] = []
        admitted = self._admit()
        if admitted:
            self._prefill(admitted, events)
        ar = [s for s in self.running if s.is_ar and s.finish_reason is None and s not in admitted]
        if ar:
            self._ar_step(ar, events)
        diffusion = [s for s in self.running if not s.is_ar and s.finish_reason is None]
        if diffusion:
            self._diffusion_step(diffusion, events)
        self._retire()
        return events

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Decode all prompts together (joined and retired as the batch limit allows), results in order."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} parameter sets for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        results: dict[str, GenerationResult] = {}
        while self.has_unfinished():
            for ev in self.step():
                if ev.finished and ev.result is not None:
                    results[ev.request_id] = ev.result
        return [results[i] for i in ids]

    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> Iterator[Event]:
        """Decode one prompt alone, yielding each block (or token, for `ar`) as it becomes final."""
        rid = self.add_request(prompt_ids, params)
        while True:
            for ev in self.step():
                if ev.request_id == rid:
                    yield ev
                    if ev.finished:
                        return
            if not any(s.rid == rid for s in itertools.chain(self.waiting, self.running)):
                return  # aborted

    # -- admission and prefill -----------------------------------------------------------------------
    def _admit(self) -> list[_Sequence]:
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
        self.running.extend(admitted)
        return admitted

    def _forward(self, seqs: list[_Sequence], fn: str, ids: torch.Tensor, lengths: list[int], **kw: object):
        rows = torch.tensor([s.row for s in seqs], device=self.model.device)
        t0 = time.perf_counter()
        out = getattr(self.model, fn)(ids, self.cache, lengths=torch.tensor(lengths, device=ids.device), rows=rows, **kw)
        dt = time.perf_counter() - t0
        self.forward_seconds += dt
        for s in seqs:
            s.stats.model_time += dt
        return out

    def _pad(self, rows: list[list[int]] | list[torch.Tensor], fill: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        out = torch.full((len(rows), width), fill, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
        return out.to(self.model.device)

    def _prefill(self, seqs: list[_Sequence], events: list[Event]) -> None:
        ar = [s for s in seqs if s.is_ar]
        if ar:
            logits = self._forward(ar, "causal", self._pad([s.prompt for s in ar], 0), [len(s.prompt) for s in ar],
                                   logits="last")
            for s, lg in zip(ar, logits, strict=True):
                s.stats.commit_forwards += 1
                s.pos = len(s.prompt)
                self._ar_token(s, lg, events)
        diffusion = [s for s in seqs if not s.is_ar]
        for s in diffusion:
            s.pos = len(s.prompt) // s.block_size * s.block_size
        needs = [s for s in diffusion if s.pos > 0]
        if needs:
            self._forward(needs, "causal", self._pad([s.prompt[: s.pos] for s in needs], 0), [s.pos for s in needs],
                          logits="none")
            for s in needs:
                s.stats.prefill_forwards += 1
        for s in diffusion:
            self._start_block(s)

    # -- autoregressive ------------------------------------------------------------------------------
    def _ar_step(self, seqs: list[_Sequence], events: list[Event]) -> None:
        ids = torch.tensor([[s.generated[-1]] for s in seqs], device=self.model.device)
        logits = self._forward(seqs, "causal", ids, [1] * len(seqs), logits="last")
        for s, lg in zip(seqs, logits, strict=True):
            s.stats.commit_forwards += 1
            s.pos += 1
            self._ar_token(s, lg, events)

    def _ar_token(self, s: _Sequence, logits: torch.Tensor, events: list[Event]) -> None:
        s.step += 1
        token, _ = pick_tokens(self._mask_out(logits[None]), s.params, s.counts, s.generator)
        t = int(token[0])
        if self._is_stop_token(s, t):
            self._finish(s, [], [], "stop", events)
            return
        s.counts[t] += 1
        self._emit(s, [t], [s.step], events)

    # -- block diffusion -----------------------------------------------------------------------------
    def _start_block(self, s: _Sequence) -> None:
        fixed = max(len(s.prompt) - s.pos, 0)  # the prompt tail, inside the first block only
        room = min(s.block_size - fixed, s.params.max_new_tokens - len(s.generated))
        s.fixed = fixed
        s.block = torch.full((fixed + room,), self.config.mask_token_id, dtype=torch.long, device=self.model.device)
        s.resolved = torch.zeros(fixed + room, dtype=torch.bool, device=self.model.device)
        if fixed:
            s.block[:fixed] = torch.tensor(s.prompt[s.pos:], device=self.model.device)
            s.resolved[:fixed] = True
        s.block_steps = [0] * (fixed + room)

    def _diffusion_step(self, seqs: list[_Sequence], events: list[Event]) -> None:
        blocks = self._pad([s.block for s in seqs], self.config.mask_token_id)
        logits = self._forward(seqs, "preview", blocks, [len(s.block) for s in seqs])
        done = []
        for s, lg in zip(seqs, logits, strict=True):
            s.stats.preview_forwards += 1
            self._accept(s, lg[: len(s.block)])
            if bool(s.resolved.all()):
                done.append(s)
        commit = []
        for s in done:
            s.stats.blocks += 1
            new = s.block[s.fixed:].tolist()
            steps = s.block_steps[s.fixed:]
            cut = next((j for j, t in enumerate(new) if self._is_stop_token(s, t)), None)
            if cut is not None:
                self._finish(s, new[:cut], steps[:cut], "stop", events)
            else:
                self._emit(s, new, steps, events)
            if s.finish_reason is None:
                commit.append(s)
        if commit:
            self._forward(commit, "causal", self._pad([s.block for s in commit], 0), [len(s.block) for s in commit],
                          logits="none")
            for s in commit:
                s.stats.commit_forwards += 1
                s.pos += len(s.block)
                self._start_block(s)

    def _accept(self, s: _Sequence, logits: torch.Tensor) -> None:
        """One denoising step on s.block given its preview logits [S,V]."""
        s.step += 1
        p = s.params
        masked = (~s.resolved).nonzero().squeeze(-1)                            # [M]
        tokens, conf = pick_tokens(self._mask_out(logits[masked]), p, s.counts, s.generator)
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
        s.counts.index_add_(0, chosen_tokens, torch.ones_like(chosen_tokens, dtype=s.counts.dtype))
        accepted = chosen.tolist()
        if not p.ignore_eos and self.eos_ids:
            is_eos = torch.tensor([int(t) in self.eos_ids for t in chosen_tokens.tolist()], dtype=torch.bool)
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
                tokens=torch.where(s.resolved, s.block, self.config.mask_token_id).tolist(), draft=draft.tolist(),
                confidence=confidence.tolist(), accepted=sorted(accepted),
            ))

    # -- output --------------------------------------------------------------------------------------
    def _mask_out(self, logits: torch.Tensor) -> torch.Tensor:
        """The mask token is never an output."""
        logits = logits.float().clone()
        logits[:, self.config.mask_token_id] = float("-inf")
        return logits

    def _is_stop_token(self, s: _Sequence, t: int) -> bool:
        return (t in self.eos_ids and not s.params.ignore_eos) or t in s.params.stop_token_ids

    def _emit(self, s: _Sequence, tokens: list[int], steps: list[int], events: list[Event]) -> None:
        """Append final tokens; finish on max_new_tokens or a stop string."""
        s.generated.extend(tokens)
        s.accept_steps.extend(steps)
        if s.params.stop:
            text = self.tokenizer.decode(s.generated)
            hits = [(text.find(stop), stop) for stop in s.params.stop if stop in text]
            if hits:
                at, stop = min(hits)
                # keep the tokens up to the one that completes the stop string; the text ends before it
                m = next(m for m in range(1, len(s.generated) + 1) if stop in self.tokenizer.decode(s.generated[:m]))
                del s.generated[m:], s.accept_steps[m:]
                self._finish(s, [], [], "stop", events, text=text[:at])
                return
        if len(s.generated) >= s.params.max_new_tokens:
            self._finish(s, [], [], "length", events)
            return
        events.append(Event(s.rid, self._new_tokens(s), self._text_delta(s, final=False)))

    def _new_tokens(self, s: _Sequence) -> list[int]:
        new = s.generated[s.emitted:]
        s.emitted = len(s.generated)
        return new

    def _text_delta(self, s: _Sequence, final: bool, text: str | None = None) -> str:
        if self.tokenizer is None:
            return ""
        full = self.tokenizer.decode(s.generated) if text is None else text
        if not final:
            # hold back an incomplete UTF-8 character and any tail that could start a stop string
            full = full.rstrip("\ufffd")
            hold = max((k for stop in s.params.stop for k in range(len(stop) - 1, 0, -1) if full.endswith(stop[:k])),
                       default=0)
            full = full[: len(full) - hold]
        delta = full[len(s.text):] if full.startswith(s.text) else ""
        s.text = full if full.startswith(s.text) else s.text
        return delta

    def _finish(self, s: _Sequence, tokens: list[int], steps: list[int], reason: str, events: list[Event],
                text: str | None = None) -> None:
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
        )
        events.append(Event(s.rid, self._new_tokens(s), delta, True, result))

    def _retire(self) -> None:
        for s in [s for s in self.running if s.finish_reason is not None]:
            self.running.remove(s)
            self.free_rows.append(s.row)
        if not self.running and not self.waiting:
            self.cache, self.free_rows = None, []  # idle: give the memory back
