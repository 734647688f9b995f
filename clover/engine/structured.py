"""Structured output: a grammar decides which tokens a sequence may emit next (llguidance).

Why llguidance: it runs on the CPU with no torch or GPU dependency (a Rust extension), computes a
token mask in tens of microseconds, compiles JSON schemas (a broad subset: types, enums, consts,
required / optional properties, arrays with bounds, anyOf, $ref), regular expressions and Lark
grammars, and can check a run of draft tokens and roll back, which `verify` needs. (xgrammar is
GPU-first and pulls torch; outlines-core has no context-free grammars and no rollback.)

How each decoder honours a grammar (the output always matches it; only speed and quality differ):

- `ar`: each step's logits are masked to the tokens the grammar allows next.
- `verify`: drafts are unconstrained; the check masks the causal head's logits at every draft
  position with the grammar state after the drafts before it, so a draft the grammar forbids is
  rejected and replaced by the masked causal token -- exactly `ar` under the same grammar.
- `low_confidence`: constrained slots resolve left to right: each preview accepts the leftmost
  unresolved slot (its masked prediction) and then the following slots while their masked
  predictions stay at or above the threshold, advancing the grammar through each. A block is still
  filled in parallel (several slots per forward) but not out of order, because a grammar reads left
  to right.

When the grammar is complete, only end-of-sequence tokens are allowed, so the reply ends there.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from clover.model.tokenizer import Tokenizer

Kind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class Constraint:
    """What a reply must match: `kind` and its source text (a JSON schema, a regex, a JSON list of
    choices, a Lark grammar; unused for json_object)."""

    kind: Kind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", json.dumps(schema))   # key order kept: it is the order replies write


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package; reported rather than crashed on
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


# JSON is written as json.dumps writes it (the style of every JSON the model saw: tool definitions,
# arguments): ", " and ": ", no other whitespace. Free whitespace lets a weak model pad forever.
# A schema's own "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=256)
def _grammar(constraint: Constraint) -> str:
    ll = _llguidance()
    kind, src = constraint.kind, constraint.source
    try:
        if kind == "json_object":
            return ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if kind == "json_schema":
            return ll.LLMatcher.grammar_from_json_schema(src, defaults=JSON_STYLE)
        if kind == "regex":
            return ll.LLMatcher.grammar_from_regex(src)
        if kind == "lark":
            return ll.LLMatcher.grammar_from_lark(src)
        if kind == "choice":
            return ll.grammar_from("choice", src)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"{kind}: {exc}") from exc
    raise GrammarError(f"unknown constraint kind {kind!r}; choose from {list(KINDS)}")


class GrammarCompiler:
    """Turns constraints into matchers for one tokenizer and vocabulary (the tokenizer is converted once)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int]) -> None:
        ll = _llguidance()
        self.vocab_size = vocab_size
        self._ll = ll
        self._tokenizer = ll.LLTokenizer(tokenizer.tk.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.eos_ids = frozenset(eos_ids)

    def matcher(self, constraint: Constraint) -> Matcher:
        m = self._ll.LLMatcher(self._tokenizer, _grammar(constraint), log_level=0)
        if m.is_error():
            raise GrammarError(f"{constraint.kind}: {m.get_error()}")
        return Matcher(m, self.vocab_size, self.eos_ids)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._m = inner
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self.vocab_size].astype(bool))

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] with every token the grammar forbids next at -inf."""
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def consume(self, tokens: list[int]) -> None:
        """Advance over tokens the grammar allowed; once it is complete only end-of-sequence may follow
        (anything else is an error: the reply would leave the grammar)."""
        for t in tokens:
            if self._m.is_stopped():
                if t not in self.eos_ids:
                    raise GrammarError(f"token {t} after the grammar was complete (only end of sequence may follow)")
                continue
            if not self._m.consume_token(t):
                raise GrammarError(f"the grammar rejected token {t}, which it had allowed: {self._m.get_error()}")

    def masks_along(self, drafts: list[int]) -> list[torch.Tensor]:
        """The allowed sets at each draft position and after the last valid one: mask i is the set after
        drafts[:i], for i = 0 .. (number of leading drafts the grammar accepts). The state is unchanged."""
        valid = self._m.validate_tokens(drafts)
        masks = [self.allowed()]
        for t in drafts[:valid]:
            self._m.consume_token(t)
            masks.append(self.allowed())
        if valid:
            self._m.rollback(valid)
        return masks

    @property
    def finished(self) -> bool:
        """Only end-of-sequence may follow (the grammar is complete and cannot go on)."""
        return self._m.is_stopped()
