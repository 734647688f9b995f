"""Escapes model-written code might attempt (issue 15 item 2), each contained when bubblewrap is present
(`clover.evaluation.sandbox.isolation()`; `make setup` installs it where it can); forged completions never
pass, with or without it."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clover.evaluation.sandbox import NOT_A_VALUE, Limits, cgroups, isolation, run_python, runs_to_completion, values_of

isolated = pytest.mark.skipif(isolation() != "bubblewrap", reason="bubblewrap is not available here")


def _run(code, cwd):
    return run_python(["-c", code], cwd, Limits(timeout_s=10))


@isolated
def test_writes_outside_the_task_directory_fail(tmp_path):
    task, outside = tmp_path / "task", tmp_path / "outside"
    task.mkdir()
    outside.mkdir()
    r = _run(f"open({str(outside / 'x')!r}, 'w').write('pwned')", task)
    assert r.returncode != 0 and not (outside / "x").exists()
    assert _run("open('inside.txt', 'w').write('ok')", task).returncode == 0 and (task / "inside.txt").exists()
    r = _run("import os; open(os.path.expanduser('~/../../etc/passwd-copy'), 'w')", task)
    assert r.returncode != 0


@isolated
def test_the_parent_and_other_processes_are_invisible(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = _run(f"import os\ntry:\n    os.kill({sleeper.pid}, 9)\nexcept OSError as e:\n    print('denied', e)\n"
                 f"print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
                 f"print(open('/proc/%d/environ' % os.getppid()).read() if os.getppid() > 1 else 'no parent')",
                 tmp_path)
        time.sleep(0.2)
        assert sleeper.poll() is None                      # the harness's processes cannot be signalled
        assert "denied" in r.stdout and "no parent" in r.stdout
        assert str(os.getpid()) not in r.stdout.split("\n")[1]
    finally:
        sleeper.kill()


@isolated
def test_no_network_not_even_the_loopback(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        r = _run(f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {port}))\n"
                 "print('connected')", tmp_path)
    assert "connected" not in r.stdout and r.returncode != 0


@isolated
def test_a_double_forked_daemon_does_not_outlive_the_run(tmp_path):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1)\n"
            "        open('daemon.txt', 'w').write('alive')\n    os._exit(0)\nprint('parent done')")
    r = _run(code, tmp_path)
    time.sleep(2)
    assert "parent done" in r.stdout and not (tmp_path / "daemon.txt").exists()


@pytest.mark.parametrize("forgery", [
    "import sys; print(open(sys.argv[0]).read().split()[-1].strip(\"'()\")); raise SystemExit(0)",
    "import sys\nfor a in sys.argv: print(a)\nimport os; print(open('/proc/self/cmdline').read()); os._exit(0)",
    "import os\nfor k, v in os.environ.items(): print(v)\nos._exit(0)",
    "import glob\nfor f in glob.glob('**/*.py', recursive=True): print(open(f).read())\nraise SystemExit(0)",
])
def test_a_forged_completion_never_passes(tmp_path, forgery):
    """The completion token is in no file, argument or variable the program can read: printing what it can
    find and exiting 0 early does not pass."""
    assert runs_to_completion("print('fine')", tmp_path)
    assert not runs_to_completion(forgery, tmp_path)


def test_a_program_whose_output_does_not_end_its_line_completes(tmp_path):
    """Found by a hostile pass: the token was looked for as a whole line, and `print(x, end="")` left it glued
    to the program's last line, so a correct HumanEval answer could fail."""
    assert runs_to_completion("import sys\nsys.stdout.write('ok')", tmp_path)
    assert runs_to_completion("print('a', end='')", tmp_path)


grouped = pytest.mark.skipif(not cgroups(), reason="no cgroups to create here")


@grouped
def test_a_fork_bomb_is_capped(tmp_path):
    code = ("import os, time\nn = 0\ntry:\n    for _ in range(500):\n        if os.fork() == 0:\n"
            "            time.sleep(3)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)")
    r = run_python(["-c", code], tmp_path, Limits(timeout_s=10, processes=16))
    assert r.stdout.strip() and int(r.stdout) < 16


@grouped
def test_memory_is_capped_across_children(tmp_path):
    """Each child stays under the per-process limit; together they pass the run's memory limit."""
    code = ("import os, time\nkids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = bytearray(200 * 2**20)\n        x[::4096] = b'x' * len(x[::4096])\n        time.sleep(2)\n"
            "        os._exit(0)\n    kids.append(pid)\n"
            "print(sorted(os.waitpid(k, 0)[1] for k in kids))")
    r = run_python(["-c", code], tmp_path, Limits(timeout_s=20, memory_mb=500))
    statuses = [int(s) for s in r.stdout.strip("[]\n").split(",") if s.strip()] if r.stdout.strip() else []
    assert r.returncode != 0 or any(s != 0 for s in statuses), r   # the group's limit killed someone


