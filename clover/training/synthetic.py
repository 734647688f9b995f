"""Synthetic chat and agent conversations, seeded and deterministic, in the OpenAI message shape.

Every task carries the tools it may use (OpenAI definitions), the messages of a correct solution
(with thinking traces, tool calls, tool results) and a checker for the final answer, so the same
generator feeds SFT data and held-out evaluation. The tools really run: a calculator, key-value
notes and a small virtual file system, all in memory.

Families: `arith` (plain answers with thinking), `calc` (multi-step calculator use), `notes`,
`files` (virtual file system), `recall` (an early instruction or fact that must still hold after
many tool results). Seeds decide everything; training, validation and test draw disjoint seeds.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("arith", "calc", "notes", "files", "recall")
# Disjoint seed ranges per split: training never sees a validation or test conversation.
SPLIT_SEEDS = {"train": 0, "val": 10_000_000, "test": 20_000_000}
SPLIT_SPAN = 10_000_000   # a split's seeds lie in [SPLIT_SEEDS[split], + SPLIT_SPAN) (the test split's from 20M on)

WORDS = ("apple river stone cloud maple tiger piano orbit candle harbor lemon violet falcon meadow copper "
         "silver garden rocket winter summer forest island pepper castle bridge planet").split()


def _tool(name: str, description: str, params: dict[str, str], required: list[str] | None = None) -> dict:
    props = {k: {"type": t} for k, t in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required if required is not None else list(params)}}}


CALCULATOR = _tool("calculator", "Evaluate an arithmetic expression with + - * / and parentheses.",
                   {"expression": "string"})
NOTE_SET = _tool("note_set", "Store a value under a key.", {"key": "string", "value": "string"})
NOTE_GET = _tool("note_get", "Read the value stored under a key.", {"key": "string"})
LIST_DIR = _tool("list_dir", "List the entries of a directory.", {"path": "string"})
READ_FILE = _tool("read_file", "Read a text file.", {"path": "string"})
WRITE_FILE = _tool("write_file", "Write a text file.", {"path": "string", "content": "string"})


# -- the tools ------------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """Safe arithmetic: numbers, + - * /, unary minus and parentheses; anything else is an error."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")
    try:   # (a result too large for a float, or its integer too long to write, is an error too)
        value = ev(ast.parse(expression, mode="eval").body)
        return str(int(value)) if float(value).is_integer() else f"{value:.6g}"
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as exc:
        return f"error: {exc}"


@dataclass(frozen=True)
class Alias:
    """A tool under another name: the World tool it runs and its parameters (shown name -> own name)."""

    kind: str
    params: dict[str, str]


@dataclass
class World:
    """The state the tools act on: notes, a virtual file system (path -> text), tools under other
    names (`aliases`) and lookup tools answering from a table (`tables`: tool -> argument -> result)."""

    notes: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, Alias] = field(default_factory=dict)
    tables: dict[str, dict[str, str]] = field(default_factory=dict)
    errors: dict[tuple[str, str], str] = field(default_factory=dict)  # (tool, argument) -> error text

    def call(self, name: str, args: dict[str, Any]) -> str:
        if name in self.tables:
            if len(args) != 1:
                return f"error: {name} takes exactly one argument"
            key = str(next(iter(args.values())))
            if (name, key) in self.errors:
                return self.errors[name, key]
            return self.tables[name].get(key, f"error: no entry for {key!r}")
        if name in self.aliases:
            alias = self.aliases[name]
            unknown = sorted(set(args) - set(alias.params))
            if unknown:
                return f"error: unknown argument {unknown[0]!r}; {name} takes {', '.join(alias.params)}"
            name, args = alias.kind, {alias.params[k]: v for k, v in args.items()}
        try:
            if name == "calculator":
                return calculate(str(args["expression"]))
            if name == "note_set":
                self.notes[str(args["key"])] = str(args["value"])
                return "ok"
            if name == "note_get":
                return self.notes.get(str(args["key"]), "error: no such key")
            if name == "list_dir":
                prefix = str(args["path"]).rstrip("/") + "/"
                names = sorted({p[len(prefix):].split("/")[0] for p in self.files if p.startswith(prefix)})
                return "\n".join(names) if names else "error: no such directory"
            if name == "read_file":
                return self.files.get(str(args["path"]), "error: no such file")
            if name == "write_file":
                self.files[str(args["path"])] = str(args["content"])
                return "ok"
        except KeyError as exc:
            return f"error: missing argument {exc}"
        return f"error: unknown tool {name}"


