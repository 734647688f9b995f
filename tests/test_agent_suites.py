"""The suites and the sandbox: every task is solvable by its reference and not solved untouched; hidden
tests decide the coding tasks; all 164 HumanEval references pass and trivial answers fail; model-written
code is confined (paths, commands, time, memory, output size)."""

import json
import time
from pathlib import Path

import pytest

from clover.evaluation import suites as S
from clover.evaluation.sandbox import Limits, run_command, run_python
from clover.training import synthetic


def _replay(env, turns):
    """Run the tool calls of the reference turns; return the tool results."""
    out = []
    for turn in turns:
        for c in turn.get("tool_calls") or []:
            out.append(env.call(c["function"]["name"], json.loads(c["function"]["arguments"])))
    return out


@pytest.mark.parametrize("ht", S.suite_tasks("coding", 8), ids=lambda t: t.id)
def test_coding_reference_passes_the_hidden_tests_and_doing_nothing_fails(ht):
    env = ht.open()
    try:
        assert not env.check(ht.reference[-1]["content"])     # the task is not already solved
        visible = env.call("run_tests", {})
        if "fix_bug" in ht.id or "read_failure" in ht.id:
            assert visible.startswith("exit code 1") and "FAIL" in visible  # a failure to read
        results = _replay(env, ht.reference)
        assert env.check(ht.reference[-1]["content"])
        if "recover" in ht.id or "navigate" in ht.id:
            assert not env.check("Done.")  # the answer must also say what was found
        if "fix_bug" in ht.id or "read_failure" in ht.id:
            assert results[-1].startswith("exit code 0")
        if "recover" in ht.id:
            assert results[0].startswith("exit code 2") and "No such file" in results[0]  # the command to recover from
    finally:
        env.close()
    assert not env.root.exists()


def test_coding_tasks_differ_by_seed_and_prompts_are_unique():
    tasks = S.suite_tasks("coding", 16)
    assert len({json.dumps(t.prompt) for t in tasks}) == 16
    assert {t.id.split("-")[1] for t in tasks} == set(S.CODING_FAMILIES)


def test_a_wrong_fix_fails_the_hidden_tests():
    ht = next(t for t in S.suite_tasks("coding", 8) if "fix_bug" in t.id)
    env = ht.open()
    try:
        path = json.loads(ht.reference[1]["tool_calls"][0]["function"]["arguments"])["path"]
        src = env.call("read_file", {"path": path})
        body = src.splitlines()[-1]
        assert env.call("edit_file", {"path": path, "old": body, "new": "    return None"}) == "ok"
        assert not env.check("done")
        # editing the visible tests into passing does not help: hidden tests decide
        test = next(p for p in env.call("list_files", {"path": "tests"}).splitlines())
        assert env.call("write_file", {"path": test, "content": "import unittest\n"}) == "ok"
        assert "FAIL" not in env.call("run_tests", {})  # the visible tests no longer fail...
        assert not env.check("done")                     # ...but the hidden ones still do
    finally:
        env.close()


def test_hidden_tests_cannot_be_faked_by_an_early_exit_or_a_shadowing_module():
    ht = next(t for t in S.suite_tasks("coding", 8) if "fix_bug" in t.id)
    env = ht.open()
    try:
        pkg = ht.prompt[1]["content"].split("`")[1]
        env.call("write_file", {"path": f"{pkg}/__init__.py", "content": "import os\nos._exit(0)\n"})
        assert not env.check("done")
        env.call("write_file", {"path": f"{pkg}/__init__.py", "content": ""})
        env.call("write_file", {"path": "unittest.py", "content": "import sys\nsys.exit(0)\n"})
        assert not env.check("done")   # the bug is still there, and the fake unittest is not imported
        _replay(env, ht.reference)
        assert env.check("done")       # the real fix passes with the stray file present
    finally:
        env.close()


