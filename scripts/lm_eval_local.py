"""lm-evaluation-harness end to end against `clover serve` (issue 14): two small local tasks, no hub.

- `clover_code_mc` (multiple choice, log-likelihood): a Python line's start and four
  candidate endings (the true one and three from other lines of the same file); lm-eval scores each
  ending through /v1/completions with echo + logprobs on token ids (its `local-completions` model).
- `clover_arith_gen` (generate_until): "What is A + B?" answered by generation, exact match.

Needs `pip install lm_eval` (not a test dependency: it is large). Starts the server on a free port,
writes the task files to a temporary directory, runs lm-eval, prints its table and one JSON line.

    python scripts/lm_eval_local.py [--model DIR] [--limit 40]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import tempfile
import time
from pathlib import Path

from clover.serving.local import serve_subprocess

ROOT = Path(__file__).resolve().parents[1]


def code_items(count: int, seed: int = 0) -> list[dict]:
    """Lines of the standard library's json and email packages cut into a start and four candidate
    endings. Standard-library source is in the training corpus, so this checks that lm-eval runs and
    scores through Clover end to end; it is not a held-out benchmark."""
    import sysconfig

    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("json/*.py")) + \
        sorted(Path(sysconfig.get_paths()["stdlib"]).glob("email/*.py"))
    items = []
    for path in files:
        # lines without their indentation: lm-eval moves a context's trailing spaces to the continuation
        lines = [x.strip() for x in path.read_text(errors="replace").splitlines() if 30 <= len(x.strip()) <= 90]
        rng.shuffle(lines)
        for line in lines[: max(1, count // len(files) + 1)]:
            cut = rng.randint(len(line) // 3, 2 * len(line) // 3)
            others = [o[cut:] for o in rng.sample(lines, min(len(lines), 8)) if o != line and len(o) > cut][:3]
            if len(others) < 3:
                continue
            choices = [line[cut:], *others]
            rng.shuffle(choices)
            items.append({"context": line[:cut], "choices": choices, "label": choices.index(line[cut:])})
    return items[:count]


def arith_items(count: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
            for a, b in ((rng.randint(1, 50), rng.randint(1, 50)) for _ in range(count))]


def write_tasks(directory: Path, limit: int) -> None:
    (directory / "code.jsonl").write_text("".join(json.dumps(x) + "\n" for x in code_items(limit)))
    (directory / "arith.jsonl").write_text("".join(json.dumps(x) + "\n" for x in arith_items(limit)))
    (directory / "clover_code_mc.yaml").write_text(f"""task: clover_code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "code.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    (directory / "clover_arith_gen.yaml").write_text(f"""task: clover_arith_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "arith.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "clover" / "weights" / "clover-tiny"))
    parser.add_argument("--limit", type=int, default=40)
    args = parser.parse_args()
    import lm_eval
    from lm_eval.tasks import TaskManager

    with serve_subprocess(["--model", args.model, "--served-model-name", "clover"]) as (url, _):
        with tempfile.TemporaryDirectory() as tmp:
            write_tasks(Path(tmp), args.limit)
            t0 = time.perf_counter()
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=f"model=clover,base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                           f"tokenizer={args.model},trust_remote_code=True,num_concurrent=1,max_retries=1",
                tasks=["clover_code_mc", "clover_arith_gen"], task_manager=TaskManager(include_path=tmp),
                log_samples=False)
            wall = time.perf_counter() - t0
    from lm_eval.utils import make_table

    print(make_table(out))
    results = {task: {k: v for k, v in r.items() if isinstance(v, (int, float))} for task, r in out["results"].items()}
    print(json.dumps({"benchmark": "lm_eval_local", "date": datetime.date.today().isoformat(), "model": args.model,
                      "limit": args.limit, "lm_eval": lm_eval.__version__, "wall_s": wall, "results": results}))


if __name__ == "__main__":
    main()
