"""Running untrusted code for the evaluation suites: a Python subprocess in a given directory with
a wall-clock timeout, CPU-time, address-space, file-size and open-file limits, a minimal
environment, its own process group (killed whole on timeout) and truncated output.

Where bubblewrap (`bwrap`) is installed and works, the program also runs in its own namespaces:
no network, its own PID namespace (it sees and can signal only its own processes, which all die
with it: nothing outlives the run), its own user (nobody), the whole file system read-only except
the task directory and a private /tmp, and only the system's directories (its secrets covered), the
interpreter's installation and the task directory in it: no home directories, no /run (the host services'
unix sockets), not this package's source (the suites' hidden tests). /proc/sys is read-only. Without it the
module warns once and falls back to the limits above (`isolation()` says which is in force). Where cgroups (v1 pids and memory, as root) can
be created, each run gets its own: all its processes together are held to `Limits.processes` and
`Limits.memory_mb` (`cgroups()` says whether they are); otherwise only per-process limits apply.

A completion check (`runs_to_completion`) keeps its token out of the program's file, argv and
environment: the wrapper reads it from a pipe before the program starts. It still lives in the same
interpreter, so a program that inspects the wrapper's frames can forge a completion (see below).
`values_of` judges out of process instead: the sandboxed program only computes values and returns them
as plain literals; the caller compares them with the expected ones, which never enter the sandbox, so
nothing the program does (exiting early, patching `unittest`, returning objects whose `__eq__` is always
true) passes without the right values.
"""

from __future__ import annotations

import ast
import functools
import logging
import os
import secrets
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # POSIX only; elsewhere only the wall-clock timeout applies
    import resource
except ImportError:  # pragma: no cover
    resource = None


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 1024      # per process (address space), and for all of a run's processes with cgroups
    output_chars: int = 4000
    file_mb: int = 16
    processes: int = 64        # a run's processes at once, with cgroups
    tmp_mb: int = 64           # under bubblewrap: each memory-backed file system it may write (/tmp, /dev/shm)
    disk_mb: int = 512         # what a run may add to the disk of its directory, and what the directory may hold
    disk_files: int = 100_000  # the files and directories the directory may hold before a run


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    stopped: str = ""   # why the run was stopped or refused other than by its time limit (the disk limit)

    def text(self) -> str:
        """What a tool shows the agent: exit status, then stdout and stderr."""
        head = self.stopped or ("timed out" if self.timed_out else f"exit code {self.returncode}")
        return "\n".join(p for p in (head, self.stdout.rstrip(), self.stderr.rstrip()) if p)


TRUNCATED = "\n[... output truncated ...]\n"


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit // 2] + TRUNCATED + text[-limit // 2:]


def _limit(limits: Limits) -> None:  # runs in the child between fork and exec
    if resource is None:
        return
    cpu = int(limits.timeout_s) + 1
    for which, value in ((resource.RLIMIT_AS, limits.memory_mb * 2**20), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, limits.file_mb * 2**20), (resource.RLIMIT_NOFILE, 64)):
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):  # a platform that refuses one (macOS and RLIMIT_AS): the others still hold
            pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group has already ended
        pass


CGROUP_V1 = Path("/sys/fs/cgroup")


class _Cgroup:
    """A run's own cgroups (v1 pids and memory controllers, as root): every process the program starts
    counts against one process limit and one memory limit, and the run cannot fork without bound."""

    def __init__(self, limits: Limits) -> None:
        name = f"clover-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        self.dirs = [CGROUP_V1 / "pids" / name, CGROUP_V1 / "memory" / name]
        for d in self.dirs:
            d.mkdir()
        (self.dirs[0] / "pids.max").write_text(str(limits.processes))
        (self.dirs[1] / "memory.limit_in_bytes").write_text(str(limits.memory_mb * 2**20))

    def join(self) -> None:   # in the child, before exec
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def kill(self) -> None:
        """Kill every process in the run's groups (a setsid daemon too)."""
        for d in self.dirs:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            except OSError:
                pass

    def remove(self) -> None:
        self.kill()   # whatever is left in the run's groups is killed first
        for d in self.dirs:
            for _ in range(50):   # the killed processes leave the group within moments
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


@functools.lru_cache(maxsize=1)
def _cgroups_work() -> bool:
    if not all((CGROUP_V1 / c / "cgroup.procs").is_file() for c in ("pids", "memory")):
        return False
    try:
        _Cgroup(Limits()).remove()
    except OSError:
        return False
    return True


PACKAGE = Path(__file__).resolve().parents[1]   # this package's source, hidden tests included
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")   # what a Python program needs