_NUMBER_START = r"(?<![\w.-])"    # not inside a word, a decimal or after a sign
_ITEM_END = r"(?!\w|[.,]\d)"       # not continued by a word, decimals or thousands
_NUMBER = re.compile(_NUMBER_START + r"-?\d+(?:\.\d+)?" + _ITEM_END)


def _whole(part: str, text: str) -> bool:
    """`part` in `text` not joined to a longer word or number; a list ("3, 5, 9") not continued."""
    before = _NUMBER_START if part[:1].isdigit() or part[:1] == "-" else r"(?<!\w)"
    after = _ITEM_END + (r"(?!, ?\d)" if ", " in part else "")
    return re.search(before + re.escape(part) + after, text) is not None


def holds(text: str, parts: list[str] | tuple[str, ...]) -> bool:
    """Whether an answer states every expected part as a whole item: "31" is not in "2031", "-31",
    "31.5", "31,000" or "310", nor "candle47" in "candle470"; "31.", "(31)" and "31.0" hold it (a
    numeric part also matches a number of the text equal to it)."""
    numbers: list[float] | None = None
    for part in parts:
        if _whole(part, text):
            continue
        try:
            value = float(part)
        except ValueError:
            return False
        if numbers is None:
            numbers = [float(m) for m in _NUMBER.findall(text)]
        if value not in numbers:
            return False
    return True


@dataclass
class Task:
    family: str
    seed: int
    tools: list[dict]
    messages: list[dict]                 # a correct solution, ending with the final assistant answer
    answer: str                          # what the final answer must contain
    check: Callable[[str], bool] = field(repr=False, default=lambda text: False)
    world: World = field(default_factory=World)      # the state after the reference solution
    thinking: bool = True
    initial_files: dict[str, str] = field(default_factory=dict)
    start: int = 0                       # the question the answer is checked against: the messages before it
                                         # (earlier exchanges, tool calls and all) are an agent's history

    def fresh_world(self) -> World:
        """The tools' state as the task starts (for an agent to act on)."""
        return World(files=dict(self.initial_files), aliases=dict(self.world.aliases),
                     tables={k: dict(v) for k, v in self.world.tables.items()}, errors=dict(self.world.errors))

    @property
    def prompt_messages(self) -> list[dict]:
        """What an agent is given: the messages up to the first assistant turn after `start` (the earlier
        exchanges, if any, then the question the check is about)."""
        first = next(i for i, m in enumerate(self.messages) if i >= self.start and m["role"] == "assistant")
        return self.messages[:first]


def _call(name: str, /, **args: Any) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


class _Builder:
    """Builds a solution while running the tools for real, so every tool result is true."""

    def __init__(self, world: World, thinking: bool) -> None:
        self.world, self.thinking = world, thinking
        self.messages: list[dict] = []
        self.initial_files: dict[str, str] | None = None  # the file system before the first action
        # tools shown under other names: own name -> (shown name, own parameter -> shown parameter)
        self.renames: dict[str, tuple[str, dict[str, str]]] = {}
        # where the families' words (values to copy: code words, note values, file names) come from: None is
        # WORDS, as the harness draws them; training data can coin them instead (`agent_data`, coin_values)
        self.lexicon: Callable[[random.Random], str] | None = None

    def word(self, rng: random.Random) -> str:
        return rng.choice(WORDS) if self.lexicon is None else self.lexicon(rng)

    def words(self, rng: random.Random, k: int) -> list[str]:
        """k distinct words."""
        if self.lexicon is None:
            return rng.sample(WORDS, k)
        out: list[str] = []
        while len(out) < k:
            w = self.lexicon(rng)
            if w not in out:
                out.append(w)
        return out

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def system(self, text: str) -> None:
        self.messages.append({"role": "system", "content": text})

    def act(self, thought: str, name: str, said: str = "", /, **args: Any) -> str:
        """Call tool `name` with `args` (the tool's own parameter names, renamed as shown), `said` as the reply's
        content and `thought` as its reasoning when thinking; the result is appended and returned."""
        if self.initial_files is None:
            self.initial_files = dict(self.world.files)
        if name in self.renames:
            name, params = self.renames[name]
            args = {params[k]: v for k, v in args.items()}
        msg = {"role": "assistant", "content": said, "tool_calls": [_call(name, **args)]}
        if self.thinking:
            msg["reasoning_content"] = thought
        self.messages.append(msg)
        result = self.world.call(name, args)
        self.messages.append({"role": "tool", "content": result})
        return result

    def answer(self, thought: str, text: str) -> None:
        msg = {"role": "assistant", "content": text}
        if self.thinking:
            msg["reasoning_content"] = thought
        self.messages.append(msg)


