"""Writes that a kill cannot leave half done, and reading a JSON-lines file one may have cut short.

A file or directory that a later step reads back (a checkpoint, a run's settings, a resumable log, a data
build's completion record, an evaluation's results) is written beside its target and renamed over it: a
reader sees the old version or the new one, never a truncated one (after a kill of the process; files are
synced before the rename, directories are not, so a power cut may still lose the rename). Standard library
only, so that every layer may use it (the evaluation layer included, which never loads a model).
"""

from __future__ import annotations

import fnmatch
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
    keeps its mode (a new one: what a plain write gives); a symbolic link is written through, and what is not a
    regular file (a pipe, /dev/stdout) is written as a stream."""
    if os.path.exists(path) and not os.path.isfile(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
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


MAX_SETTINGS_BYTES = 64 * 2**20   # a checkpoint's settings and template files (its tokenizer.json excepted)


def read_text(path: str | os.PathLike, max_bytes: int | None = None) -> str:
    """A UTF-8 text file's text; a file that is not UTF-8, or (with `max_bytes`) larger than that, is a
    ValueError naming it and what is wrong (a bare codec error names neither; a file of gigabytes, sparse on
    disk, was read whole into memory)."""
    if max_bytes is not None and (size := os.path.getsize(path)) > max_bytes:
        raise ValueError(f"{path} is {size / 2**20:,.0f} MiB; a file of this kind is at most "
                         f"{max_bytes / 2**20:.0f} MiB")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json(path: str | os.PathLike, max_bytes: int = MAX_SETTINGS_BYTES) -> Any:
    """A JSON file's value (a checkpoint's settings); a ValueError naming the file where it is too large, not
    UTF-8, not JSON, nested too deeply for the parser, or holds a number too long to read."""
    text = read_text(path, max_bytes)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    except ValueError as exc:   # (json.JSONDecodeError; an integer of more than 4,300 digits)
        why = "a number too long to read" if "digits" in str(exc) else str(exc)
        raise ValueError(f"{path} is not valid JSON: {why}") from None


def json_lines(path: str | os.PathLike, skip_bad: bool = False) -> list[tuple[str, Any]]:
    """Each line of a JSON-lines file with its value, blank lines left out, and the last line left out where
    it does not parse and has no newline: a record a kill cut short mid-append (appends are not atomic; the
    writers append a record and its newline in one write, so a cut one never ends in a newline). Any other
    line that does not parse is an error (ValueError naming it; callers rewrite these files, and would drop
    it), or with `skip_bad` (a reader only) is left out too."""
    text = Path(path).read_text()
    lines = text.splitlines()
    cut_short = len(lines) if not text.endswith("\n") else 0   # the number of a line a kill may have cut
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((line, json.loads(line)))
        except ValueError as exc:
            if n != cut_short and not skip_bad:
                raise ValueError(f"{path}: line {n} is not JSON ({exc}); fix or remove it") from None
    return out


def check_replaceable(target: str | os.PathLike, marker: str, what: str, kinds: tuple[str, ...] | None = None,
                      subdirs: tuple[str, ...] = ()) -> None:
    """Refuse to write `target` over anything but an earlier `what` (a directory holding `marker`, and with
    `kinds` only files matching those patterns and directories named in `subdirs`) or an empty directory: the
    atomic swaps that replace a target delete what it held (a user's files, a corpus)."""
    target = Path(target)
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"{target} is a file, not a directory for {what}; choose another place")
    if any(target.iterdir()) and not (target / marker).is_file():
        raise ValueError(f"{target} holds files that are not {what}: it would be replaced; choose an empty or new "
                         "directory")
    others = sorted(p.name for p in target.iterdir()
                    if kinds is not None and (p.name not in subdirs if p.is_dir()
                                              else not any(fnmatch.fnmatch(p.name, k) for k in kinds)))
    if others:
        raise ValueError(f"{target} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which "
                         f"{'is' if len(others) == 1 else 'are'} not part of {what}: replacing it would delete "
                         f"{'it' if len(others) == 1 else 'them'}; choose an empty or new directory")


def moved_aside(target: str | os.PathLike) -> list[Path]:
    """The previous versions of directory `target` that writers moved aside mid-swap (`.NAME.old-PID`, see
    `write_directory`), oldest first."""
    target = Path(target)
    if not target.name or not target.parent.is_dir():
        return []
    return sorted(target.parent.glob(f".{target.name}.old-*"), key=lambda p: p.lstat().st_mtime)


def recover_directory(target: str | os.PathLike) -> None:
    """Finish what a writer killed mid-swap left: if `target` is missing but its previous version was moved
    aside (`.NAME.old-PID`), move it back; then remove leftover temp and old copies. Run before reading or
    writing a checkpoint directory (one writer per directory at a time, as the trainer is)."""
    target = Path(target)
    if not target.parent.is_dir():
        return
    olds = moved_aside(target)
    if not target.exists() and olds:
        os.replace(olds.pop(), target)
    for leftover in [*olds, *target.parent.glob(f".{target.name}.tmp-*")]:
        if leftover.is_symlink():   # (rmtree refuses a link)
            leftover.unlink()
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def _share(tmp: Path) -> None:
    """Give what a writer made in its temp dir the modes the umask gives any new file: mkdtemp and mkstemp make
    them private, and a checkpoint or corpus is as shareable as any file. Links are left alone (chmod would follow
    them to what they point at)."""
    os.chmod(tmp, 0o777 & ~_UMASK)
    for root, dirs, files in os.walk(tmp):
        for name in dirs + files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, (0o777 if name in dirs else 0o666) & ~_UMASK)


def _sync(tmp: Path) -> None:
    """Flush every file under `tmp` to the disk, then the directories that list them, so that a rename of `tmp`
    that survives a power cut never names empty files."""
    for root, _dirs, files in os.walk(tmp, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_directory(target: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Create `target` atomically: `fill(tmp_dir)` writes into a sibling temp dir that is renamed into place.
    A crash at any point leaves either the old or the new version (`recover_directory` completes a swap).
    A target that is a link is followed: the directory it names is replaced (`.` as well: it has a name)."""
    target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        fill(tmp)
        _share(tmp)
        _sync(tmp)
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