@functools.lru_cache(maxsize=1)
def _covered() -> tuple[str, ...]:
    """bubblewrap arguments that cover what in the system's directories other users may not read (/etc/shadow
    and its backup, private keys, ...): needed where the harness runs as root, whose user the sandbox's is to
    the host's files. Found once per process by walking them (1.2 s for /etc and /usr's 139,000 entries on 2
    cores); links are left alone (their targets are covered where they are)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ()
    args: list[str] = []
    for top in SYSTEM:
        if os.path.islink(top):
            continue
        for d, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(d, name)
                try:
                    mode = os.lstat(path).st_mode
                except OSError:
                    continue
                if stat.S_ISDIR(mode):
                    if mode & 0o005 != 0o005:   # not listable and enterable by others: an empty one instead
                        args += ["--tmpfs", path, "--remount-ro", path]   # (read-only: no memory to write into)
                        dirs.remove(name)
                elif not stat.S_ISLNK(mode) and not mode & 0o004:
                    args += ["--ro-bind", "/dev/null", path]
    return tuple(args)


def _bwrap_argv(cwd: Path, limits: Limits = Limits(), sized: bool = True) -> list[str]:
    """Only the system's programs, libraries and settings (what other users may not read covered), the
    interpreter's installation and the task directory are in the sandbox's file system: not the host's other
    directories (home directories, /root, /run's service sockets, this project), all read-only but the task
    directory. (The sandbox's user is bubblewrap's caller to the host's files: started by root, root. What it can
    see is therefore kept to what any user may read anyway.) The file systems bubblewrap makes in memory are
    sized (/tmp and /dev/shm: `Limits.tmp_mb`) or read-only (its root, /dev, the covers): unsized and writable, a
    program could fill the host's memory through them, past the memory limit (session 55: 1.5 GB in /tmp under
    a 1 GiB limit). `sized` False, for a bubblewrap without --size (before 0.7, or setuid): /tmp and /dev/shm are
    read-only too, and a program's temporary files go to the task directory (TMPDIR)."""
    system = []
    for path in SYSTEM:
        if os.path.islink(path):   # (a merged /usr: /bin -> usr/bin)
            system += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            system += ["--ro-bind", path, path]
    system += _covered()
    # the interpreter's installation, read-only: a virtual environment may live anywhere (a fresh clone in /tmp)
    python = []
    for prefix in sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}):
        python += ["--ro-bind-try", prefix, prefix]
    # this package's source (it may be installed in the interpreter's environment, or under the task directory)
    hide = [] if PACKAGE == cwd or PACKAGE in cwd.parents else ["--tmpfs", str(PACKAGE), "--remount-ro", str(PACKAGE)]
    size = ["--size", str(limits.tmp_mb << 20)] if sized else []
    # read-only last: a task directory under /tmp (a temporary one) is bound into it first
    read_only = [] if sized else ["--remount-ro", "/tmp", "--remount-ro", "/dev/shm"]
    return ["bwrap", "--die-with-parent", "--new-session", "--unshare-all", "--unshare-user",
            "--uid", "65534", "--gid", "65534", *system,
            "--dev", "/dev", *size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev", "--proc", "/proc",
            "--ro-bind", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger",
            *size, "--tmpfs", "/tmp", *python, "--bind", str(cwd), str(cwd), *hide, *read_only, "--remount-ro", "/",
            "--chdir", str(cwd), "--as-pid-1", "--"]


def cgroups() -> bool:
    """Whether a run's processes together are held to `Limits.processes` and `Limits.memory_mb`."""
    return os.environ.get("CLOVER_SANDBOX") != "rlimits" and _cgroups_work()


@functools.lru_cache(maxsize=1)
def _bwrap_mode() -> tuple[str, str]:
    """("sized", "") where bubblewrap runs the interpreter with sized /tmp and /dev/shm, ("unsized", "") where it
    runs it only without --size (bubblewrap before 0.7, or setuid), else ("", why not)."""
    if not shutil.which("bwrap"):
        return "", "bwrap is not installed"
    reason = ""
    for mode in ("sized", "unsized"):
        with tempfile.TemporaryDirectory(prefix="clover-probe-") as d:
            try:
                # (the interpreter itself: one started through a link outside the system's directories, or
                # with libraries elsewhere, would not start inside, whatever /bin/true does)
                probe = subprocess.run([*_bwrap_argv(Path(d), sized=mode == "sized"), sys.executable, "-E", "-s",
                                        "-c", "pass"], capture_output=True, timeout=60)
                if probe.returncode == 0:
                    return mode, ""
                reason = reason or probe.stderr.decode(errors="replace").strip()[:200]
            except (OSError, subprocess.SubprocessError) as exc:
                reason = reason or str(exc)
    return "", reason