def _arith(rng: random.Random, b: _Builder) -> tuple[str, list[dict]]:
    kind = rng.choice(["add", "mul", "reverse", "count", "sort", "max"])
    if kind in ("add", "mul"):
        x, y = rng.randint(2, 99), rng.randint(2, 99)
        sym, val = ("+", x + y) if kind == "add" else ("*", x * y)
        b.user(rng.choice(["What is {} {} {}?", "Compute {} {} {}.", "{} {} {} = ?"]).format(x, sym, y))
        b.answer(f"{x} {sym} {y} = {val}.", f"{x} {sym} {y} = {val}.")
        return str(val), []
    word = b.word(rng)
    if kind == "reverse":
        b.user(f"Reverse the word '{word}'.")
        b.answer(f"Letters of {word}: {' '.join(word)}. Backwards: {' '.join(word[::-1])}.", word[::-1])
        return word[::-1], []
    if kind == "count":
        letter = rng.choice(sorted(set(word)))
        n = word.count(letter)
        b.user(f"How many times does the letter '{letter}' appear in '{word}'?")
        b.answer(f"Letters of {word}: {' '.join(word)}. '{letter}' appears {n} time(s).", f"{n}")
        return str(n), []
    nums = [rng.randint(1, 99) for _ in range(rng.randint(3, 6))]
    if kind == "sort":
        b.user(f"Sort these numbers in increasing order: {', '.join(map(str, nums))}.")
        out = ", ".join(map(str, sorted(nums)))
        b.answer(f"Smallest first: {out}.", out)
        return out, []
    b.user(f"Which is the largest of {', '.join(map(str, nums))}?")
    b.answer(f"Compare them one by one; the largest is {max(nums)}.", str(max(nums)))
    return str(max(nums)), []


def _calc(rng: random.Random, b: _Builder) -> tuple[str, list[dict]]:
    a, c, d = rng.randint(11, 999), rng.randint(2, 99), rng.randint(2, 999)
    op1, op2 = rng.choice("+-*"), rng.choice("+-")
    b.user(rng.choice(["Use the calculator to find ({} {} {}) {} {}.", "What is ({} {} {}) {} {}? Use the tool."])
           .format(a, op1, c, op2, d))
    first = b.act(f"First compute {a} {op1} {c} with the calculator.", "calculator", expression=f"{a} {op1} {c}")
    final = b.act(f"{a} {op1} {c} = {first}. Now {first} {op2} {d}.", "calculator", expression=f"{first} {op2} {d}")
    b.answer(f"The calculator gave {final}.", f"The result is {final}.")
    return final, [CALCULATOR]


def _notes(rng: random.Random, b: _Builder) -> tuple[str, list[dict]]:
    key = rng.choice(["room", "code", "colour", "city", "pet", "project"])
    value = b.word(rng) + str(rng.randint(1, 99))
    b.user(f"Save the {key} '{value}' in my notes under '{key}', then read it back to confirm.")
    b.act(f"Store {value} under {key}.", "note_set", key=key, value=value)
    got = b.act("Now read it back.", "note_get", key=key)
    b.answer(f"The note reads {got}, as stored.", f"Saved: {key} = {got}.")
    return value, [NOTE_SET, NOTE_GET]


def _files(rng: random.Random, b: _Builder) -> tuple[str, list[dict]]:
    names = b.words(rng, 4)
    secret = rng.choice(names)
    target = rng.choice([n for n in names if n != secret])
    for n in names:
        b.world.files[f"/docs/{n}.txt"] = f"{n} notes: " + ("the key is " + str(rng.randint(100, 999))
                                                            if n == secret else f"nothing about keys, see {target}")
    b.user("One file in /docs mentions a key. Find it and tell me the key.")
    listing = b.act("List /docs first.", "list_dir", path="/docs")
    files = listing.split("\n")
    seen = ""
    for name in files:
        text = b.act(f"Read {name}.", "read_file", path=f"/docs/{name}")
        if "the key is" in text:
            seen = text.split("the key is ")[1]
            break
    b.answer(f"The key is in {secret}.txt: {seen}.", f"The key is {seen} (in /docs/{secret}.txt).")
    return seen, [LIST_DIR, READ_FILE]


