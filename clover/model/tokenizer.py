"""Tokenizer: a `tokenizers` byte-level BPE with Clover's special tokens and the chat template.

A checkpoint directory holds `tokenizer.json` and `tokenizer_config.json` (special tokens and the
Jinja `chat_template`), as transformers writes them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import secrets
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from clover.model.chat import (
    DEFAULT_CHAT_TEMPLATE,
    ChatFormatError,
    lone_surrogate,
    parse_tool_arguments,
    render_chat,
    strings_in,
)
from clover.model.files import MAX_SETTINGS_BYTES, read_json, read_text

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END, "<think>", "</think>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", MASK_TOKEN)
SMALLEST_VOCAB = 256 + len(SPECIAL_TOKENS)   # a trained tokenizer's least: every byte, then the special tokens


# sha256 of the template checkpoints carried before it became chat_template.jinja. It rendered with
# trim_blocks and lstrip_blocks off; the file template renders the same text with them on (as
# transformers renders), over every conversation of tests/test_chat.py's table.
_LEGACY_TEMPLATE_SHA256 = "b87c531ede4c1a496b2ae9bf79ffa8b840c822acedc6a1df58e1cf25ae811d6b"
# Clover's earlier templates, read as today's (`read_chat_template`): the legacy one, and the file template before
# it rendered OpenAI content parts itself (2026-12-07; the same text for string contents).
_EARLIER_TEMPLATES_SHA256 = {_LEGACY_TEMPLATE_SHA256,
                             "4fca656e1548857ac2257eb22d672604ac7dc1a6657c88bcdfe2c3078f6f3253"}


def read_chat_template(directory: str | os.PathLike) -> str:
    """A checkpoint's chat template, as transformers finds it: `chat_template.jinja`, else the
    `chat_template` of tokenizer_config.json, else Clover's default (also for Clover's earlier templates)."""
    directory = Path(directory)
    cfg = directory / "tokenizer_config.json"
    try:
        if (directory / "chat_template.jinja").is_file():
            template = read_text(directory / "chat_template.jinja", MAX_SETTINGS_BYTES)
            return DEFAULT_CHAT_TEMPLATE if _sha256(template) in _EARLIER_TEMPLATES_SHA256 else template
        data = read_json(cfg) if cfg.is_file() else {}
    except ValueError as exc:   # (not UTF-8, not JSON, too large)
        raise TokenizerError(str(exc)) from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{cfg} must hold a JSON object, got {type(data).__name__}")
    template = data.get("chat_template")
    if isinstance(template, list):   # transformers' named templates: the one named "default" is the chat's
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get("default"), str):
            raise TokenizerError(f"{cfg}: chat_template is a list of named templates, none of them named 'default'")
        template = named["default"]
    if not isinstance(template, str) or _sha256(template) in _EARLIER_TEMPLATES_SHA256:
        return DEFAULT_CHAT_TEMPLATE
    return template


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """A JSON-like value with `fn` applied to every string in it (dict keys included), at any depth."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's, which `tokenizers`' ByteLevel uses), inverted: each byte is written
    as one printable character, itself where it is printable Latin-1, else 256 + n in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


