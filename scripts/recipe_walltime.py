"""The wall time of a `make model` build: each step's seconds in RUNS/times.jsonl, less the intervals it was held
stopped (e.g. while tests ran on the same cores), plus the work of sittings killed before their step finished.

    python scripts/recipe_walltime.py RUNS [--pauses FILE] [--killed START END]...

--pauses: a file of intervals the build was held stopped, one per line: two ISO 8601 times (start end).
--killed START END: a sitting killed inside a step, from the step's start to its last checkpoint (ISO times); its
time counts, less the pauses inside it (the steps it ran again later count in times.jsonl).
Prints each step's minutes and the total, then one JSON line.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path


def _time(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def overlap(start: float, end: float, pauses: list[tuple[float, float]]) -> float:
    """Seconds of [start, end] inside any of `pauses` (intervals that do not overlap each other)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in pauses)


def walltime(records: list[dict], pauses: list[tuple[float, float]],
             killed: list[tuple[float, float]]) -> list[tuple[str, float]]:
    """(step, seconds less pauses) for each record of times.jsonl, then for each killed sitting."""
    rows = []
    for r in records:
        end = _time(r["finished"])
        rows.append((r["step"], r["seconds"] - overlap(end - r["seconds"], end, pauses)))
    for start, end in killed:
        rows.append(("killed sitting", end - start - overlap(start, end, pauses)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--pauses", type=Path, default=None)
    ap.add_argument("--killed", nargs=2, action="append", default=[], metavar=("START", "END"))
    a = ap.parse_args()
    records = [json.loads(line) for line in (a.runs / "times.jsonl").read_text().splitlines() if line.strip()]
    pauses = []
    if a.pauses is not None:
        for line in a.pauses.read_text().splitlines():
            if line.strip():
                start, end = line.split()
                pauses.append((_time(start), _time(end)))
    rows = walltime(records, pauses, [(_time(s), _time(e)) for s, e in a.killed])
    for step, seconds in rows:
        print(f"{step:24s} {seconds / 60:7.1f} min")
    total = sum(s for _, s in rows)
    print(f"{'total':24s} {total / 60:7.1f} min")
    print(json.dumps({"runs": str(a.runs), "steps": [{"step": s, "minutes": round(x / 60, 2)} for s, x in rows],
                      "total_minutes": round(total / 60, 2), "pauses": len(pauses), "killed": len(a.killed)}))


if __name__ == "__main__":
    main()