def _recall(rng: random.Random, b: _Builder, steps: int | None = None, ledger: bool = False) -> tuple[str, list[dict]]:
    """`ledger`: each call's reply also says, in its content, the number it adds and those still left after it
    ("none" before the answer), so that the next number and the moment to answer can be read off the reply before
    it rather than counted over the whole conversation (training data; the harness's tasks are unchanged)."""
    steps = steps if steps is not None else rng.choice([2, 4, 8])
    rule, check_word = rng.choice([("End every final answer with the word DONE.", "DONE"),
                                   ("Always mention the code word {} in your final answer.", None)])
    code = b.word(rng).upper()
    rule = rule.format(code)
    marker = check_word or code
    b.system(rule)
    nums = [rng.randint(1, 50) for _ in range(steps + 1)]
    b.user(f"Add these numbers one at a time with the calculator: {', '.join(map(str, nums))}.")
    total = str(nums[0])
    for i, x in enumerate(nums[1:], 2):
        said = f"Adding {x}; left after it: {', '.join(map(str, nums[i:])) or 'none'}." if ledger else ""
        total = b.act(f"Add {x} to {total}.", "calculator", said, expression=f"{total} + {x}")
    text = f"The total is {total}. {marker}" if check_word else f"The total is {total} ({marker})."
    b.answer(f"The total is {total}; the system asks me to include {marker}.", text)
    return f"{total}|{marker}", [CALCULATOR]


_FAMILY = {"arith": _arith, "calc": _calc, "notes": _notes, "files": _files, "recall": _recall}


def make_task(family: str, seed: int, thinking: bool | None = None, **options: Any) -> Task:
    """One task of `family` from `seed`; `thinking` None: decided by the seed (half on, half off)."""
    if family not in _FAMILY:
        raise ValueError(f"unknown family {family!r}; choose from {list(FAMILIES)}")
    rng = random.Random(f"{family}:{seed}")
    thinking = rng.random() < 0.5 if thinking is None else thinking
    world = World()
    builder = _Builder(world, thinking)
    answer, tools = _FAMILY[family](rng, builder, **options)
    parts = answer.split("|")
    return Task(family, seed, tools, builder.messages, answer,
                check=lambda text: holds(text, parts), world=world, thinking=thinking,
                initial_files=builder.initial_files if builder.initial_files is not None else dict(world.files))


def tasks(split: str, count: int, families: tuple[str, ...] = FAMILIES) -> list[Task]:
    """`count` tasks of `split` cycling through `families`; seeds from the split's own range."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose from {list(SPLIT_SEEDS)}")
    base = SPLIT_SEEDS[split]
    return [make_task(families[i % len(families)], base + i) for i in range(count)]


def off_by_1000(result: str) -> str:
    """A calculator result made wrong by 1000 (the fault of the `calc_faulty` tasks)."""
    return str(int(float(result)) + 1000) if result.lstrip("-").isdigit() else result + "0"


def make_faulty_calc(seed: int, thinking: bool = False) -> Task:
    """A calc task whose first calculator answer is off by 1000: the reference solution notices by
    recomputing before it goes on (the harness injects the fault into the real tool)."""
    task = make_task("calc", seed, thinking=thinking)
    msgs = [dict(m) for m in task.messages]
    first_call = next(i for i, m in enumerate(msgs) if m.get("tool_calls"))
    expr = json.loads(msgs[first_call]["tool_calls"][0]["function"]["arguments"])["expression"]
    right = calculate(expr)
    wrong = off_by_1000(right)
    msgs[first_call + 1] = {"role": "tool", "content": wrong}
    recheck = {"role": "assistant", "content": f"{expr} cannot be {wrong}; let me recompute.",
               "tool_calls": [_call("calculator", expression=expr)]}
    msgs[first_call + 2:first_call + 2] = [recheck, {"role": "tool", "content": right}]
    return Task("calc_faulty", seed, task.tools, msgs, task.answer, task.check, thinking=thinking,
                initial_files=task.initial_files)


def check_share(name: str, value: float) -> None:
    """A share of the generated data (a probability) in [0, 1], else a ValueError naming it."""
    if not (isinstance(value, (int, float)) and 0 <= value <= 1):
        raise ValueError(f"{name} must be a share between 0 and 1, got {value!r}")
