"""How many tokens per check would drafts from the context give? An offline count on `ar`'s own outputs.

For each prompt set the model's greedy `ar` output is decoded once; then, position by position, the
drafts `ContextLookup` would offer there (what followed the last earlier occurrence of the text's last
4..1 tokens, up to the window) are compared with what `ar` wrote: a check yields the drafts that agree
plus one token, so tokens per check is the TPF `verify` would reach drafting only from the context.
Prompt sets: 8 `code` openings and the 8 `agent` prompts of benchmarks/decode.py, and the assistant turns
of 20 agent conversations of validation seeds (tool results in the context). Prints its conditions, a
table, and one JSON line last.

    python benchmarks/lookup.py [--model DIR] [--windows 4,8] [--shortest 1,2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import numpy as np
import torch
from decode import CODE  # benchmarks/ is on the path when run as a script

from clover.engine.engine import Engine
from clover.engine.policies import lookup_match
from clover.engine.sampling import SamplingParams
from clover.model.checkpoint import load_for_generation
from clover.training import synthetic
from clover.training.agent_data import training_tasks
from clover.training.data import assistant_turns


def tokens_per_check(prompt: list[int], out: list[int], window: int, shortest: int = 1,
                     by_match: dict | None = None) -> tuple[int, int]:
    """(tokens, checks) of decoding `out` after `prompt` with one check per window of context drafts (found
    for a suffix of `shortest` tokens or more). `by_match`, when given, collects per length of the matched
    suffix [checks with drafts, drafts kept]."""
    tokens = checks = i = 0
    while i < len(out):
        drafts, n = lookup_match(np.asarray(prompt + out[:i], dtype=np.int64), window, shortest=shortest)
        kept = 0
        while kept < len(drafts) and i + kept < len(out) and drafts[kept] == out[i + kept]:
            kept += 1
        if drafts and by_match is not None:
            row = by_match.setdefault(n, [0, 0])
            row[0], row[1] = row[0] + 1, row[1] + kept
        step = min(kept + 1, len(out) - i)
        tokens, checks, i = tokens + step, checks + 1, i + step
    return tokens, checks


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model)")
    parser.add_argument("--windows", default="4,8")
    parser.add_argument("--shortest", default="1", help="shortest suffixes matched (`lookup_match`'s `shortest`)")
    args = parser.parse_args()
    loaded = load_for_generation(args.model, "float32", "cpu")
    model, tok = loaded.model, loaded.tokenizer
    engine = Engine(model, tok, max_batch_size=16)
    tasks = synthetic.tasks("test", 8, ("calc", "notes", "files", "recall"))
    turns = []
    for t in training_tasks("val", 20):
        thinking = any(m.get("reasoning_content") for m in t.messages)
        turns += [tok.encode(p) for p, _ in assistant_turns(tok, t.messages, t.tools or None, thinking)]
    sets = {"code": ([tok.encode(c) for c in CODE[:8]], 64, True),
            "agent": ([tok.encode(tok.apply_chat_template(t.prompt_messages, tools=t.tools, enable_thinking=False))
                       for t in tasks], 64, False),
            "agent-turns-val": (turns[:40], 160, False)}
    conditions = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
                  "model": str(args.model or "shipped"), "greedy": True, "longest_suffix": 4}
    print("conditions:", json.dumps(conditions))
    rows = []
    for name, (prompts, new, ignore_eos) in sets.items():
        outs = engine.generate(prompts, SamplingParams(algorithm="ar", max_new_tokens=new, ignore_eos=ignore_eos))
        for w in map(int, args.windows.split(",")):
            for shortest in map(int, args.shortest.split(",")):
                tokens = checks = 0
                by_match: dict = {}
                for p, r in zip(prompts, outs, strict=True):
                    t, c = tokens_per_check(p, r.token_ids, w, shortest, by_match)
                    tokens, checks = tokens + t, checks + c
                rows.append({"prompts": name, "count": len(prompts), "window": w, "shortest": shortest,
                             "tokens": tokens, "checks": checks, "tokens_per_check": tokens / checks,
                             "kept_per_drafted_check": {n: kept / c for n, (c, kept) in sorted(by_match.items())},
                             "drafted_checks": {n: c for n, (c, _) in sorted(by_match.items())}})
    print(f"\n{'prompts':>16} {'count':>5} {'window':>6} {'min n':>5} {'tokens':>7} {'checks':>7} {'tok/check':>9}"
          f"  kept per check with drafts, by matched n (checks)")
    for r in rows:
        kept = ", ".join(f"{n}: {k:.2f} ({r['drafted_checks'][n]})" for n, k in r["kept_per_drafted_check"].items())
        print(f"{r['prompts']:>16} {r['count']:>5} {r['window']:>6} {r['shortest']:>5} {r['tokens']:>7} "
              f"{r['checks']:>7} {r['tokens_per_check']:9.2f}  {kept}")
    print(json.dumps({"benchmark": "lookup", "conditions": conditions, "results": rows}))


if __name__ == "__main__":
    main()
