"""How many test tasks of an agent suite ask a question the training chat data asks too, with an answer there that
passes the task's own check (seeds are disjoint; the templates' space is small). Suites: the harness's synthetic
ones (`synthetic` is `clover eval tasks`' set; tools, memory and heldout the agent reports').

    python scripts/task_overlap.py [--data data] [--suite synthetic] [--count 100] [--split test|val]

Prints the counts by family, then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover.evaluation.suites import suite_tasks  # noqa: E402  (the package beside this script)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data", help="directory from `clover data build`")
    ap.add_argument("--suite", default="synthetic", choices=["synthetic", "tools", "memory", "heldout"])
    ap.add_argument("--count", type=int, default=100, help="the suite's first COUNT tasks")
    ap.add_argument("--split", default="test", choices=["test", "val"], help="the suite's seeds (`clover eval agent --split`)")
    a = ap.parse_args()
    answers: dict[str, set[str]] = collections.defaultdict(set)   # a user message -> the final answers after it
    with open(Path(a.data) / "raw" / "train" / "chat.jsonl") as f:
        for line in f:
            messages = json.loads(line)["messages"]
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            for k, i in enumerate(users):
                end = users[k + 1] if k + 1 < len(users) else len(messages)
                final = [m for m in messages[i:end] if m["role"] == "assistant" and not m.get("tool_calls")]
                if final:
                    answers[messages[i]["content"].strip()].add((final[-1].get("content") or "").strip())
    seen, total = collections.Counter(), collections.Counter()
    for task in suite_tasks(a.suite, a.count, a.split):
        family = task.id.split("-")[1]
        question = [m for m in task.prompt if m["role"] == "user"][-1]["content"].strip()
        check = task.open().check
        total[family] += 1
        seen[family] += any(check(x) for x in answers.get(question, ()))
    for family in total:
        print(f"{family:8s} {seen[family]} of {total[family]}")
    print(json.dumps({"data": a.data, "suite": a.suite, "count": a.count, "split": a.split, "seen": dict(seen), "total": dict(total)}))


if __name__ == "__main__":
    main()
