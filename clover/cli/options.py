"""Argument types for the `clover` parsers: a value out of range is a usage error naming the flag (argparse exits 2
with "argument --batch: must be a positive integer, got 0"), never a traceback from deep inside a command."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clover.engine.sampling import SEED_BOUND, SEED_RULE


def _number(text: str, kind: type, ok: Callable[[Any], bool], rule: str) -> Any:
    """`text` as an int or float that passes `ok`, else a usage error saying `rule`."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}") \
            from None
    if not ok(value):   # (NaN fails every comparison)
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _number(text, int, lambda v: v >= 0, "0 or more")


def seed(text: str) -> int:
    return _number(text, int, lambda v: 0 <= v < SEED_BOUND, SEED_RULE)


def port(text: str) -> int:
    return _number(text, int, lambda v: 1 <= v <= 65535, "a TCP port in [1, 65535]")


def api_key(text: str) -> str:
    """A key to require: not empty (`--api-key "$KEY"` with KEY unset would otherwise serve with no key at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty (an unset variable?): give a key, or leave --api-key out to serve "
                                         "without one")
    return text


def layout(text: str) -> list[str]:
    """Layer types from a layout such as LFLF (`layer_types_of`), else a usage error."""
    from clover.model.config import layer_types_of
    try:
        return layer_types_of(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def finite_float(text: str) -> float:
    return _number(text, float, math.isfinite, "a finite number")


def positive_float(text: str) -> float:
    return _number(text, float, lambda v: 0 < v < math.inf, "a positive finite number")


def rate(text: str) -> float:
    """A positive rate; inf: all at once."""
    return _number(text, float, lambda v: v > 0, "a positive number (inf: all at once)")


def threshold(text: str) -> float:
    """`--threshold 0.9`: a confidence threshold in [0, 1] (as `SamplingParams` takes it)."""
    return _number(text, float, lambda v: 0 <= v <= 1, "a number between 0 and 1")


def thresholds(text: str) -> tuple[float, ...]:
    """`--thresholds 0.7,0.9`: confidence thresholds in (0, 1]."""
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers in (0, 1], got {text!r}")
    return values


def json_object(text: str) -> dict[str, Any]:
    """A JSON object (NaN and infinities refused: they are not JSON, and no setting wants them)."""
    def refuse(constant: str) -> None:
        raise argparse.ArgumentTypeError(f"must be JSON, and {constant} is not")

    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            refuse(number)
        return value

    try:
        value = json.loads(text, parse_constant=refuse, parse_float=finite)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"is not valid JSON ({exc}), got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object like '{{\"key\": 1}}', got {text!r}")
    return value


def output_file(text: str) -> str:
    """A file to write at the end of a command (a result, a trace): checked when the command starts, so that
    minutes of evaluation are not lost to a path that cannot take the file."""
    path = Path(text)
    parent = path.parent
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"must name a file, and {text!r} is {'a directory' if text else 'empty'}")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: there is no directory {parent} to write it in")
    if path.exists() and not path.is_file():   # a pipe or a device (/dev/stdout): written as a stream
        writable = os.access(path, os.W_OK)
    else:
        writable = os.access(parent, os.W_OK | os.X_OK) and (not path.exists() or os.access(path, os.W_OK))
    if not writable:
        raise argparse.ArgumentTypeError(f"{text} cannot be written here (permission denied)")
    return text