@isolated
def test_root_only_files_and_kernel_settings_are_out_of_reach(tmp_path):
    """Found by a hostile pass (session 54): bubblewrap maps the sandbox's user to its caller's, so under a harness
    run as root model-written code read root-only files (/etc/shadow) and wrote /proc/sys. Now only the system's
    directories are in its file system, with what other users may not read covered (a review found /etc/shadow-
    and /etc/gshadow- still readable under a list of known secrets), and /proc/sys is read-only; the task
    directory (and a file the harness wrote into it) stays writable."""
    var_tmp = Path("/var/tmp")
    if not os.access(var_tmp, os.W_OK):
        pytest.skip("/var/tmp is not writable here")
    secret = var_tmp / f"clover-test-secret-{os.getpid()}"
    secret.write_text("root only")
    secret.chmod(0o600)
    (tmp_path / "given.py").write_text("x = 1\n")
    probe = ("import os\nfor path in ({secret!r}, '/etc/shadow', '/etc/shadow-', '/etc/gshadow-', "
             "'/etc/security/opasswd', '/etc/ssh/ssh_host_ed25519_key'):\n"
             "    try:\n        open(path).read()\n        print('read', path)\n    except OSError:\n        pass\n"
             "try:\n    v = open('/proc/sys/fs/lease-break-time').read()\n"
             "    open('/proc/sys/fs/lease-break-time', 'w').write(v)\n    print('wrote sysctl')\nexcept OSError:\n"
             "    pass\nprint(os.access('/proc/sysrq-trigger', os.W_OK))\n"
             "open('given.py', 'a').write('y = 2\\n'); open('new.txt', 'w').write('ok')")
    try:
        r = _run(probe.format(secret=str(secret)), tmp_path)
    finally:
        secret.unlink()
    assert r.stdout.split() == ["False"], r
    assert (tmp_path / "given.py").read_text() == "x = 1\ny = 2\n" and (tmp_path / "new.txt").read_text() == "ok"


@isolated
def test_host_sockets_in_run_and_the_package_source_are_out_of_sight(tmp_path):
    """Found by a hostile pass (session 54): a unix socket under /run (where docker's, D-Bus's and systemd's
    live) could be connected to from inside; the suites' hidden tests could be read from this package's source."""
    import clover.evaluation.suites as suites

    run = Path("/run")
    if not os.access(run, os.W_OK):
        pytest.skip("/run is not writable here")
    path = run / f"clover-test-{os.getpid()}.sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        server.listen()
        try:
            r = _run(f"import socket, os\nprint(os.path.exists({str(path)!r}))\ns = socket.socket(socket.AF_UNIX)\n"
                     f"s.settimeout(2)\ns.connect({str(path)!r})\nprint('connected')", tmp_path)
        finally:
            path.unlink()
    assert "connected" not in r.stdout and r.stdout.split()[:1] == ["False"], r
    r = _run(f"print(open({suites.__file__!r}).read()[:20])", tmp_path)
    assert r.returncode != 0 and "No such file" in r.stderr, r


def test_output_is_read_as_it_comes_and_kept_at_its_ends(tmp_path):
    """Found by a hostile pass (session 54): 400 MiB printed went whole into the harness's memory (1.2 GB peak)
    before it was cut to `output_chars`. Now only both ends are kept: the harness's Python allocations peak
    under 16 MiB while the program prints 400 MiB, and the start and the end of the output are there."""
    import tracemalloc

    code = ("import sys\nsys.stdout.write('START')\nchunk = 'x' * 2**22\nfor _ in range(100):\n"
            "    sys.stdout.write(chunk)\nsys.stdout.write('END')")
    tracemalloc.start()
    try:
        r = run_python(["-c", code], tmp_path, Limits(timeout_s=60, output_chars=200))
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert r.returncode == 0 and peak_mb < 16, (peak_mb, r.returncode)
    assert r.stdout.startswith("START") and r.stdout.endswith("END") and "output truncated" in r.stdout
    assert len(r.stdout) < 300


def test_a_child_that_leaves_the_process_group_holding_the_output_does_not_hold_up_the_run(tmp_path, monkeypatch):
    """Found by a hostile pass (session 54): without bubblewrap or cgroups, a child in a session of its own that
    kept stdout open made the run wait for it (for ever, had it slept for ever). Now the run ends a moment after
    the program does."""
    from clover.evaluation import sandbox

    monkeypatch.setenv("CLOVER_SANDBOX", "rlimits")
    sandbox.isolation.cache_clear()
    try:
        code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(8)\n    os._exit(0)\n"
                "print('parent done')")
        t0 = time.monotonic()
        r = run_python(["-c", code], tmp_path, Limits(timeout_s=20))
        assert time.monotonic() - t0 < 5 and "parent done" in r.stdout and not r.timed_out, r
    finally:
        sandbox.isolation.cache_clear()


