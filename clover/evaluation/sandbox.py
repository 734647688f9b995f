"""Running untrusted code for the evaluation suites: a Python subprocess in a given directory with
a wall-clock timeout, CPU-time, address-space, file-size and open-file limits, a minimal
environment, its own process group (killed whole on timeout) and truncated output.

This is containment for model-written test code on a developer's machine, not a security boundary
against a hostile adversary: for that, run the harness inside a container or VM.
"""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

try:  # POSIX only; elsewhere only the wall-clock timeout applies
    import resource
except ImportError:  # pragma: no cover
    resource = None


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 1024
    output_chars: int = 4000
    file_mb: int = 16


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def text(self) -> str:
        """What a tool shows the agent: exit status, then stdout and stderr."""
        head = "timed out" if self.timed_out else f"exit code {self.returncode}"
        return "\n".join(p for p in (head, self.stdout.rstrip(), self.stderr.rstrip()) if p)


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n[... output truncated ...]\n" + text[-limit // 2:]


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


def run_python(args: list[str], cwd: str | Path, limits: Limits = Limits()) -> Completed:
    """`python ARGS...` with this interpreter in `cwd`: PYTHON* variables and the user site ignored, and
    no bytecode written (an edit within the same second as a cached import would otherwise be missed)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LANG": "C.UTF-8"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-E", "-s", "-B", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True, preexec_fn=lambda: _limit(limits))
    timed_out = False
    try:
        out, err = proc.communicate(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        out, err = proc.communicate()
    _kill_group(proc.pid)  # whatever the program left running in the background goes too
    return Completed(proc.returncode, _truncate(out, limits.output_chars), _truncate(err, limits.output_chars),
                     time.perf_counter() - t0, timed_out)


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


def runs_to_completion(program: str, cwd: str | Path | None = None, limits: Limits = Limits()) -> bool:
    """True when `program` (run isolated, `python -I`, from a temporary file outside `cwd`) reaches its
    end: a per-run random token printed after it must appear, so code that exits early with status 0
    does not pass. `cwd` defaults to the temporary directory."""
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="clover-run-") as d:
        path = Path(d) / "program.py"
        path.write_text(f"{program}\nprint({token!r})\n")
        done = run_python(["-I", str(path)], cwd if cwd is not None else d, limits)
    return done.returncode == 0 and token in done.stdout.splitlines()
