"""Argument types for the `clover` parsers: a value out of range is a usage error naming the flag (argparse exits 2
with "argument --batch: must be a positive integer, got 0"), never a traceback from deep inside a command."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [1, 65535], got {text}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def finite_float(text: str) -> float:
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def rate(text: str) -> float:
    """A positive rate; inf: all at once."""
    value = _float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number (inf: all at once), got {text}")
    return value


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
