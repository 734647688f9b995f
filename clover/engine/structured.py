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

A lazy grammar (`Constraint.trigger`, as llama.cpp's lazy grammars for tool calls) leaves the reply
free until it emits the trigger token, and holds what follows it: a chat reply with tools may write
any text, but a `<tool_call>` it opens must name an offered tool and match its schema. Until the
trigger each decoder runs as without a grammar; from the token after it, as above. `low_confidence`
fills a block out of order, so the trigger may be accepted after slots behind it: when the block is
resolved, the grammar reads the slots after the trigger and those it rejects are masked again and
resolved in order (`Pending`, `Matcher.valid_prefix`).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from clover.model.chat import extra_parameters, string_enum, written_raw

if TYPE_CHECKING:
    from clover.model.tokenizer import Tokenizer

log = logging.getLogger("clover.engine")

Kind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
KINDS = ("json_schema", "json_object", "regex", "choice", "lark")


class GrammarError(ValueError):
    """A grammar or schema that cannot be compiled (the message says why)."""


@dataclass(frozen=True)
class Constraint:
    """What a reply must match: `kind` and its source text (a JSON schema, a regex, a JSON list of
    choices, a Lark grammar; unused for json_object). With `trigger` (a token id) the grammar is lazy:
    it holds only what follows the first `trigger` the reply emits after `not_before` (a token id; None:
    from the start), e.g. a tool call after the reasoning."""

    kind: Kind
    source: str = ""
    trigger: int | None = None
    not_before: int | None = None
    origin: str | None = field(default=None, compare=False)   # the request field it came from (for errors)

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Constraint:
        return cls("json_schema", json.dumps(schema))   # key order kept: it is the order replies write


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package; reported rather than crashed on
        raise GrammarError("structured output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


# llguidance's compiler recurses along chains of rules: on a thread's usual 8 MiB stack a Lark grammar of a
# 3,000-rule chain, or a JSON schema of a 5,000-long $ref chain, overflowed it and killed the process (one
# request taking the server down). So grammar sources are bounded (MAX_GRAMMAR_CHARS: at most ~15,000 chained
# Lark rules, ~7,500 $refs), and compiled on a thread of its own with a stack 32x the usual (a 20,000-rule
# chain compiled there; matching a compiled grammar does not recurse along it: 20,000 rules matched on 8 MiB).
# Several such threads, so that one request's large grammar does not hold up another's compile, nor the
# engine's matcher for a request it admits (their stacks are address space, committed only as used).
MAX_GRAMMAR_CHARS = 256 * 1024
_COMPILE_STACK_BYTES = 256 * 2**20
_COMPILE_THREADS = 4
_compile_pool: ThreadPoolExecutor | None = None
_compile_pid = 0            # the process that started the pool (a forked child has no thread behind it)
_compile_lock = threading.Lock()


def _compiled(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on one of the grammar compiler's threads (a 256 MiB stack each); inline where the platform
    cannot size a thread's stack."""
    global _compile_pool, _compile_pid
    with _compile_lock:
        if _compile_pool is None or _compile_pid != os.getpid():
            try:
                old = threading.stack_size(_COMPILE_STACK_BYTES)
            except (ValueError, RuntimeError):   # (not settable here)
                return fn(*args)
            pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="clover-grammar")
            # its threads start now, with that stack: each waits at the barrier, so each submit finds no
            # idle thread and starts one
            started = threading.Barrier(_COMPILE_THREADS + 1, timeout=60)
            try:
                waits = [pool.submit(started.wait) for _ in range(_COMPILE_THREADS)]
                started.wait()
                for w in waits:
                    w.result()
            except (RuntimeError, threading.BrokenBarrierError) as exc:   # e.g. no memory for the stacks
                started.abort()
                pool.shutdown(wait=False)
                raise GrammarError(f"cannot start the grammar compiler's threads: {exc}") from exc
            finally:
                threading.stack_size(old)
            _compile_pool, _compile_pid = pool, os.getpid()
    return _compile_pool.submit(fn, *args).result()


# JSON is written as json.dumps writes it (the style of every JSON the model saw: tool definitions,
# arguments): ", " and ": ", no other whitespace. Free whitespace lets a weak model pad forever.
# A schema's own "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=64)   # (~3 MB each for a 230 KB schema: 256 of them held 800 MB)
def _grammar(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (GrammarError if its source is too long or malformed)."""
    if len(constraint.source) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{constraint.kind}: the grammar is {len(constraint.source):,} characters long; at most "
                           f"{MAX_GRAMMAR_CHARS:,} are compiled")
    return _compiled(_grammar_text, constraint.kind, constraint.source)


def _grammar_text(kind: str, src: str) -> str:
    ll = _llguidance()
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


@functools.lru_cache(maxsize=256)
def grammar_error(constraint: Constraint) -> str | None:
    """Why the constraint's grammar does not compile (None: it does), without a tokenizer: for a caller
    that would rather go without a grammar than refuse the request."""
    try:
        is_error, messages = _compiled(_llguidance().LLMatcher.validate_grammar_with_warnings, _grammar(constraint))
    except GrammarError as exc:
        return str(exc)
    return "; ".join(messages) if is_error else None


def _headline(matcher: Any) -> str:
    """The first line of an llguidance matcher's error (the rest dumps its state and grammar)."""
    return (matcher.get_error().strip().splitlines() or ["?"])[0]


# What the kept matchers may hold, in characters of their grammars: a matcher takes ~60 bytes per character of
# its grammar (13 MB for a 230 KB JSON schema of 3,500 patterned properties, measured on 2026-12-07), so ~250 MB.
KEEP_GRAMMAR_CHARS = 4_000_000


class GrammarCompiler:
    """Turns constraints into matchers for one tokenizer and vocabulary (the tokenizer is converted once).
    The matchers of the last `keep` constraints (whose grammars hold at most `keep_chars` characters together)
    are kept at their start and copied for each request: an agent sends the same tools every turn, and building
    a matcher takes milliseconds per tool. (Kept by count alone, 64 large schemas held 830 MB.)"""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: list[int], keep: int = 64,
                 keep_chars: int = KEEP_GRAMMAR_CHARS) -> None:
        ll = _llguidance()
        self.vocab_size = vocab_size
        self._ll = ll
        self._tokenizer = ll.LLTokenizer(tokenizer.tk.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
        self.eos_ids = frozenset(eos_ids)
        self._keep, self._keep_chars = keep, keep_chars
        self._built: OrderedDict[Constraint, tuple[Any, int]] = OrderedDict()   # matcher, its grammar's length
        self._building: dict[Constraint, Future] = {}   # constraints a thread is building now
        self._lock = threading.Lock()

    def build(self, constraint: Constraint) -> Any:
        """The constraint's matcher at its start, kept (GrammarError if it does not compile). Any thread may
        call it: the server builds a request's before the engine thread admits it (`Engine.prepare_grammar`),
        so that a large grammar (0.14 s for 156 KB of JSON schema) does not stall the batch; llguidance lets
        the other threads run while it compiles."""
        with self._lock:
            kept = self._built.get(constraint)
            if kept is not None:
                self._built.move_to_end(constraint)
                return kept[0]
            building = self._building.get(constraint)
            mine = building is None   # this thread builds it; others asking meanwhile wait for it (n > 1, agents
            if mine:                  # sending the same tools at once)
                building = self._building[constraint] = Future()
        if not mine:
            return building.result()   # (its GrammarError too)
        try:
            grammar = _grammar(constraint)
            m = _compiled(lambda g: self._ll.LLMatcher(self._tokenizer, g, log_level=0), grammar)
            if m.is_error():
                raise GrammarError(f"{constraint.kind}: {m.get_error()}")
            m.compute_bitmask()   # a grammar that matches no text fails only at its first mask (it read as
            if m.is_error():      # complete: a 200 with an empty reply that does not match it)
                raise GrammarError(f"{constraint.kind}: the grammar matches no text ({_headline(m)})")
        except BaseException as exc:
            with self._lock:
                del self._building[constraint]
            building.set_exception(exc)
            raise
        with self._lock:
            self._built[constraint] = (m, len(grammar))
            held = sum(n for _, n in self._built.values())
            while len(self._built) > 1 and (len(self._built) > self._keep or held > self._keep_chars):
                held -= self._built.popitem(last=False)[1][1]   # the oldest (the one just built stays)
            del self._building[constraint]
        building.set_result(m)
        return m

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(self.build(constraint).deep_copy(), self.vocab_size, self.eos_ids)

    def start(self, constraint: Constraint) -> GrammarState:
        """A sequence's grammar state: (a matcher, None), or for a lazy grammar (None, its `Pending`),
        compiled now either way so that a bad grammar fails at admission."""
        m = self.matcher(constraint)
        if constraint.trigger is None:
            return m, None
        return None, Pending(m, constraint.trigger, constraint.not_before)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self._m = inner
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if self._m.is_error():   # (no text can go on from here: what was written cannot be completed)
            raise GrammarError(f"the grammar cannot go on ({_headline(self._m)})")
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

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar accepts (end-of-sequence tokens once it is complete). The
        state is unchanged."""
        n = self._m.validate_tokens(tokens)
        if n == len(tokens) or not n and not self._m.is_stopped():
            return n
        self._m.consume_tokens(tokens[:n])
        done = self._m.is_stopped()
        self._m.rollback(n)
        return n + (len(list(itertools.takewhile(self.eos_ids.__contains__, tokens[n:]))) if done else 0)

    def masks_along(self, drafts: list[int]) -> tuple[list[torch.Tensor], list[bool]]:
        """The allowed sets at each draft position and after the last valid one: mask i is the set after
        drafts[:i], for i = 0 .. (number of leading drafts the grammar accepts), and for every i where the
        grammar is complete there; with each, whether the grammar is complete there (`finished`: the reply
        may end whatever min_tokens says, as in `ar`). The state is unchanged."""
        valid = self._m.validate_tokens(drafts)
        masks, complete = [self.allowed()], [self.finished]
        consumed = 0
        for t in drafts[:valid]:
            if not self._m.is_stopped():   # (an end of sequence after the grammar completes leaves no step
                self._m.consume_token(t)   # to roll back: count only what was consumed)
                consumed += 1
            masks.append(self.allowed())
            complete.append(self.finished)
        # complete after the valid drafts: only the end may follow, so every later row gets that set (the drafts
        # there are more ends, or one its row rejects); those rows were left unmasked, and a check that kept a
        # draft end took a token after it, which the grammar then refused (session 52)
        if self.finished:
            rest = len(drafts) - valid
            masks += [masks[-1]] * rest
            complete += [True] * rest
        if consumed:
            self._m.rollback(consumed)
        return masks, complete

    @property
    def finished(self) -> bool:
        """Only end-of-sequence may follow (the grammar is complete and cannot go on)."""
        return self._m.is_stopped()

    def copy(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self.vocab_size, self.eos_ids)


class Pending:
    """A lazy grammar not yet started: it starts after the first `trigger` token once `not_before` has
    been emitted (at once without it). `fresh` is the grammar's matcher at its start, copied for each use."""

    def __init__(self, fresh: Matcher, trigger: int, not_before: int | None) -> None:
        self.fresh = fresh
        self.trigger = trigger
        self.not_before = not_before
        self.armed = not_before is None

    def find(self, tokens: list[int]) -> int | None:
        """The index of the token in `tokens` (emitted next) that starts the grammar, or None. The state
        is unchanged."""
        armed = self.armed
        for i, t in enumerate(tokens):
            if armed and t == self.trigger:
                return i
            armed = armed or t == self.not_before
        return None

    def read(self, tokens: list[int]) -> int | None:
        """Take `tokens` as emitted: `find`'s index, after which the caller starts the grammar."""
        i = self.find(tokens)
        self.armed = self.armed or self.not_before in tokens[:i]
        return i

    def masks_along(self, drafts: list[int]) -> tuple[list[torch.Tensor | None], list[bool]]:
        """`Matcher.masks_along` for a grammar that may start inside the drafts: None (anything goes, not
        complete) up to and including the trigger, then the grammar's masks; ([], []) when no draft starts it."""
        i = self.find(drafts)
        if i is None:
            return [], []
        masks, complete = self.fresh.copy().masks_along(drafts[i + 1:])
        return [None] * (i + 1) + masks, [False] * (i + 1) + complete


# -- tool calls in the chat format (spec section 6) ----------------------------------------------------

NL = "\n"


def _lit(text: str) -> str:
    return json.dumps(text)   # a Lark string literal, written as a JSON string


# A number parameter without bounds: llguidance's JSON numbers take any exponent, and 1e999 is no double (Python reads
# it as inf, which strict JSON cannot write back: `chat.json_value` refuses it). These are finite: below 1e199.
FINITE_NUMBER = r"/-?(0|[1-9][0-9]{0,99})(\.[0-9]{1,99})?([eE](\+?[0-9]{1,2}|-[0-9]{1,3}))?/"
NUMBER_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}


@functools.lru_cache(maxsize=256)   # (each request with tools asks again, of the same few schemas)
def _json_problem(source: str) -> str | None:
    return grammar_error(Constraint("json_schema", source))


def _value_rule(tag: str, schema: dict, defs: dict, rules: list[str], loose: str | None = None) -> str:
    """The grammar of one parameter's value and the "\\n</parameter>\\n" after it (its rules added to `rules`): a
    string enum or const, or any text (of at most maxLength characters) where the value is written raw, a finite
    number, else JSON matching the schema. Of a raw string, minLength, pattern and format are not held: the value
    ends at the first "\\n</parameter>\\n", and a lexeme that held those could run past it (the parser would read
    another value than the grammar let through). With `loose` (the parameter's name, for the log), a JSON schema
    outside llguidance's subset leaves this value free text rather than failing the whole grammar."""
    tail = _lit(NL + "</parameter>" + NL)

    def text(bound: str) -> str:   # shortest match: the value ends at the first "\n</parameter>\n", which it takes too
        rules.append(f"string_{tag}[lazy]: /(?s:.{bound})\\n<\\/parameter>\\n/")
        return f"string_{tag}"

    if string_enum(schema):   # written raw, as strings are
        values = [schema["const"]] if isinstance(schema.get("const"), str) else schema["enum"]
        return "(" + " | ".join(map(_lit, values)) + f") {tail}"
    if written_raw(schema):
        most = schema.get("maxLength")
        return text(f"{{0,{most}}}" if type(most) is int and most >= 0 else "*")
    if schema.get("type") == "number" and not (set(schema) & NUMBER_BOUNDS) and "enum" not in schema \
            and "const" not in schema:
        rules.append(f"number_{tag}: {FINITE_NUMBER}")
        return f"number_{tag} {tail}"
    own = schema.get("x-guidance")
    style = {**JSON_STYLE, "coerce_one_of": True, **(own if isinstance(own, dict) else {})}
    source = json.dumps({**defs, **schema, 'x-guidance': style})
    problem = _json_problem(source) if loose else None
    if problem is not None:
        log.warning("tool call parameter %s not held to its schema: %s", loose, problem)
        return text("*")
    rules.append(f"value_{tag}: %json {source}")
    return f"value_{tag} {tail}"


def tool_call_grammar(tools: list[dict], named: str | None, parallel: bool, open_id: int, close_id: int,
                      opened: bool = True, loose: bool = False) -> str:
    """A Lark grammar (llguidance) for a tool call after its start: the parameters of `named` (whose
    `<function=...>` line is pre-filled), or one of the tools (after `<tool_call>` and a new line when
    `opened`, else after the `<tool_call>` token alone: a lazy grammar that starts where the reply opens a
    call), then `</tool_call>`; with `parallel`, more calls may follow. Parameters: in schema order (as the
    tool list shows them), each optional one or not; a string value is any text up to the first new line and
    `</parameter>` (at most maxLength characters; a lazy lexeme, so code with '<' passes) or one of its
    enum, written raw; so is a value whose type list holds "string" (["string", "null"]) or that has no
    schema, as the template writes such values and the parser reads them (`chat.written_raw`); other values are JSON
    matching their schema (the tool's `$defs` in reach, oneOf read as anyOf). With `loose`, a value whose schema is
    outside llguidance's subset goes free (the other values and tools stay held); else the grammar fails."""
    rules, names = [], []
    for k, tool in enumerate(tools):
        fn = tool["function"]
        schema = fn.get("parameters") or {}
        props = schema.get("properties") or {}
        defs = {key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)}
        required = [p for p in schema.get("required") or [] if p in props]
        undeclared = [p for p in schema.get("required") or [] if p not in props]
        if undeclared and extra_parameters(schema) is None:
            log.warning("tool %s requires parameters it does not declare (not held): %s", fn["name"], undeclared)
        parts = []
        for i, name in enumerate(props):
            value_schema = props[name] if isinstance(props[name], dict) else {}
            value = _value_rule(f"{k}_{i}", value_schema, defs, rules, f"{fn['name']}.{name}" if loose else None)
            rules.append(f"param_{k}_{i}: {_lit(f'<parameter={name}>' + NL)} {value}")
            parts.append(f"param_{k}_{i}" + ("" if name in required else "?"))
        more = extra_parameters(schema)
        if more is not None:   # (a tool that names none of its parameters: any names, values of that schema)
            value = _value_rule(f"{k}_any", more, defs, rules, f"{fn['name']}.*" if loose else None)
            rules.append(f"param_{k}_any: /<parameter=[^>\\n]*[^>\\s][^>\\n]*>\\n/ {value}")
            parts.append(f"param_{k}_any*")
        rules.append(f"params_{k}: {' '.join(parts) or _lit('')}")
        rules.append(f"call_{k}: {_lit('<function=' + fn['name'] + '>' + NL)} params_{k}")
        names.append(fn["name"])
    close = f"{_lit('</function>' + NL)} <[{close_id}]>"
    any_call = "(" + " | ".join(f"call_{k}" for k in range(len(tools))) + ")"
    first = f"params_{names.index(named)}" if named is not None else any_call
    if not opened:
        first = f"{_lit(NL)} {first}"
    more = f" ({_lit(NL)} <[{open_id}]> {_lit(NL)} {any_call} {close})*" if parallel else ""
    return "\n".join([f"start: {first} {close}{more}", *rules])


def auto_tool_calls(tools: list[dict], tokenizer: Tokenizer, thinking: bool, parallel: bool = True) -> Constraint | None:
    """The lazy grammar of a reply that may call `tools` (tool_choice "auto"): free until it opens a call
    (after its reasoning when `thinking`), then `tool_call_grammar` for that call and any after it; a value whose
    schema llguidance cannot hold goes free there (with a warning). None (with a warning) where the grammar still
    does not compile: the calls then go free rather than the request being refused."""
    specials = tokenizer.special_ids
    held = Constraint("lark", tool_call_grammar(tools, None, parallel, specials["<tool_call>"],
                                                specials["</tool_call>"], opened=False, loose=True),
                      trigger=specials["<tool_call>"], not_before=specials["</think>"] if thinking else None)
    problem = grammar_error(held)
    if problem is not None:
        log.warning("tool calls not held to their schemas: %s", problem)
        return None
    return held


GrammarState = tuple[Matcher | None, Pending | None]   # a sequence's: (a matcher, None), or (None, a lazy one)