@pytest.mark.parametrize("mode", ["as configured", "rlimits"])
def test_a_program_that_closes_its_output_still_runs_to_its_end_or_its_timeout(tmp_path, monkeypatch, mode):
    """Found by a review (session 54): the end of both pipes was taken for the end of the program, which the
    run's cgroup then killed at once (without cgroups, five seconds later), reported as no timeout. Now a program
    that closes its output runs on: to its end within the time limit, or to the limit, reported as a timeout."""
    from clover.evaluation import sandbox

    if mode == "rlimits":
        monkeypatch.setenv("CLOVER_SANDBOX", "rlimits")
    sandbox.isolation.cache_clear()
    try:
        code = "import os, sys, time\nos.close(1)\nos.close(2)\ntime.sleep(float(sys.argv[1]))\nopen('done', 'w')"
        r = run_python(["-c", code, "1.5"], tmp_path, Limits(timeout_s=10))
        assert r.returncode == 0 and not r.timed_out and (tmp_path / "done").exists(), r
        r = run_python(["-c", code, "60"], tmp_path, Limits(timeout_s=2))
        assert r.timed_out and r.seconds < 6, r
    finally:
        sandbox.isolation.cache_clear()


def test_output_split_inside_a_character_where_nothing_was_dropped_stays_whole():
    """Found by a review (session 54): the kept start and end were decoded apart, so a character split between
    them came out as two replacement characters."""
    from clover.evaluation.sandbox import _Capture

    cap = _Capture(40)
    cap.add(("a" + "\u00e9" * 20 + "bbb").encode())
    assert cap.text(1000) == "a" + "\u00e9" * 20 + "bbb"


@isolated
def test_the_package_source_is_hidden_from_a_task_directory_above_it():
    """Found by a review (session 54): the package was hidden before the task directory was bound, so a task
    directory above it (the project's root) showed it again."""
    import clover

    package = Path(clover.__file__).resolve().parent
    r = _run(f"import os\nprint(os.listdir({str(package / 'evaluation')!r}))", package.parent)
    assert r.returncode != 0 and "suites.py" not in r.stdout, r


def test_values_of_returns_plain_values_and_nothing_else(tmp_path):
    (tmp_path / "mod.py").write_text(
        "class Eq:\n    def __eq__(self, o):\n        return True\n\n\nclass S(str):\n    pass\n\n\n"
        "def boom():\n    raise SystemExit(0)\n")
    exprs = ["1 + 1", "'a\\nb'", "[1, (2, 3), {'k': None}]", "{1, 2}", "b'\\x00'", "True", "-2.5",
             "Eq()", "S('x')", "[Eq()]", "{'k': S('x')}", "boom()", "1 / 0", "float('nan')"]
    got = values_of("from mod import Eq, S, boom", exprs, tmp_path)
    assert got[:7] == [2, "a\nb", [1, (2, 3), {"k": None}], {1, 2}, b"\x00", True, -2.5]
    assert type(got[2][1]) is tuple and type(got[5]) is bool
    assert all(v is NOT_A_VALUE for v in got[7:])   # not plain, raised (SystemExit too), or no literal (nan)
    assert values_of("import no_such_module", ["1"], tmp_path) is None       # the setup failed
    assert values_of("import os\nos._exit(0)", ["1"], tmp_path) is None      # exited before any value
    assert values_of("", [], tmp_path) == []
    # a values file the program wrote itself, too large to parse safely (3.8 MiB of list took 1.9 GB): no values
    huge = "import atexit, sys\natexit.register(lambda: open(sys.argv[1], 'w').write('[' + '1,' * (1 << 20) + ']'))"
    assert values_of(huge, ["1"], tmp_path) is None
    assert not any(p.name.startswith("clover-judge-") for p in tmp_path.iterdir())   # cleaned up


def test_values_of_is_not_blocked_or_fooled_by_what_the_program_leaves_in_its_file(tmp_path):
    """A pipe or a link to a device left where the values are read: no values, at once."""
    for leave in ("os.mkfifo(_o)", "os.symlink('/dev/zero', _o)"):
        setup = (f"import atexit, os, sys\n_o = sys.argv[1]\n"
                 f"atexit.register(lambda: (os.remove(_o), {leave}))")
        t0 = time.monotonic()
        assert values_of(setup, ["1"], tmp_path) is None
        assert time.monotonic() - t0 < 10


