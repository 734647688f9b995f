"""Streamed output parsing: what the server's and `clover chat`'s `StreamingParser` spends per piece of a long
reply, against reparsing the whole text at every piece (what it did until 2026-12-07, kept as the reference:
`_scan` without its settled state).

The reply is synthetic and fixed: reasoning, then rounds of prose and a tool call whose argument is a file of
50 lines (an agent writing files), about 16 KB; fed in pieces of a few characters (a token is ~4), as a server
streams it. Both parsers' deltas are checked to add up to the same result before anything is timed. Prints
its conditions, a table, and one JSON line last.

    python benchmarks/stream_parse.py [--rounds 10] [--pieces 4,16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from clover.model.chat import StreamingParser, _scan

TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}}]


def reply(rounds: int) -> str:
    call = ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/module.py\n</parameter>\n<parameter=content>\n"
            + "".join(f"value_{i} = compute({i})\n" for i in range(50)) + "</parameter>\n</function>\n</tool_call>\n")
    return "<think>\n" + "I should write the files one by one. " * 40 + "</think>\n\n" + (
        "Writing the next module now. " * 8 + "\n" + call) * rounds


class Reparsing(StreamingParser):
    """The reference: every piece reparses the whole text so far."""

    def feed(self, piece: str):  # noqa: ANN201
        self.text += piece
        return self._delta(_scan(self.text, self.thinking, self.tools, final=False, calls=self.calls))


def stream(parser: StreamingParser, text: str, piece: int) -> tuple[str, str, list]:
    deltas = [parser.feed(text[i: i + piece]) for i in range(0, len(text), piece)] + [parser.finish()]
    return ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas),
            [c for d in deltas for c in d.tool_calls])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="prose-and-call rounds of the reply")
    ap.add_argument("--pieces", default="4,16", help="comma-separated piece lengths in characters")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    text = reply(args.rounds)
    print(f"# stream_parse: reply of {len(text):,} characters ({args.rounds} tool calls), python "
          f"{platform.python_version()}, {platform.machine()}; median of {args.repeats} streams")
    print("| piece | feeds | incremental ms | reparsing ms | ratio |")
    rows = []
    for piece in (int(p) for p in args.pieces.split(",")):
        fast, slow = [], []
        for _ in range(args.repeats):
            for parser, times in ((StreamingParser(tools=TOOLS), fast), (Reparsing(tools=TOOLS), slow)):
                t0 = time.perf_counter()
                out = stream(parser, text, piece)
                times.append(time.perf_counter() - t0)
                assert out == stream(Reparsing(tools=TOOLS), text, piece), "the parsers disagree"
        row = {"piece": piece, "feeds": -(-len(text) // piece), "incremental_ms": 1e3 * statistics.median(fast),
               "reparsing_ms": 1e3 * statistics.median(slow)}
        row["ratio"] = row["reparsing_ms"] / row["incremental_ms"]
        rows.append(row)
        print(f"| {piece} | {row['feeds']:,} | {row['incremental_ms']:.1f} | {row['reparsing_ms']:.1f} | "
              f"{row['ratio']:.1f}x |")
    print(json.dumps({"benchmark": "stream_parse", "characters": len(text), "rounds": args.rounds, "rows": rows}))


if __name__ == "__main__":
    main()
