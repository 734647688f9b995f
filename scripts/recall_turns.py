"""Where a model loses the `recall` family of agent turns (the memory suite's task: add numbers one at a time with the
calculator, then answer with the total and the word the system message asks for), on validation seeds: call turns
(the running total, copied from the last tool result, and the next number of the list) against final answers (the
total, the word). Greedy `ar`, each reply held to the offered tools as `clover serve` holds it. Prints counts as one
JSON object, then a few final turns beside their references.

    python scripts/recall_turns.py [MODEL_DIR] [--conversations 400]
"""
import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clover.engine.engine import Engine  # noqa: E402
from clover.engine.sampling import SamplingParams  # noqa: E402
from clover.engine.structured import auto_tool_calls  # noqa: E402
from clover.model.chat import parse_output  # noqa: E402
from clover.model.checkpoint import load_checkpoint  # noqa: E402
from clover.model.tokenizer import IM_END, Tokenizer  # noqa: E402
from clover.training.agent_data import training_tasks  # noqa: E402
from clover.training.data import assistant_turns  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("model", nargs="?", default="clover/weights/clover-tiny")
ap.add_argument("--conversations", type=int, default=400, help="validation conversations drawn (all families)")
a = ap.parse_args()
model, tok = load_checkpoint(a.model, dtype="float32"), Tokenizer.load(a.model)
rows = []
for task in training_tasks("val", a.conversations, "train"):
    if task.family != "recall":
        continue
    thinking = any(m.get("reasoning_content") for m in task.messages)
    system = next((m["content"] for m in task.messages if m["role"] == "system"), "")
    for prompt, turn in assistant_turns(tok, task.messages, task.tools or None, thinking):
        ref = turn.split(IM_END)[0].strip()
        rows.append((tok.encode(prompt), ref, thinking, task.tools, system, task.answer))
params = [SamplingParams(max_new_tokens=160, algorithm="ar").with_(constraint=auto_tool_calls(tools, tok, th))
          for _, _, th, tools, _, _ in rows]
outs = Engine(model, tokenizer=tok, max_batch_size=16).generate([r[0] for r in rows], params)
stats = collections.Counter()
for out, (_, ref, thinking, tools, _system, answer) in zip(outs, rows, strict=True):
    text = out.text.split(IM_END)[0].strip()
    kind = "call" if "<tool_call>" in ref else "final"
    stats[kind, "turns"] += 1
    stats[kind, "exact"] += text == ref
    if kind == "call":
        got, want = parse_output(text, thinking, tools).tool_calls, parse_output(ref, thinking, tools).tool_calls
        if got and want:
            g, w = str(got[0].arguments.get("expression", "")), str(want[0].arguments.get("expression", ""))
            stats[kind, "left operand right"] += g.split(" + ")[0] == w.split(" + ")[0]
            stats[kind, "right operand right"] += g.split(" + ")[-1] == w.split(" + ")[-1]
    else:
        total, marker = answer.split("|")
        content = parse_output(text, thinking, tools).content
        stats[kind, "total right"] += total in content
        stats[kind, "marker right"] += marker in content
        stats[kind, "DONE rule"] += marker == "DONE"
        stats[kind, "marker right, DONE rule"] += marker == "DONE" and marker in content
print(json.dumps({f"{a}: {b}": v for (a, b), v in sorted(stats.items())}, indent=1))
shown = 0
for out, (_, ref, thinking, _tools, system, answer) in zip(outs, rows, strict=True):
    if "<tool_call>" not in ref and shown < 8:
        shown += 1
        print(repr(system[-80:]), "| answer", answer, "| thinking", thinking)
        print("   REF:", repr(ref[-160:]))
        print("   GOT:", repr(out.text.split(IM_END)[0].strip()[-160:]))