def test_memory_backed_file_systems_are_sized_and_the_rest_read_only(tmp_path):
    """Found in session 55: /tmp, /dev/shm, /dev and the cover over this package were unsized tmpfs the program
    could write, in memory, past the memory limit (1.5 GB in /tmp under a 1 GiB limit)."""
    if isolation() != "bubblewrap":
        pytest.skip("bubblewrap is not available here")
    from clover.evaluation.sandbox import PACKAGE

    code = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        f = open(p, 'wb')\n"
            "        for i in range(40):\n            f.write(bytes(1 << 20)); f.flush()\n        print(p, 'all')\n"
            "    except OSError as e:\n        print(p, i if p in ('/tmp/x', '/dev/shm/x') else '', e.errno)\n")
    from clover.evaluation.sandbox import _covered

    # bubblewrap's own root is a tmpfs too, and so is each cover over a directory other users may not read
    # (found by a review: both were still writable, unsized)
    covers = [_covered()[i + 1] for i, a in enumerate(_covered()) if a == "--tmpfs"][:1]
    paths = ["/tmp/x", "/dev/shm/x", "/dev/x", f"{PACKAGE}/x", "/x", "/newdir/x", *(f"{c}/x" for c in covers)]
    r = run_python(["-c", code.replace("open(p, 'wb')", "(os.makedirs(os.path.dirname(p), exist_ok=True), "
                                       "open(p, 'wb'))[1]").replace("import sys", "import os, sys"), *paths],
                   tmp_path, Limits(timeout_s=30, tmp_mb=16, file_mb=64))
    assert r.stdout.splitlines() == ["/tmp/x 16 28", "/dev/shm/x 16 28", *(f"{p}  30" for p in paths[2:])], r.text()
    assert run_python(["-c", "open('here', 'w').write('x')"], tmp_path).returncode == 0   # the task directory


def test_without_sized_file_systems_tmp_is_read_only_and_temporary_files_go_to_the_task(tmp_path, monkeypatch):
    """A bubblewrap without --size (before 0.7, or setuid) would have refused every run, and the probe fallen
    back to rlimits: it runs with /tmp and /dev/shm read-only, TMPDIR the task directory."""
    if isolation() != "bubblewrap":
        pytest.skip("bubblewrap is not available here")
    from clover.evaluation import sandbox

    monkeypatch.setattr(sandbox, "_bwrap_mode", lambda: ("unsized", ""))
    code = ("import errno, tempfile\nfor p in ('/tmp/x', '/dev/shm/x'):\n    try:\n        open(p, 'w')\n"
            "    except OSError as e:\n        print(p, errno.errorcode[e.errno])\nprint(tempfile.mkstemp()[1])")
    r = run_python(["-c", code], tmp_path)
    lines = r.stdout.splitlines()
    assert lines[:2] == ["/tmp/x EROFS", "/dev/shm/x EROFS"] and lines[2].startswith(str(tmp_path.resolve())), r.text()


def test_a_run_that_fills_the_disk_is_stopped_and_a_full_directory_refuses_the_next(tmp_path):
    limits = Limits(timeout_s=30, disk_mb=16, file_mb=64)
    small = run_python(["-c", "open('a', 'wb').write(bytes(1 << 20)); print('ok')"], tmp_path, limits)
    assert small.returncode == 0 and small.stdout.strip() == "ok" and not small.stopped
    if isolation() == "bubblewrap":   # another writer to the same disk (a checkpoint) stops no run (a review)
        other = tmp_path.parent / f"{tmp_path.name}-other"
        writer = threading.Thread(target=lambda: other.write_bytes(os.urandom(48 << 20)))
        slow = ["-c", "import time; time.sleep(0.3); open('b', 'wb').write(bytes(1 << 20)); time.sleep(1.5); "
                      "print('ok')"]
        writer.start()
        shared = run_python(slow, tmp_path, limits)
        writer.join()
        other.unlink()
        assert shared.stdout.strip() == "ok" and not shared.stopped, shared.text()
        for p in tmp_path.iterdir():
            p.unlink()
    code = "import os\nfor i in range(200):\n    open(f'f{i}', 'wb').write(os.urandom(1 << 20))\nprint('all')"
    big = run_python(["-c", code], tmp_path, limits)
    assert big.stopped.startswith("stopped: the run wrote more than 16 MiB") and "all" not in big.stdout
    assert not big.timed_out and big.seconds < 20 and len(list(tmp_path.iterdir())) < 100
    refused = run_python(["-c", "print('hi')"], tmp_path, limits)
    assert refused.text().startswith("not run: the directory holds") and "hi" not in refused.stdout
    for p in tmp_path.iterdir():
        p.unlink()
    many = Limits(timeout_s=30, disk_files=50)
    run_python(["-c", "for i in range(60): open(f'g{i}', 'w')"], tmp_path, many)
    assert "more than 50 files" in run_python(["-c", "print(1)"], tmp_path, many).text()