@functools.lru_cache(maxsize=1)
def isolation() -> str:
    """"bubblewrap" when programs run in their own namespaces, else "rlimits" (warned about once)."""
    if os.environ.get("CLOVER_SANDBOX") == "rlimits":   # an explicit opt-out (tests of the fallback)
        return "rlimits"
    mode, reason = _bwrap_mode()
    if mode:
        return "bubblewrap"
    logging.getLogger("clover").warning(
        "sandbox: bubblewrap unavailable (%s); model-written code runs with process limits only, which do not "
        "stop it from reading files, using the network or signalling other processes (apt-get install "
        "bubblewrap)", reason)
    return "rlimits"


class _Capture:
    """One output pipe read as it comes: the first and last `limit` bytes are kept, the middle only counted (a
    program that prints gigabytes costs the harness no more memory than one that prints a page)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.head, self.tail, self.dropped = limit, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        room = self.limit - len(self.head)
        self.head += data[:room]
        self.tail += data[room:] if room > 0 else data
        if len(self.tail) > self.limit:
            self.dropped += len(self.tail) - self.limit
            del self.tail[: len(self.tail) - self.limit]

    def text(self, chars: int) -> str:
        if not self.dropped:   # (decoded together: a character split between the two stays whole)
            return _truncate((self.head + self.tail).decode(errors="replace"), chars)
        return self.head.decode(errors="replace")[: chars // 2] + TRUNCATED + self.tail.decode(errors="replace")[-chars // 2:]


def _tree_size(root: Path, max_entries: int) -> int | None:
    """The bytes the files under `root` take on disk (links not followed; a loop or a deep tree walked without
    recursion), or None when it holds more than `max_entries` files and directories."""
    total, entries, stack = 0, 0, [str(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                entries += 1
                if entries > max_entries:
                    return None
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    pass
    return total


class _DiskWatch:
    """Whether a run has added more than `mb` MiB to the disk, since it started. The file system's free space
    (f_bfree: a run as root may write into the reserve f_bavail leaves out), read in O(1) between reads of the
    output, says when to look; under bubblewrap, where the task directory is all the disk a run can write, the
    directory's growth (walked at most twice a second) then decides, so another writer to the same disk (a
    checkpoint being saved) stops no run. Without bubblewrap the free space alone decides."""

    def __init__(self, path: Path, limits: Limits, held: int, exact: bool) -> None:
        self.path, self.budget, self.held, self.exact = path, limits.disk_mb << 20, held, exact
        self.max_entries = 10 * limits.disk_files   # (a run that makes a million files is stopped too)
        self.free, self.walked, self.grown = self._free(), 0.0, False

    def _free(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bfree * st.f_frsize

    def over(self) -> bool:
        now = self._free()
        if self.free is None or now is None or self.free - now <= self.budget:
            return self.grown
        if not self.exact:
            return True
        if time.monotonic() - self.walked >= 0.5:
            self.walked = time.monotonic()
            size = _tree_size(self.path, self.max_entries)
            self.grown = size is None or size - self.held > self.budget
        return self.grown


def _read_until(proc: subprocess.Popen, streams: dict, deadline: float, stop: Callable[[], bool] | None = None) -> bool:
    """Read the pipes in `streams` (file object -> _Capture) until both end, or `deadline` passes or `stop()`
    says so (False), or a second after the program ended (a process it left behind may hold them open: not
    waited for)."""
    with selectors.DefaultSelector() as sel:
        for f in streams:
            sel.register(f, selectors.EVENT_READ)
        ended = None
        while sel.get_map():
            now = time.monotonic()
            if ended is None and proc.poll() is not None:
                ended = now
            if ended is not None and now - ended > 1.0:
                return True
            if now >= deadline or (stop is not None and stop()):
                return False
            for key, _ in sel.select(timeout=min(deadline - now, 0.1)):
                data = os.read(key.fd, 65536)
                if data:
                    streams[key.fileobj].add(data)
                else:
                    sel.unregister(key.fileobj)
    return True


def run_python(args: list[str], cwd: str | Path, limits: Limits = Limits(), stdin: str | None = None) -> Completed:
    """`python ARGS...` with this interpreter in `cwd`: PYTHON* variables and the user site ignored, and
    no bytecode written (an edit within the same second as a cached import would otherwise be missed).
    `stdin`: a short text given to the program on its standard input (else none; it is written before the output
    is read, so it must fit a pipe's buffer: a few KiB).
    Its output is read as it comes, keeping the start and the end of each stream (`Limits.output_chars`)."""
    cwd = Path(cwd).resolve()
    held = _tree_size(cwd, limits.disk_files)
    if held is None or held > limits.disk_mb << 20:   # (what earlier runs left: refused before it grows more)
        what = f"more than {limits.disk_files} files" if held is None else f"{held / 2**20:.0f} MiB of files"
        note = (f"not run: the directory holds {what} (the limit: {limits.disk_mb} MiB, {limits.disk_files} files); "
                "remove some first")
        return Completed(1, "", "", 0.0, False, note)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"}
    argv = [sys.executable, "-E", "-s", "-B", *args]
    if isolation() == "bubblewrap":
        sized = _bwrap_mode()[0] == "sized"
        argv = [*_bwrap_argv(cwd, limits, sized), *argv]
        if not sized:   # (its /tmp is read-only)
            env["TMPDIR"] = str(cwd)
    group = _Cgroup(limits) if cgroups() else None

    def setup() -> None:   # in the child, between fork and exec
        if group is not None:
            group.join()
        _limit(limits)

    t0, note = time.perf_counter(), ""
    out, err = _Capture(limits.output_chars * 4), _Capture(limits.output_chars * 4)   # (bytes: up to 4 a char)
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env,
                                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=setup)
        try:
            if stdin is not None:   # (short: written whole before the output is read)
                try:
                    proc.stdin.write(stdin.encode())
                except BrokenPipeError:   # (the program ended, or closed its input, without reading it)
                    pass
                finally:
                    try:
                        proc.stdin.close()
                    except BrokenPipeError:
                        pass
            streams = {proc.stdout: out, proc.stderr: err}
            deadline = time.monotonic() + limits.timeout_s
            disk = _DiskWatch(cwd, limits, held, exact=isolation() == "bubblewrap")
            stopped = not _read_until(proc, streams, deadline, disk.over)
            while not stopped and proc.poll() is None:   # the pipes closed: the program may still run (it closed
                stopped = time.monotonic() >= deadline or disk.over()   # its output)
                time.sleep(0.02)
            if stopped:
                _kill_group(proc.pid)
                if time.monotonic() < deadline:   # (stopped before its time: by the disk)
                    note = f"stopped: the run wrote more than {limits.disk_mb} MiB to disk"
            if group is not None:   # what is left in the run's groups (e.g. a daemon in a session of its own)
                group.kill()
            # a process outside the run's groups that still holds a pipe (without cgroups, a child that left the
            # process group) is not waited for: the output read so far is the run's
            _read_until(proc, streams, time.monotonic() + 1.0)
            proc.wait()   # (ended, or killed with its process group above)
            _kill_group(proc.pid)  # whatever the program left running in the background goes too
        finally:
            for f in (proc.stdout, proc.stderr):
                f.close()
    finally:
        if group is not None:
            group.remove()
    return Completed(proc.returncode, out.text(limits.output_chars), err.text(limits.output_chars),
                     time.perf_counter() - t0, stopped and not note, note)


def run_command(command: str, cwd: str | Path, limits: Limits = Limits()) -> Completed:
    """A shell-like command line an agent asked for; only `python ...` (or `python3 ...`) runs."""
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        return Completed(2, "", f"cannot parse command: {exc}", 0.0, False)
    if not argv or argv[0] not in ("python", "python3"):
        return Completed(127, "", f"command not allowed: {argv[0] if argv else '(empty)'}; only `python ...` runs "
                                  "here (e.g. `python -m unittest` or `python path/to/script.py`)", 0.0, False)
    return run_python(argv[1:], cwd, limits)


# Reads the token from stdin before the program exists, runs the program, then prints the token: a
# program that exits early (even with status 0) never prints it, and the token is in no file, argument or
# environment variable the program could read. It is in the wrapper's memory, though: a program that
# walks the interpreter's frames (sys._getframe) can find it. This stops accidental early exits and naive
# forgeries; against a model that games the check deliberately, judge out of process (`values_of`, which
# the coding suite's hidden tests use; HumanEval keeps its standard in-process `check`).
_COMPLETION_WRAPPER = (
    "import sys, runpy\n"
    "_t = sys.stdin.readline().strip(); sys.stdin.close()\n"
    "runpy.run_path(sys.argv[1], run_name='__main__')\n"
    "print('\\n' + _t)\n"   # (on a line of its own after output that did not end its last line)
)


def runs_to_completion(program: str, cwd: str | Path | None = None, limits: Limits = Limits()) -> bool:
    """True when `program` (run isolated, `python -I`, from a temporary file in `cwd`) reaches its end:
    a per-run random token, printed after it by a wrapper that read it from a pipe, must appear, so code
    that exits early with status 0 does not pass. `cwd` defaults to a temporary directory."""
    token = secrets.token_hex(16)
    d = tempfile.mkdtemp(prefix="clover-run-", dir=cwd)
    try:
        path = Path(d) / "program.py"
        path.write_text(program + "\n", errors="replace")   # (a lone surrogate in a reply)
        done = run_python(["-I", "-c", _COMPLETION_WRAPPER, str(path)], cwd if cwd is not None else d, limits,
                          stdin=token + "\n")
    finally:
        remove_tree(Path(d))
    return done.returncode == 0 and token in done.stdout.splitlines()


# Evaluates each expression after the setup, in the task directory (appended to sys.path after the standard
# library, as the tests see it), and writes one line per expression to the file named by argv[1]: the repr of a
# value made only of plain types (checked by exact type, so no subclass with its own __eq__ or __repr__ passes
# through; such a repr holds no newline), else a marker. The caller trusts only what ast.literal_eval makes of
# a line, whatever the program did to this one.
_VALUES_PROGRAM = """\
import os, sys
sys.path.append(os.getcwd())
_out, _exprs, _setup = sys.argv[1], %r, %r
_SCALARS = (int, float, complex, str, bytes, bool, type(None))

def _plain(v, depth=0):
    if depth > 50:
        return False
    if type(v) in _SCALARS:
        return True
    if type(v) in (list, tuple, set):
        return all(_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(_plain(k, depth + 1) and _plain(x, depth + 1) for k, x in v.items())
    return False

_ns = {"__name__": "__judge__"}
exec(_setup, _ns)
_lines = []
for _e in _exprs:
    try:
        _v = eval(_e, _ns)
        _lines.append(repr(_v) if _plain(_v) else "<not a plain value>")
    except BaseException as _exc:
        _lines.append("<raised>")
with open(_out, "w", encoding="utf-8", errors="backslashreplace") as _f:
    _f.write("\\n".join(_lines))
"""

NOT_A_VALUE = object()   # what `values_of` gives for an expression that raised or whose value was not plain
# What `values_of` parses of a program's values (ast.literal_eval of a 3.8 MiB list took 1.9 GB: the program
# writes this file, so it is read only this far): the tests' values are short strings and numbers.
MAX_VALUES_BYTES, MAX_VALUE_CHARS = 1 << 20, 1 << 16


def values_of(setup: str, expressions: Sequence[str], cwd: str | Path, limits: Limits = Limits()) -> list[Any] | None:
    """The value of each expression, computed by a sandboxed program in `cwd` after `setup` (imports of the
    code under test) and returned as plain data: lists, tuples, sets, dicts, numbers, strings, bytes, None.
    An expression that raised or whose value is of another type gives `NOT_A_VALUE`. None when the program did
    not leave one value per expression (it failed in `setup`, exited early, timed out). Compare the result with
    the expected values in the caller's process: they never enter the sandbox."""
    if not expressions:
        return []
    d = tempfile.mkdtemp(prefix="clover-judge-", dir=cwd)
    try:
        path, out = Path(d) / "judge.py", Path(d) / "values.txt"
        path.write_text(_VALUES_PROGRAM % (list(expressions), setup), errors="replace")
        run_python(["-I", str(path), str(out)], cwd, limits)
        try:   # (not following a link, not blocking on a pipe the program left in the file's place)
            fd = os.open(out, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = f.read(MAX_VALUES_BYTES + 1)
            if len(raw) > MAX_VALUES_BYTES:
                return None
    finally:
        remove_tree(Path(d))
    lines = raw.decode("utf-8", "replace").split("\n")
    if len(lines) != len(expressions):
        return None
    values: list[Any] = []
    for line in lines:
        if len(line) > MAX_VALUE_CHARS or line.startswith("<"):
            values.append(NOT_A_VALUE)
            continue
        try:
            values.append(ast.literal_eval(line))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            values.append(NOT_A_VALUE)
    return values


def remove_tree(path: Path) -> None:
    """Remove a directory a program may have played with: a link in its place is removed, not followed; a
    directory it made unreadable is made readable first (what `tempfile.TemporaryDirectory` does, for a user
    other than root); a tree too deep for `shutil.rmtree`'s recursion goes with `rm -rf`; errors are ignored
    (what is left stays)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    try:
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            os.chmod(path, 0o700)
            for d, dirs, _ in os.walk(path):
                for name in dirs:
                    if not os.path.islink(os.path.join(d, name)):
                        os.chmod(os.path.join(d, name), 0o700)
            shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--", str(path)], capture_output=True, check=False)
    except OSError:
        pass