@pytest.mark.parametrize("fake", [
    # an object equal to everything, and a str subclass that is: unittest's assertEqual accepted both
    "class _All:\n    def __eq__(self, other):\n        return True\n\n\ndef {fn}(*args):\n    return _All()\n",
    "class _S(str):\n    def __eq__(self, other):\n        return True\n\n\ndef {fn}(*args):\n    return _S('x')\n",
    # patching unittest so that every assertion passes
    "import unittest\nunittest.TestCase.assertEqual = lambda *a, **k: None\n\n\ndef {fn}(*args):\n    return None\n",
    # writing the judge's values file itself (its path is the program's argument) and exiting
    "import os, sys\nopen(sys.argv[1], 'w').write('\\n'.join(['0'] * 5))\nos._exit(0)\n",
])
def test_hidden_tests_judge_values_out_of_process_so_fakes_fail(fake):
    """Found by a hostile pass (session 54): the hidden tests ran in the interpreter of the code under test, so
    a patched unittest, an early exit after it or a return value equal to everything passed them. The values
    now come back as plain data and are compared here."""
    ht = next(t for t in S.suite_tasks("coding", 8) if "fix_bug" in t.id)
    env = ht.open()
    try:
        path = json.loads(ht.reference[1]["tool_calls"][0]["function"]["arguments"])["path"]
        fn = env.call("read_file", {"path": path}).split("(")[0].removeprefix("def ")
        assert env.call("write_file", {"path": path, "content": fake.replace("{fn}", fn)}) == "ok"
        assert not env.check("done")
        _replay(env, ht.reference[:1])
        assert env.call("write_file", {"path": path, "content": env.repo.files[path]}) == "ok"
        _replay(env, ht.reference)
        assert env.check("done")       # the real fix passes
    finally:
        env.close()


def test_coding_tools_are_confined_to_the_repository():
    env = S.suite_tasks("coding", 1)[0].open()
    try:
        assert env.call("read_file", {"path": "../../etc/passwd"}).startswith("error:") and "outside" in \
            env.call("read_file", {"path": "/etc/passwd"})
        assert "outside" in env.call("write_file", {"path": "../escape.txt", "content": "x"})
        assert not (env.root.parent / "escape.txt").exists()
        assert "not allowed" in env.call("run", {"command": "rm -rf /"})
        assert "not allowed" in env.call("run", {"command": "bash -c 'echo hi'"})
        assert "cannot parse" in env.call("run", {"command": "python 'unterminated"})
        assert "exactly once" in env.call("edit_file", {"path": next(iter(env.repo.files)), "old": "zzz", "new": "y"})
        assert "missing argument" in env.call("read_file", {})
        assert env.call("frobnicate", {}).startswith("error: unknown tool")
    finally:
        env.close()


def test_what_a_program_leaves_in_the_repository_never_crashes_a_tool_the_check_or_the_cleanup():
    """Found by a hostile pass (session 54): a symlink loop made read_file / write_file / list_files raise
    RuntimeError, a tree 1,200 directories deep RecursionError (in list_files and in the cleanup; Python 3.11),
    a pipe left where write_file writes blocked the harness for ever, and a lone surrogate in an answer raised in
    the check: each stopped the whole evaluation. Now each is a tool's error (or, for list_files on a Python
    whose walk is not recursive, a listing), a check that runs, or cleaned up."""
    env = S.suite_tasks("coding", 1)[0].open()
    try:
        code = ("import os\nos.symlink('loop', 'loop')\nos.mkfifo('pipe')\nos.makedirs('deep', exist_ok=True)\n"
                "os.chdir('deep')\nfor _ in range(1200):\n    os.mkdir('a')\n    os.chdir('a')\nprint('made')")
        assert env.call("write_file", {"path": "mess.py", "content": code}) == "ok"
        assert env.call("run", {"command": "python mess.py"}).split() == ["exit", "code", "0", "made"]
        for name, args in (("read_file", {"path": "loop"}), ("write_file", {"path": "loop", "content": "x"}),
                           ("edit_file", {"path": "loop", "old": "a", "new": "b"}),
                           ("write_file", {"path": "pipe", "content": "x"})):
            assert env.call(name, args).startswith("error:"), name
        assert isinstance(env.call("list_files", {}), str)
        assert env.check(" ".join(env.repo.answer_parts)) in (True, False)   # (the hidden tests run, in the mess)
    finally:
        env.close()
    assert not env.root.exists()
    he = S.HumanEvalEnvironment(S.humaneval_problems()[0], Limits(timeout_s=10))
    assert he.check("```python\ndef f():\n    return '\ud800'\n```") is False


def test_the_check_survives_a_program_that_swaps_its_directory_for_a_link(tmp_path):
    """Found by a hostile pass (session 54): a program that renamed the check's temporary directory and left a
    link to /usr in its place made the cleanup raise; the link is removed, /usr untouched."""
    from clover.evaluation.sandbox import runs_to_completion

    program = ("import os, sys\nd = os.path.dirname(os.path.abspath(sys.argv[0] if sys.argv[0] else __file__))\n"
               "os.rename(d, d + '-moved')\nos.symlink('/usr', d)\n")
    assert runs_to_completion(program, tmp_path) in (True, False)
    assert Path("/usr/bin").is_dir() and not any(p.is_symlink() for p in tmp_path.iterdir())


