"""Writes that a kill cannot leave half done, and reading a JSON-lines file one may have cut short.

A file or directory that a later step reads back (a checkpoint, a run's settings, a resumable log, a data
build's completion record, an evaluation's results) is written beside its target and renamed over it: a
reader sees the old version or the new one, never a truncated one (after a kill of the process; files are
synced before the rename, directories are not, so a power cut may still lose the rename). Standard library
only, so that every layer may use it (the evaluation layer included, which never loads a model).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    mask = os.umask(0)   # (the only portable way to read it; once, at import, before any thread of ours)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one rename; the temp file is removed if writing fails. The file
    keeps its mode (a new one: what a plain write gives); a symbolic link is written through."""
    path = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:   # mkstemp makes it private
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_UMASK
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_lines(path: str | os.PathLike) -> list[tuple[str, Any]]:
    """Each line of a JSON-lines file that parses, with its value: blank lines and a record that a kill cut
    short mid-append (appends are not atomic) are left out."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append((line, json.loads(line)))
        except ValueError:
            continue
    return out


def check_replaceable(target: str | os.PathLike, marker: str, what: str) -> None:
    """Refuse to write `target` over anything but an earlier `what` (a directory holding `marker`) or an empty
    directory: the atomic swaps that replace a target delete what it held (a user's files, a corpus)."""
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"{target} is a file, not a directory for {what}; choose another place")
    if any(target.iterdir()) and not (target / marker).is_file():
        raise ValueError(f"{target} holds files that are not {what}: it would be replaced; choose an empty or new "
                         "directory")


def recover_directory(target: str | os.PathLike) -> None:
    """Finish what a writer killed mid-swap left: if `target` is missing but its previous version was moved
    aside (`.NAME.old-PID`), move it back; then remove leftover temp and old copies. Run before reading or
    writing a checkpoint directory (one writer per directory at a time, as the trainer is)."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    olds = sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not target.exists() and olds:
        os.replace(olds.pop(), target)
    for leftover in [*olds, *target.parent.glob(f".{target.name}.tmp-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def write_directory(target: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Create `target` atomically: `fill(tmp_dir)` writes into a sibling temp dir that is renamed into place.
    A crash at any point leaves either the old or the new version (`recover_directory` completes a swap)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        os.chmod(tmp, 0o777 & ~_UMASK)  # mkdtemp makes it private; a checkpoint is as shareable as any file
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~_UMASK)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

