"""Sampling parameters, logit penalties, and picking a token with its confidence.

Dimension letters: M positions being decided, V vocabulary.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

import torch

from clover.engine.structured import Constraint
from clover.model.chat import lone_surrogate
from clover.model.config import GenerationConfig

ALGORITHMS = ("low_confidence", "ar", "verify")
LOGPROB_ALGORITHMS = ("ar", "verify")   # their tokens are the causal head's: their log-probabilities are exact
MAX_LOGPROBS = 20
# Temperatures below this are greedy (as in vLLM): dividing logits by a smaller one overflows to inf.
GREEDY_BELOW = 1e-5
SEED_BOUND = 2**63   # seeds are integers in [0, SEED_BOUND): what torch.Generator.manual_seed takes
SEED_RULE = "an integer in [0, 2**63)"   # what an error about a seed says
_DEFAULTS = GenerationConfig()


class InvalidParameter(ValueError):
    """A sampling parameter out of its bounds; `param` names it (the field of an API request)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """Everything one request may set. The decoding defaults are `GenerationConfig`'s (spec section 5)."""

    max_new_tokens: int = 256
    temperature: float = _DEFAULTS.temperature
    top_k: int = _DEFAULTS.top_k        # 0: off
    top_p: float = _DEFAULTS.top_p
    min_p: float = 0.0                  # vLLM's: drop tokens less likely than min_p x the likeliest (0: off)
    seed: int | None = None
    presence_penalty: float = _DEFAULTS.presence_penalty
    frequency_penalty: float = _DEFAULTS.frequency_penalty
    repetition_penalty: float = _DEFAULTS.repetition_penalty
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False   # vLLM's: the text ends with the stop string that ended it
    ignore_eos: bool = False
    algorithm: str = _DEFAULTS.algorithm
    block_size: int | None = _DEFAULTS.block_size  # None: the model's block size
    threshold: float = _DEFAULTS.threshold
    max_accept_per_step: int | None = None  # None: no cap
    logprobs: int | None = None         # per generated token: its log-probability and the top-N (ar, verify)
    constraint: Constraint | None = None   # a grammar the reply must match (structured output)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit), OpenAI's
    min_tokens: int = 0                 # no stop token or stop string before this many generated tokens
    cache_salt: str | None = None       # vLLM's: only requests with the same salt share cached prefixes
    cache_points: tuple[int, ...] = ()  # prompt positions where a prefix cache keeps the model's state (at the
                                        # last block boundary at or before each): where the next prompt diverges
    record_steps: bool = False          # keep the step that accepted each token and a per-step trace

    def __post_init__(self) -> None:
        """The spellings other APIs use, as vLLM's SamplingParams takes them: one stop string for a list of one
        (a bare string was read as one stop string per character), lists for tuples, OpenAI's logit_bias
        mapping, and top_k -1 for off."""
        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if isinstance(self.stop, str):
            put("stop", (self.stop,))
        for name in ("stop", "stop_token_ids", "logit_bias", "cache_points"):
            if isinstance(getattr(self, name), list):
                put(name, tuple(getattr(self, name)))
        if isinstance(self.logit_bias, dict):
            put("logit_bias", tuple(self.logit_bias.items()))
        if isinstance(self.logit_bias, tuple) and any(isinstance(pair, list) for pair in self.logit_bias):
            put("logit_bias", tuple(tuple(pair) if isinstance(pair, list) else pair for pair in self.logit_bias))
        if _is_int(self.top_k) and self.top_k == -1:
            put("top_k", 0)

    def with_(self, **changes: object) -> SamplingParams:
        return replace(self, **changes)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidParameter naming the first bad field. These are the only bounds: the CLI and the
        server pass values through unchecked and report this error."""
        def bad(name: str, rule: str) -> None:
            raise InvalidParameter(name, f"{name} must be {rule}, got {getattr(self, name)!r}")

        def within(name: str, low: float, high: float, open_low: bool = False) -> bool:
            v = getattr(self, name)
            return _is_number(v) and math.isfinite(v) and (low < v if open_low else low <= v) and v <= high

        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", "a positive integer")
        if not within("temperature", 0, 2):
            bad("temperature", "between 0 and 2")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "a non-negative integer (0 or -1 disables it)")
        if not within("top_p", 0, 1, open_low=True):
            bad("top_p", "in (0, 1]")
        if not within("min_p", 0, 1):
            bad("min_p", "between 0 and 1 (0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not within(name, -2, 2):
                bad(name, "between -2 and 2")
        if not within("repetition_penalty", 0, 10, open_low=True):
            bad("repetition_penalty", "in (0, 10]")
        if self.algorithm not in ALGORITHMS:
            bad("algorithm", f"one of {list(ALGORITHMS)}")
        if self.block_size is not None and (not _is_int(self.block_size) or not 1 <= self.block_size <= 1024):
            bad("block_size", "an integer between 1 and 1024")
        if not within("threshold", 0, 1):
            bad("threshold", "between 0 and 1")
        if self.max_accept_per_step is not None and (not _is_int(self.max_accept_per_step) or self.max_accept_per_step < 1):
            bad("max_accept_per_step", "a positive integer or None")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > 1024 or \
                any(not _is_int(t) or not 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"a list of up to 1024 token ids in [0, {vocab_size})")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_BOUND):
            bad("seed", SEED_RULE)
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > 1024 or any(
                not isinstance(pair, tuple) or len(pair) != 2 or not _is_int(pair[0]) or not 0 <= pair[0] < vocab_size
                or not _is_number(pair[1]) or not math.isfinite(pair[1]) or not -100 <= pair[1] <= 100
                for pair in self.logit_bias):
            bad("logit_bias", f"up to 1024 token ids in [0, {vocab_size}) with biases between -100 and 100")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            bad("min_tokens", "an integer between 0 and max_tokens")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > 1024 or lone_surrogate(self.cache_salt)):
            raise InvalidParameter("cache_salt", "cache_salt must be a non-empty string of at most 1024 characters "
                                   "(without lone surrogates), if given")   # (the salt is not echoed: a secret)
        if not isinstance(self.cache_points, tuple) or len(self.cache_points) > 64 or \
                any(not _is_int(p) or p < 0 for p in self.cache_points):
            bad("cache_points", "up to 64 prompt positions (integers >= 0)")
        if self.constraint is not None and self.ignore_eos:
            bad("ignore_eos", "off with a grammar (structured output), which ends the reply when it is complete")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
                bad("logprobs", f"an integer between 0 and {MAX_LOGPROBS} (the alternatives per token)")
            if self.algorithm not in LOGPROB_ALGORITHMS:
                raise InvalidParameter("logprobs", f"logprobs need a decoder whose tokens come from the causal head: "
                                       f"algorithm 'ar' or 'verify' (the same tokens), not {self.algorithm!r}, "
                                       "which commits tokens from the block preview")


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    """A real number a float holds (numpy's too; not a bool, not an int too large for a float)."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        float(v)
    except OverflowError:
        return False
    return True


def check_generation_defaults(generation: GenerationConfig, vocab_size: int, source: str) -> None:
    """A checkpoint's decoding defaults, checked as a request's values are (InvalidParameter naming `source`): a
    bad one would fail every request that leaves it unset, reported as that request's own error."""
    try:
        SamplingParams(**generation.merged()).validate(vocab_size)
    except InvalidParameter as exc:
        raise InvalidParameter(exc.param, f"{source}: {exc} (a decoding default of the checkpoint)") from None


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """logits [M,V] fp32; counts [V] occurrences of each token in the response so far (None where
    `params` has no penalties: nothing reads them).

    repetition (CTRL / transformers): seen tokens' logits divided by the penalty when positive,
    multiplied when negative; presence and frequency (OpenAI): minus p * [seen] minus f * count;
    then logit_bias added (OpenAI). All three count response tokens only, as spec section 5 says (vLLM's
    and transformers' repetition penalty counts the prompt's tokens too: a deliberate difference).
    """
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        penalised = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if params.presence_penalty or params.frequency_penalty:
        logits = logits - params.presence_penalty * (counts > 0).float() - params.frequency_penalty * counts
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], device=logits.device)
        bias = torch.tensor([b for _, b in params.logit_bias], device=logits.device, dtype=logits.dtype)
        logits = logits.index_add(-1, ids, bias.expand(*logits.shape[:-1], -1))
    return logits


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    if min_p > 0:   # p < min_p * p_max, i.e. logit < max logit + log(min_p) (the likeliest token always stays)
        logits = logits.masked_fill(logits < logits.max(-1, keepdim=True).values + math.log(min_p), float("-inf"))
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def token_distribution(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None) -> torch.Tensor:
    """The distribution a token is drawn from at each row of logits [M,V]: penalties, then temperature,
    min-p, top-k and top-p; at temperature 0 a one-hot on the argmax. Returns probabilities [M,V] in fp32."""
    logits = _finite(apply_penalties(logits.float(), counts, params))
    if params.greedy:  # the argmax exactly as pick_tokens takes it
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = _filter_top_k_top_p(_finite(logits / params.temperature), params.top_k, params.top_p, params.min_p)
    return torch.softmax(logits, dim=-1)


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf and +inf -> the largest float, so that a softmax over a row is always defined (a
    row of only -inf stays: the mask token and filtered tokens are -inf, never all of them)."""
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of probs [M,V] -> [M]."""
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)