def test_sandbox_limits(tmp_path):
    r = run_python(["-c", "while True: pass"], tmp_path, Limits(timeout_s=1))
    assert r.timed_out and r.seconds < 5 and r.text().startswith("timed out")
    r = run_python(["-c", "x = bytearray(3 * 1024**3)"], tmp_path, Limits(memory_mb=512))
    assert r.returncode != 0 and "MemoryError" in r.stderr
    r = run_python(["-c", "print('x' * 100000)"], tmp_path, Limits(output_chars=1000))
    assert r.returncode == 0 and len(r.stdout) < 1100 and "truncated" in r.stdout
    r = run_python(["-c", "import os; print(os.getcwd(), sorted(k for k in os.environ if k.startswith('PYTHON')))"],
                   tmp_path)
    assert r.stdout.split()[0] == str(tmp_path) and "[]" in r.stdout
    # a child that forks a sleeper is killed with its whole process group
    r = run_python(["-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; "
                          "time.sleep(60)']); import time; time.sleep(60)"], tmp_path, Limits(timeout_s=1))
    assert r.timed_out and r.seconds < 5
    assert run_command("python3 -c 'print(7)'", tmp_path).stdout == "7\n"
    # a background process left behind by a program that ended in time is killed too (it would write a
    # file a second later; pids are not comparable across the sandbox's PID namespace)
    r = run_python(["-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; "
                          "time.sleep(1); open(\"late.txt\", \"w\").write(\"x\")'], stdout=subprocess.DEVNULL, "
                          "stderr=subprocess.DEVNULL, start_new_session=True)"], tmp_path)
    time.sleep(2)
    assert not r.timed_out and not (tmp_path / "late.txt").exists()


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 8])
def test_humaneval_references_pass_and_trivial_answers_fail(stride):
    """Every problem in the slow run (three sandboxed programs each, about 50 s on 2 cores); every 8th in the
    default run, which still covers each kind of check."""
    tasks = S.suite_tasks("humaneval", 500)
    problems = S.humaneval_problems()
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    for ht, p in list(zip(tasks, problems, strict=True))[::stride]:
        env = ht.open()
        assert env.check(ht.reference[0]["content"]), ht.id                     # restated function, fenced
        assert env.check(p["canonical_solution"]), ht.id                         # body only, continuing the prompt
        assert not env.check(f"```python\n{p['prompt']}    return None\n```"), ht.id


def test_humaneval_program_shapes():
    p = {"prompt": "def f(x):\n    \"\"\"Double x.\"\"\"\n", "entry_point": "f",
         "test": "def check(c):\n    assert c(2) == 4\n", "canonical_solution": "    return 2 * x\n"}
    env = S.HumanEvalEnvironment(p, Limits())
    assert env.check("Here it is:\n```python\ndef f(x):\n    return x + x\n```\nDone.")
    assert env.check("```py\ndef f(x):\n    return x * 2")           # an unterminated fence still counts
    assert env.check("    return x * 2\n")
    assert not env.check("```python\ndef f(x):\n    return x\n```")
    assert not env.check("```python\nimport os\nos.system('echo hi')\n```")  # runs, but check(f) fails
    assert not env.check("```python\nimport os\nos._exit(0)\n```")         # exits early with status 0
    assert not env.check("```python\nraise SystemExit(0)\n```")
    quick = S.HumanEvalEnvironment(p, Limits(timeout_s=1))
    assert not quick.check("```python\ndef f(x):\n    while True:\n        pass\n```")  # killed at the limit


def test_faulty_calculator_misleads_once():
    ht = next(t for t in S.suite_tasks("tools", 4) if "calc_faulty" in t.id)
    env = ht.open()
    first = json.loads(ht.reference[0]["tool_calls"][0]["function"]["arguments"])
    wrong, right = env.call("calculator", first), env.call("calculator", first)
    assert int(wrong) == int(right) + 1000
    assert env.check(ht.reference[-1]["content"]) and not env.check("no idea")


def test_unknown_suite_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown suite 'cooking'; choose from synthetic, tools, memory, heldout, coding, humaneval"):
        S.suite_tasks("cooking", 1)


def test_default_suite_sizes_cover_every_family_equally():
    sizes = {s: S.suite_tasks(s) for s in S.SUITES}
    assert {s: len(t) for s, t in sizes.items()} == {"synthetic": 100, "tools": 12, "memory": 12, "heldout": 12,
                                                     "coding": 8, "humaneval": 164}
    assert sorted(t.id.split("-")[1] for t in sizes["synthetic"]) == sorted(list(synthetic.FAMILIES) * 20)
    assert all(len({t.id for t in ts}) == len(ts) for ts in sizes.values())
    assert sorted(t.id.split("-")[1] for t in sizes["coding"]) == sorted(list(S.CODING_FAMILIES) * 2)
    assert sorted(t.id.split("-")[1] for t in sizes["memory"]) == ["2"] * 4 + ["32"] * 4 + ["8"] * 4


