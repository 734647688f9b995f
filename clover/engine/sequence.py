"""What the engine keeps per request and hands back: statistics, step records, results, events, and
the decoding state of one running sequence (shared by the engine and the decoding policies)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from clover.engine.sampling import SamplingParams, TokenLogprob
from clover.engine.structured import Matcher, Pending

if TYPE_CHECKING:
    from clover.engine.policies import ContextLookup
    from clover.engine.prefix_cache import Entry


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    blocks: int = 0
    preview_forwards: int = 0  # previews (a prefill fused with the first preview counts here, once)
    commit_forwards: int = 0   # block commits (a commit fused with the next preview counts here, once);
                               # ar: the causal forwards that produced tokens
    check_forwards: int = 0    # verify: causal checks of drafts (an `ar` step when none was worth checking)
    draft_checks: int = 0      # verify: those of the checks that carried drafts
    previews_skipped: int = 0  # verify: blocks decoded without a preview (drafts not worth their cost)
    prefill_forwards: int = 0  # prompt prefills (no forward of their own when fused with a preview)
    cached_tokens: int = 0     # prompt tokens restored from the prefix cache instead of prefilled
    drafts_proposed: int = 0   # verify: draft tokens checked
    drafts_accepted: int = 0   # verify: draft tokens the causal head agreed with
    lookup_drafts: int = 0     # verify: those of the draft tokens checked that came from the context
    lookup_accepted: int = 0   # verify: those of them the causal head agreed with
    wall_time: float = 0.0     # seconds from admission to finish
    model_time: float = 0.0    # seconds inside model forwards this sequence took part in

    @property
    def nfe(self) -> int:
        return self.preview_forwards + self.commit_forwards + self.check_forwards

    @property
    def tpf(self) -> float:
        return self.generated_tokens / self.nfe if self.nfe else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "nfe": self.nfe, "tpf": self.tpf, "tokens_per_s": self.tokens_per_s}


NO_DRAFT = -1   # StepRecord.draft of a slot nothing predicted (a `verify` block decoded without a preview)


@dataclass
class StepRecord:
    """One denoising step of one block (kept when `record_steps` is set)."""

    step: int                 # 1-based step count within the generation
    block: int                # absolute block index
    start: int                # absolute position of the block's first slot
    fixed: int                # leading slots holding prompt tokens
    tokens: list[int]         # the block after this step (mask id where still unknown)
    draft: list[int]          # this step's prediction at every slot (resolved slots keep their token; NO_DRAFT)
    confidence: list[float]   # confidence of each prediction (1.0 for resolved slots)
    accepted: list[int]       # slots accepted at this step (end-of-sequence fill included)
    rejected: list[int] = field(default_factory=list)  # verify: the slot whose draft the causal head replaced


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str        # "stop" (end of sequence, stop token or stop string), "length", "abort", "error"
    stats: GenerationStats
    accept_steps: list[int] | None = None   # per generated token: the step that accepted it
    trace: list[StepRecord] | None = None
    logprobs: list[TokenLogprob] | None = None   # per generated token, when params.logprobs is set
    stop_logprob: tuple[int, TokenLogprob] | None = None   # the stop token that ended it, with its logprob
    stop_token: int | None = None   # the stop token (end of sequence or a stop_token_ids entry) that ended it:
    # not in token_ids or the text, but a token the model generated (the OpenAI usage counts it, as vLLM does)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, as an OpenAI server's usage counts them: token_ids and the stop token that ended it."""
        return len(self.token_ids) + (self.stop_token is not None)


@dataclass
class Event:
    """What one step produced for one request: newly final tokens and text, and the end."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    result: GenerationResult | None = None
    error: str | None = None                   # set when this request failed (finish_reason "error")
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when params.logprobs is set
    invalid: bool = False                      # the error came from the request itself (its grammar), not Clover


@dataclass(eq=False)  # identity: the engine keeps sequences in lists and tests membership
class SequenceState:
    rid: str
    prompt: list[int]
    params: SamplingParams
    block_size: int
    generator: torch.Generator
    counts: torch.Tensor | None                # [V] response-token counts for the penalties (None: it has none)
    started: float
    stats: GenerationStats = field(default_factory=GenerationStats)
    row: int = -1
    generated: list[int] = field(default_factory=list)
    accept_steps: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)   # aligned with `generated` when requested
    matcher: Matcher | None = None             # the grammar state of a constrained sequence
    pending: Pending | None = None             # a lazy grammar not yet started (its trigger not yet emitted)
    stop_logprob: tuple[int, TokenLogprob] | None = None   # the stop token that ended it (params.logprobs)
    stop_token: int | None = None              # the stop token that ended it
    trace: list[StepRecord] = field(default_factory=list)
    text: str = ""                             # text already emitted
    emitted: int = 0                           # tokens already emitted
    # incremental detokenisation: `decoded` is the text of generated[:read_offset] (whole characters);
    # `prefix_text` decodes generated[prefix_offset:read_offset]; `ends[i]` is len(decoded) after
    # stable point i and `ends_at[i]` the token count there; stop strings were searched up to `searched`;
    # `stop_tails[i]`: the longest tail of `decoded[:stop_tails_at]` that stop string i starts with
    decoded: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    prefix_text: str = ""
    ends: list[int] = field(default_factory=list)
    ends_at: list[int] = field(default_factory=list)
    searched: int = 0
    stop_tails: list[int] = field(default_factory=list)
    stop_tails_at: int = 0
    chain: list[bytes] = field(default_factory=list)  # prefix-cache keys of the committed blocks
    branch: int | None = None                  # prefix cache: the block its lookup found cached beyond the states
    reuse_block: int | None = None             # prefix cache: the last block its lookup could restore
    frontier: tuple[bytes, Entry] | None = None   # prefix cache: the block (key, entry) it claims as its frontier
    step: int = 0
    pos: int = 0                               # committed positions in the cache
    block: torch.Tensor | None = None          # current block token ids [S]
    resolved: torch.Tensor | None = None       # [S] bool
    block_steps: list[int] = field(default_factory=list)
    fixed: int = 0
    finish_reason: str | None = None
    # verify: drafts for the unresolved slots (None in a block decoded without a preview), their draft
    # distributions (temperature > 0), the causal head's logits for the next block's first slot (when the
    # check that ends a block predicted it), the positions in the cache (verified tokens past it, usually
    # one, wait for the next check; in a block without a preview `behind` holds those of the block before
    # it), and when to preview a block again after skipping some
    drafts: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    carry: torch.Tensor | None = None
    cached: int = 0
    verified: int = 0                          # verified slots of the block (a prefix; `resolved` as a count)
    behind: torch.Tensor | None = None
    draft_hit: float = 0.5                     # running estimate of how often a draft is kept
    lookup_hit: float = 0.5                    # the same for drafts from the context (`ContextLookup`)
    lookup_found: float = 0.5                  # running estimate of how often the context offers drafts
    context: ContextLookup | None = None       # prompt and output so far, indexed for drafts from the context
    skipped: int = 0                           # previews skipped in a row
    skip_limit: int = 1                        # how many in a row before the next probe preview