class NoTokenAllowed(ValueError):
    """A position where no token can be picked: one request's failure (the engine ends it alone, with this
    message), not a fault of the engine. `invalid`: the request's own constraints excluded every token (a
    400 for the server), rather than the model's numbers (NaN logits: a 500)."""

    def __init__(self, message: str, invalid: bool) -> None:
        super().__init__(message)
        self.invalid = invalid


def _nothing_allowed(logits: torch.Tensor) -> None:
    empty = ~torch.isfinite(logits).any(-1)
    if bool(empty.any()):
        if bool(torch.isnan(logits[empty]).any()):
            raise NoTokenAllowed("the model's logits are NaN at this position: its weights (or a broken input) "
                                 "produce no number; `clover check` measures them", invalid=False)
        raise NoTokenAllowed("no token is allowed at this position (a grammar, min_tokens or logit_bias excludes all)",
                             invalid=True)


def pick_tokens(
    logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None, generator: torch.Generator | None,
    confidence: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Penalties, then argmax (temperature 0; the first of equal maxima) or a sample. Returns (tokens [M],
    confidence [M]): the probability of the chosen token under the distribution it was drawn from (None
    at temperature 0 when `confidence` is False: the `ar` and `verify` decoders take the argmax alone,
    which costs one reduction instead of a softmax and a check of every logit). A row in which every
    token is excluded (-inf) is an error, never a uniform draw."""
    if params.greedy:
        scores = apply_penalties(logits.float(), counts, params)
        best, tokens = scores.max(dim=-1)
        if not bool(torch.isfinite(best).all()):   # NaN or +inf in a row, or no token allowed
            _nothing_allowed(logits)
            scores = _finite(scores)
            best, tokens = scores.max(dim=-1)
        if not confidence:
            return tokens, None
        return tokens, torch.softmax(scores, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    _nothing_allowed(logits)
    probs = token_distribution(logits, params, counts)
    tokens = sample_from(probs, generator)
    return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1)


TokenLogprob = tuple[float, list[tuple[int, float]]]   # (the token's log-probability, the top N (id, logprob))


def token_logprobs(logits: torch.Tensor, tokens: list[int] | torch.Tensor, top_n: int) -> list[TokenLogprob]:
    """Log-probabilities of `tokens` [M] under logits [M,V] (the model's distribution, before penalties
    and temperature, as vLLM reports them by default) and the `top_n` most likely tokens at each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.as_tensor(tokens, device=lp.device)
    chosen = lp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    if top_n:
        values, ids = lp.topk(top_n, dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in chosen]
    return list(zip(chosen, tops, strict=True))


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def count_tokens(counts: torch.Tensor | None, tokens: int | list[int] | torch.Tensor, by: float = 1.0) -> None:
    """Add `by` to the response-token counts of `tokens` (a token may repeat); none kept (None) for a
    request without penalties, where an update would be a few wasted tensor ops at every step."""
    if counts is None:
        return
    ids = torch.as_tensor([tokens] if isinstance(tokens, int) else tokens, dtype=torch.long, device=counts.device)
    counts.index_add_(0, ids, torch.full(ids.shape, by, dtype=counts.dtype, device=counts.device))


def verify_drafts(
    logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, params: SamplingParams,
    counts: torch.Tensor | None, generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Check drafts [M] against the causal head's logits [M,V] (row i predicts draft i) the way the
    `ar` decoder would decide each position (spec section 5b). Returns (tokens, kept): the kept drafts
    followed, at the first rejection, by the causal head's own token (so always >= 1 token); kept =
    how many drafts were kept. `counts` [V] (response-token counts for the penalties) is updated.

    Temperature 0: a draft is kept when it is the causal argmax. Temperature > 0: speculative
    sampling -- draft x (drawn from draft_probs [M,V]) is kept with probability min(1, p(x) / q(x)),
    else the token is drawn from max(0, p - q) renormalised -- so the output follows `ar`'s
    distribution exactly.
    """
    m = drafts.shape[0]
    if m == 0:
        return [], 0
    if params.greedy and not has_penalties(params):
        picks = pick_tokens(logits, params, counts, generator, confidence=False)[0]  # [M]
        agree = (picks == drafts).int()
        kept = int(agree.cumprod(0).sum())
        tokens = drafts[:kept].tolist() + ([int(picks[kept])] if kept < m else [])
        count_tokens(counts, tokens)
        return tokens, kept
    tokens: list[int] = []
    for i in range(m):
        p = token_distribution(logits[i : i + 1], params, counts)[0]              # [V]
        x = int(drafts[i])
        if params.greedy:
            keep = int(p.argmax()) == x
        else:
            q = draft_probs[i]
            keep = float(torch.rand((), generator=generator)) * float(q[x]) < float(p[x])
        if keep:
            tokens.append(x)
            count_tokens(counts, x)
            continue
        if params.greedy:
            t = int(p.argmax())
        else:
            residual = (p - draft_probs[i]).clamp(min=0)
            t = int(sample_from((residual if float(residual.sum()) > 0 else p)[None], generator)[0])
        tokens.append(t)
        count_tokens(counts, t)
        return tokens, i
    return tokens, m