def test_the_validation_split_draws_other_seeds_of_the_same_tasks():
    """`--split val` (to develop a recipe on): the seeded suites' tasks on validation seeds, none of them a test
    task, of the same families and sizes; humaneval (one fixed set) and unknown splits are clear errors."""
    for suite in ("synthetic", "tools", "memory", "heldout", "coding"):
        test, val = S.suite_tasks(suite, 8), S.suite_tasks(suite, 8, "val")
        seeds = lambda ts: [int(t.id.rsplit("-", 1)[1]) for t in ts]  # noqa: E731
        lo, hi = synthetic.SPLIT_SEEDS["val"], synthetic.SPLIT_SEEDS["val"] + synthetic.SPLIT_SPAN
        assert all(lo <= x < hi for x in seeds(val)) and not set(seeds(val)) & set(seeds(test)), suite
        assert [t.id.rsplit("-", 1)[0] for t in val] == [t.id.rsplit("-", 1)[0] for t in test], suite
        assert [t.prompt for t in val] != [t.prompt for t in test], suite
    with pytest.raises(ValueError, match="no validation split"):
        S.suite_tasks("humaneval", 1, "val")
    with pytest.raises(ValueError, match="unknown split 'train'; choose from test, val"):
        S.suite_tasks("memory", 1, "train")


def test_an_answer_must_state_the_expected_value_whole():
    """A 2026-12-02 report counted "The result is 2031." as solving a task whose answer is 31: parts are
    matched as whole items, not as substrings of a longer number or word."""
    ht = next(t for t in S.suite_tasks("tools", 4) if "-calc-" in t.id)
    env = ht.open()
    final = ht.reference[-1]["content"]
    value = final.removeprefix("The result is ").rstrip(".")
    assert env.check(final) and env.check(f"({value})") and env.check(f"It is {value}, as computed.")
    for wrong in (f"The result is 20{value}.", f"The result is {value}5.", f"It is {value}.5", f"x{value}"):
        assert not env.check(wrong), wrong
    if not value.startswith("-"):
        assert not env.check(f"The result is -{value}.")
    assert synthetic.holds("Saved: project = candle47.", ["candle47"])
    assert not synthetic.holds("Saved: project = candle470.", ["candle47"])
    assert synthetic.holds("Smallest first: 3, 5, 9.", ["3, 5, 9"])
    assert not synthetic.holds("Smallest first: 3, 5, 9, 12.", ["3, 5, 9"])
    assert not synthetic.holds("31,000", ["31"]) and synthetic.holds("The total is 98. DONE", ["98", "DONE"])
    assert synthetic.holds("The result is 31.0.", ["31"]) and synthetic.holds("It costs 12.50.", ["12.5"])
    assert synthetic.holds("The total is 98, 5 additions later.", ["98"]) and synthetic.holds("98.DONE", ["DONE"])
    assert not synthetic.holds("The result is 31.01.", ["31"]) and not synthetic.holds("x-31", ["-31"])


def test_the_visible_label_test_shows_the_padding_the_hidden_ones_expect():
    """Found by a hostile pass: a visible case numbered 100 or more showed no zero padding for {n:03d}, so the
    natural unpadded fix passed it and failed the hidden tests. The visible number has two digits now, and the
    unpadded fix fails it wherever the format pads."""
    import random
    import re

    padded = 0
    for seed in range(300):
        repo = S._read_failure(random.Random(seed))
        visible = next(v for k, v in repo.files.items() if k.startswith("tests/"))
        name, n, label = re.search(r"make_label\('(\w+)', (\d+)\), '([^']*)'\)", visible).groups()
        assert 10 <= int(n) <= 99
        fmt = json.loads(repo.reference[1]["tool_calls"][0]["function"]["arguments"])["new"].removeprefix("return ")
        if ":0" in fmt:
            padded += 1
            assert label != eval(fmt.replace(":03d", "").replace(":04d", ""), {"name": name, "n": int(n)})
    assert padded > 50


def test_a_program_run_near_the_end_of_the_task_gets_only_the_time_left():
    """One tool call could overrun the task's time by its own limit (20 s): the harness now gives the
    environment the task's deadline, and a program it runs is stopped there."""
    env = S.suite_tasks("coding", 1)[0].open()
    try:
        env.set_deadline(time.perf_counter() + 1.0)
        t0 = time.perf_counter()
        out = env.call("run", {"command": "python -c 'import time; time.sleep(15)'"})
        assert out.startswith("timed out") and time.perf_counter() - t0 < 5
    finally:
        env.close()