class TokenizerError(ValueError):
    """A tokenizer directory is missing or inconsistent."""


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str = DEFAULT_CHAT_TEMPLATE) -> None:
        self.tk = tokenizer
        self.chat_template = chat_template
        self._plain: HFTokenizer | None = None  # a copy that encodes special-token text as plain text
        missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise TokenizerError(f"tokenizer lacks the special token(s) {missing}")
        self.special_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
        # a special token's text (longest first, so that none is matched by a shorter one inside it)
        self._special_text = re.compile("|".join(map(re.escape, sorted(self.special_ids, key=len, reverse=True))))

    # -- ids --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size()

    @property
    def mask_token_id(self) -> int:
        return self.special_ids[MASK_TOKEN]

    @property
    def eos_token_ids(self) -> list[int]:
        """Ends of generation: end of text and end of turn."""
        return [self.special_ids[EOS_TOKEN], self.special_ids[IM_END]]

    def reply_start(self, ids: list[int]) -> tuple[int, ...]:
        """Where a chat prompt's last turn begins, (its last <|im_start|>,) or () without one: the next turn's prompt
        holds everything before it unchanged and renders the reply after it otherwise (without its reasoning or an
        empty think block), so a prefix cache keeps the model's state there (`SamplingParams.cache_points`)."""
        start = self.special_ids[IM_START]
        return next(((i,) for i in range(len(ids) - 1, -1, -1) if ids[i] == start), ())

    def encode(self, text: str) -> list[int]:
        """Text -> ids; special tokens written in the text are recognised."""
        try:
            return self.tk.encode(text, add_special_tokens=False).ids
        except TypeError as exc:   # the Rust side's message for a lone surrogate: say what it is
            if isinstance(text, str) and lone_surrogate(text):
                raise TokenizerError("the text holds a lone UTF-16 surrogate, which is not a character") from exc
            raise

    def space_twins(self) -> list[tuple[int, int]]:
        """(spaced, bare) id pairs of the tokens spelt the same but for a leading space (` Oth` and `Oth`): a
        byte-level tokenizer glues a space to the word after it, so a word writes with one of them after a
        space and with the other after a newline or a quote. Punctuation pairs count too (` (` and `(`: 64 of
        clover-tiny's 1,466). Tokens that are not whole characters are skipped."""
        pairs = []
        specials = set(self.special_ids.values())
        for i in range(self.vocab_size):
            piece = self.tk.id_to_token(i)    # the vocabulary's spelling (byte-level: the space is one character)
            text = self.decode([i]) if piece and i not in specials else ""
            if len(text) < 2 or text[0] != " " or text[1].isspace() or "\ufffd" in text:
                continue
            bare = self.tk.token_to_id(piece[1:])
            if bare is not None and self.decode([bare]) == text[1:]:
                pairs.append((i, bare))
        return pairs

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: part of a character for some (decoded alone, those show as U+FFFD;
        OpenAI's logprobs carry `bytes` so that a client can join them). A special token's are its text's; an
        id the tokenizer lacks (a model's vocabulary padded past it) has none, as it decodes to ""."""
        piece = self.tk.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids.values():
            return piece.encode()
        table = _byte_of_char()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.decode([token_id]).encode()   # (not a byte-level piece: its text)

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
        enable_thinking: bool = True, **extra: Any,
    ) -> str:
        """The prompt text of a conversation. Tool-call arguments may be objects or JSON strings (the OpenAI
        shape, parsed first): either way the calls render in the trained format."""
        return render_chat(self.chat_template, parse_tool_arguments(messages), tools, add_generation_prompt,
                           enable_thinking, **extra)

    def encode_chat(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
        enable_thinking: bool = True, suffix: str = "", **extra: Any,
    ) -> list[int]:
        """Ids of the rendered conversation (+ `suffix`, trusted template text) in which special tokens come
        only from the template: a special token's text anywhere in what the caller gives (a message's content
        or reasoning, a tool call's name, keys and values at any depth, the tools' names, descriptions and
        schemas) is encoded as plain text, so no such text can close a turn, open a system turn or insert a
        mask. Conversations without such text encode exactly as `encode(apply_chat_template(...))`."""
        messages = parse_tool_arguments(messages)
        if not any(self._special_text.search(s) for s in strings_in((messages, tools, list(extra.values())))):
            return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, enable_thinking,
                                                        **extra) + suffix)
        # render with each special token's text in a given string replaced by a marker, then encode the text
        # between markers as usual and each marked one as plain characters
        nonce = secrets.token_hex(8)   # no text can hold this marker by chance
        marked: list[str] = []

        def mark(match: re.Match) -> str:
            marked.append(match.group())
            return f"<{nonce}:{len(marked) - 1}>"

        def marked_in(value: Any) -> Any:
            return _map_strings(value, lambda s: self._special_text.sub(mark, s))

        try:
            rendered = self.apply_chat_template(marked_in(messages), marked_in(tools), add_generation_prompt,
                                                enable_thinking, **{k: marked_in(v) for k, v in extra.items()}) + suffix
        except ChatFormatError:   # (said again of the texts as given: the error names them, not their markers)
            self.apply_chat_template(messages, tools, add_generation_prompt, enable_thinking, **extra)
            raise
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self.tk.to_str())
            self._plain.encode_special_tokens = True
        ids: list[int] = []
        for i, piece in enumerate(re.split(f"<{nonce}:(\\d+)>", rendered)):
            if i % 2:  # a special token's text that the caller gave
                ids += self._plain.encode(marked[int(piece)], add_special_tokens=False).ids
            elif piece:
                ids += self.encode(piece)
        return ids

    # -- files ------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, directory: str | os.PathLike) -> Tokenizer:
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {directory}")
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise TokenizerError(f"{path} could not be read: {exc}") from exc
        try:
            return cls(tk, read_chat_template(directory))
        except TokenizerError as exc:   # (a message that names the file)
            raise TokenizerError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from None

    def encodes_like(self, other: Tokenizer) -> bool:
        """Whether `other` turns text into the same ids: the same normaliser, pre-tokenizer, vocabulary and
        merges, and special tokens (the chat template aside)."""
        mine, theirs = json.loads(self.tk.to_str()), json.loads(other.tk.to_str())
        return all(mine.get(k) == theirs.get(k) for k in ("normalizer", "pre_tokenizer", "model", "added_tokens"))

    def check_model(self, model_dir: str | os.PathLike, vocab_size: int, source: str) -> None:
        """Refuse a checkpoint (in `model_dir`, `vocab_size` rows) for ids made by this tokenizer (from `source`)
        where they would mean other tokens: its own tokenizer encodes differently, or, with none beside the
        weights, its vocabulary is too small for these ids."""
        if (Path(model_dir) / "tokenizer.json").is_file():
            if not Tokenizer.load(model_dir).encodes_like(self):
                raise TokenizerError(f"{model_dir} was trained with another tokenizer than {source}'s: its ids would "
                                     f"read as other tokens (build the data with `clover data build --tokenizer "
                                     f"{model_dir}`, or start from a checkpoint trained on this data)")
        elif self.vocab_size > vocab_size:
            raise TokenizerError(f"{source}'s tokenizer has {self.vocab_size} tokens, the model in {model_dir} only "
                                 f"{vocab_size}")

    def files(self) -> dict[str, str]:
        """The files that describe this tokenizer, for writing into a checkpoint directory."""
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": IM_END, "pad_token": EOS_TOKEN,
            "mask_token": MASK_TOKEN, "additional_special_tokens": list(SPECIAL_TOKENS),
            "chat_template": self.chat_template, "model_max_length": 131072,
        }
        return {"tokenizer.json": self.tk.to_str(pretty=False), "tokenizer_config.json": json.dumps(config, indent=2),
                "chat_template.jinja": self.chat_template}

    def save(self, directory: str | os.PathLike) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for name, text in self.files().items():
            (Path(directory) / name).write_text(text)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2,
              isolate_spaces: bool = False) -> Tokenizer:
        """Byte-level BPE trained on `texts`; the special tokens take the first ids. Every digit is a
        token of its own (as in Qwen's and Llama's tokenizers): a number is then spelt the same way
        wherever it stands, so the model copies and computes it digit by digit. With GPT-2's number
        chunks, `897` became `89`+`7` and ` 947` became ` 9`+`47`, and clover-tiny (2026-11-30) predicted
        only 7% of the number tokens of its validation agent replies that copy a number from the
        context, against 95% of the other tokens copied from it.

        `isolate_spaces`: every run of spaces is a pre-token of its own, so that a word is spelt the same
        after a space as after a newline or a bracket (GPT-2's pre-tokenizer, the default, glues the space
        to the word: ` Nim`+`ventar` in prose, `Nim`+`ventar` on a line of a tool result or a call's
        argument). Words then cost a token more in prose: on clover-tiny's data 1.30x the tokens of code,
        1.47x of English and 1.20x of chat (docs/measurements.md, session 35)."""
        if not isinstance(vocab_size, int) or not SMALLEST_VOCAB <= vocab_size <= 1 << 20:
            raise TokenizerError(f"vocab_size must be an integer in [{SMALLEST_VOCAB}, {1 << 20}] (every byte and the "
                                 f"special tokens take {SMALLEST_VOCAB}), got {vocab_size!r}")
        tk = HFTokenizer(models.BPE())
        spaces = [pre_tokenizers.Split(Regex(" +"), behavior="isolated")] if isolate_spaces else []
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), *spaces,
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tk.train_from_iterator(texts, trainer=trainer)
        return cls(tk)


def stdlib_sources() -> Iterator[tuple[str, str]]:
    """(relative path, text) of the Python standard library's sources, tests excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in ("test", "tests", "idle_test", "site-packages") for p in rel.parts):
            continue
        try:
            yield str(rel), path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def stdlib_texts(max_bytes: int = 2_000_000) -> Iterator[str]:
    """Standard-library sources up to max_bytes: text that is on every machine, for tokenizers of
    models built without a corpus (`clover init`)."""
    total = 0
    for _, text in stdlib_sources():
        total += len(text)
        if total > max_bytes:
            return
        yield text
