"""Decoding speed: block diffusion at several thresholds and block sizes and lossless `verify` against
AR decoding of the same weights, and against transformers' greedy `generate` on the same backbone weights.

For each prompt set and batch size: tokens/s, TPF and engine overhead (wall time outside model
forwards, as a share of the total) for `ar`, `verify` (the default check window and --verify-windows,
with drafts kept per check, the share of blocks previewed and the share of checked drafts that came from
the context; --without-lookup adds the default window with no drafts from the context) and `low_confidence` (every block size x
threshold), and tokens/s of transformers. Prompt sets: `random` token prompts of
each --prompt-lengths, `code` (Python openings) and `agent` (tool-use chat turns of the synthetic
test tasks, through the chat template); the last two need the checkpoint's tokenizer. Random and code
prompts continue for a fixed length (end-of-sequence ignored); agent prompts get their reply, to its
end (at most --new-tokens). Greedy, same process; the conditions take turns, --repeats times, and
each row shows the median run (the machine's speed drifts). With --compile every decoder runs with its
passes compiled (`model.compile_decode`, each condition once untimed first so that compiling is not
timed) and eager `ar` stays as a reference row. Prints its conditions, a table, and one JSON line last.

    python benchmarks/decode.py [--model DIR] [--prompts random,code,agent] [--compile] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from clover.engine.engine import Engine
from clover.engine.policies import VerifyPolicy
from clover.engine.sampling import SamplingParams
from clover.model.checkpoint import CheckpointError, default_model_dir, load_checkpoint, resolve_dtype
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.testing import transformers_twin
from clover.model.tokenizer import Tokenizer
from clover.training import synthetic

CODE = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
        "def read_lines(path):\n    with open(path) as f:\n", "for i in range(10):\n",
        "import json\n\n\ndef load(path):\n", "class Point:\n    def __init__(self, x, y):\n",
        "def is_prime(n):\n    if n < 2:\n"]


def _model(path: str | None, context: int | None, dtype: str = "float32") -> tuple[CloverForCausalLM, str]:
    if context is None:
        try:
            return load_checkpoint(path or default_model_dir(), dtype=dtype), str(path or default_model_dir())
        except CheckpointError:
            if path:
                raise
    torch.manual_seed(0)
    overrides = {} if context is None else {"max_position_embeddings": context}
    model = CloverForCausalLM(CloverConfig.preset("tiny", **overrides)).eval()
    return model.to(resolve_dtype(dtype)), "tiny preset, random weights"


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Decode `prompts` once and time it."""
    engine.forward_seconds = 0.0
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    nfe = sum(r.stats.nfe for r in results)
    out = {"tokens_per_s": tokens / wall, "tpf": tokens / nfe, "overhead": 1 - engine.forward_seconds / wall,
           "wall_s": wall, "tokens": tokens, "outputs": [r.token_ids for r in results]}
    checks = sum(r.stats.check_forwards for r in results)
    if checks:
        out["kept_per_check"] = sum(r.stats.drafts_accepted for r in results) / checks
        blocks = sum(r.stats.blocks for r in results)
        out["previewed"] = 1 - sum(r.stats.previews_skipped for r in results) / max(blocks, 1)
        proposed = sum(r.stats.drafts_proposed for r in results)
        out["looked_up"] = sum(r.stats.lookup_drafts for r in results) / max(proposed, 1)
    return out


def _repeated(repeats: int, decoders: dict, prompts: list[list[int]], warm: bool = False) -> dict:
    """Each decoder (engine, params) run `repeats` times, the decoders taking turns (so that a slow
    spell of the machine falls on all of them), after an untimed run of each when `warm`. Per decoder:
    the run of median tokens/s, with every run's tokens/s and the outputs of the first."""
    if warm:
        for engine, params in decoders.values():
            engine.generate(prompts, params)
    runs: dict = {key: [] for key in decoders}
    for _ in range(repeats):
        for key, (engine, params) in decoders.items():
            runs[key].append(_run(engine, prompts, params))
    out = {}
    for key, rs in runs.items():
        median = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        out[key] = {**median, "outputs": rs[0]["outputs"], "runs_tokens_per_s": [r["tokens_per_s"] for r in rs]}
    return out


def prompt_sets(names: list[str], lengths: list[int], batch: int, model: CloverForCausalLM,
                tokenizer: Tokenizer | None, queue: int = 1) -> list[tuple[str, list[list[int]]]]:
    """(label, prompts) for each prompt set; code and agent sets have `queue` prompts per batch slot
    (at least 8)."""
    gen = torch.Generator().manual_seed(0)
    high = min(model.config.vocab_size, model.config.mask_token_id) - 1
    out = []
    for name in names:
        if name == "random":
            out += [(f"random-{n}", torch.randint(0, high, (batch, n), generator=gen).tolist()) for n in lengths]
        elif tokenizer is None:
            print(f"skipping the {name} prompts: the model has no tokenizer")
        elif name == "code":  # at least 8 prompts, `batch` of them decoded together
            out.append(("code", [tokenizer.encode(CODE[i % len(CODE)]) for i in range(max(batch * queue, 8))]))
        elif name == "agent":
            tasks = synthetic.tasks("test", max(batch * queue, 8), ("calc", "notes", "files", "recall"))
            out.append(("agent", [tokenizer.encode(tokenizer.apply_chat_template(
                t.prompt_messages, tools=t.tools, enable_thinking=False)) for t in tasks]))
        else:
            raise SystemExit(f"unknown prompt set {name!r}; choose from random, code, agent")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the shipped model, else the tiny preset at random)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="random,code,agent", help="prompt sets: random, code, agent")
    parser.add_argument("--prompt-lengths", default="64,1024", help="lengths of the random prompts")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9,0.95,1.0")
    parser.add_argument("--block-sizes", default="4,8,16,32")
    parser.add_argument("--verify-windows", default="4,16", help="also measure verify with these check windows")
    parser.add_argument("--without-lookup", action="store_true",
                        help="also measure verify (default window) without drafts from the context")
    parser.add_argument("--context", type=int, help="the tiny preset at random with this context (long prompts)")
    parser.add_argument("--max-prefill-tokens", type=int, help="chunked prefill of at most this many tokens a step")
    parser.add_argument("--queue", type=int, default=1,
                        help="code and agent prompts per batch slot: with more than 1, a finished request's slot "
                             "takes the next (continuous batching, as a server sees it)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    parser.add_argument("--compile", action="store_true",
                        help="run every decoder with its passes compiled (model.compile_decode; each run once untimed "
                             "first), next to eager ar")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each condition, taking turns (the median is shown)")
    parser.add_argument("--quick", action="store_true", help="prompt 64, batch 1, block 32, the default threshold only")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype of every decoder (and of transformers' twin)")
    args = parser.parse_args()
    if args.quick:
        args.prompt_lengths, args.batches, args.block_sizes = "64", "1", "32"
        args.thresholds = str(SamplingParams().threshold)
    model, source = _model(args.model, args.context, args.dtype)
    tokenizer = None
    if source != "tiny preset, random weights":
        try:
            tokenizer = Tokenizer.load(source)
        except (OSError, ValueError):
            tokenizer = None
    ref = None if args.no_transformers else transformers_twin(model)
    conditions = {
        "date": datetime.date.today().isoformat(), "machine": platform.machine(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "device": "cpu", "dtype": args.dtype, "model": source,
        "parameters": model.config.num_parameters()[0], "new_tokens": args.new_tokens, "greedy": True,
        "ignore_eos": "random and code prompts", "context": model.config.max_position_embeddings,
        "max_prefill_tokens": args.max_prefill_tokens, "queue": args.queue, "compiled": args.compile, "repeats": args.repeats,
        "agent_replies": "to their end (at most new_tokens)",
    }
    print("conditions:", json.dumps(conditions))
    rows = []
    for batch in map(int, args.batches.split(",")):
        opts = {"max_batch_size": batch, "max_prefill_tokens": args.max_prefill_tokens}
        engine = Engine(model, **opts)
        verifiers = {f"verify-w{VerifyPolicy().window}": engine}
        for w in args.verify_windows.split(",") if args.verify_windows else []:
            verifiers[f"verify-w{w}"] = Engine(model, policies={"verify": VerifyPolicy(window=int(w))}, **opts)
        if args.without_lookup:
            verifiers[f"verify-w{VerifyPolicy().window}-nolookup"] = Engine(
                model, policies={"verify": VerifyPolicy(lookup=False)}, **opts)
        sets = prompt_sets(args.prompts.split(","), [int(n) for n in args.prompt_lengths.split(",")], batch, model,
                           tokenizer, args.queue)
        for label, prompts in sets:
            # code and random prompts: a fixed continuation length; agent prompts: the reply, to its end
            base = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=label != "agent")
            if args.compile:   # eager ar for reference, then every row with the passes compiled
                model.compile_decode(False)
                engine.generate(prompts[:1], base.with_(max_new_tokens=4, algorithm="ar"))
                eager = _repeated(args.repeats, {"ar-eager": (engine, base.with_(algorithm="ar"))}, prompts)
                eager["ar-eager"].pop("outputs")
                rows.append({"prompt": label, "batch": batch, "algorithm": "ar-eager", **eager["ar-eager"]})
                model.compile_decode()
            engine.generate(prompts[:1], base.with_(max_new_tokens=4))  # warm-up
            decoders = {"ar": (engine, base.with_(algorithm="ar"))}
            decoders.update({name: (eng, base.with_(algorithm="verify")) for name, eng in verifiers.items()})
            for bs in map(int, args.block_sizes.split(",")):
                for th in map(float, args.thresholds.split(",")):
                    decoders[("low_confidence", bs, th)] = (engine, base.with_(block_size=bs, threshold=th))
            # compiled: each decoder's first run compiles its shapes, so run it untimed first
            results = _repeated(args.repeats, decoders, prompts, warm=args.compile)
            ar = results["ar"]
            ar_tokens = ar.pop("outputs")   # lossless decoders must give these (same_as_ar)
            rows.append({"prompt": label, "batch": batch, "algorithm": "ar", **ar})
            if args.compile:
                rows[-1]["speedup_over_eager"] = ar["tokens_per_s"] / eager["ar-eager"]["tokens_per_s"]
            if ref is not None and len({len(p) for p in prompts}) == 1 and base.ignore_eos:
                ids = torch.tensor(prompts)

                def reference(n: int, ids: torch.Tensor = ids) -> float:
                    t0 = time.perf_counter()
                    ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
                    return time.perf_counter() - t0
                reference(4)   # a warm-up, as Clover's decoders get (until 2026-12-07 it was timed once, cold)
                walls = sorted(reference(args.new_tokens) for _ in range(args.repeats))
                wall = walls[len(walls) // 2]   # the median run, as for Clover's decoders
                rows.append({"prompt": label, "batch": batch, "algorithm": "transformers_generate",
                             "tokens_per_s": batch * args.new_tokens / wall, "wall_s": wall,
                             "runs_tokens_per_s": [batch * args.new_tokens / w for w in walls]})
            for key, r in results.items():
                if key == "ar":
                    continue
                outputs = r.pop("outputs")
                row = {"prompt": label, "batch": batch}
                if isinstance(key, tuple):
                    row.update(algorithm=key[0], block_size=key[1], threshold=key[2])
                else:
                    row.update(algorithm=key, same_as_ar=outputs == ar_tokens)
                rows.append({**row, **r, "speedup_over_ar": r["tokens_per_s"] / ar["tokens_per_s"]})
    print(f"\n{'prompt':>11} {'batch':>5} {'algorithm':>22} {'block':>5} {'thr':>5} {'tok/s':>8} {'TPF':>6} "
          f"{'kept':>5} {'prev':>5} {'look':>5} {'overhead':>8} {'vs AR':>6} {'= AR':>5}")
    for r in rows:
        print(f"{r['prompt']:>11} {r['batch']:>5} {r['algorithm']:>22} {r.get('block_size', ''):>5} "
              f"{r.get('threshold', ''):>5} {r['tokens_per_s']:8.1f} {r.get('tpf', float('nan')):6.2f} "
              f"{r.get('kept_per_check', float('nan')):5.2f} {r.get('previewed', float('nan')):5.2f} "
              f"{r.get('looked_up', float('nan')):5.2f} "
              f"{100 * r.get('overhead', float('nan')):7.1f}% {r.get('speedup_over_ar', float('nan')):6.2f} "
              f"{'' if 'same_as_ar' not in r else 'yes' if r['same_as_ar'] else 'NO':>5}")
    b1 = [r["overhead"] for r in rows if r["batch"] == 1 and "overhead" in r]
    summary = {"max_overhead_batch1": max(b1) if b1 else None,
               "best_speedup_over_ar": max((r.get("speedup_over_ar", 0) for r in rows), default=None)}
    print(json.dumps({"benchmark": "decode", "conditions": conditions, "summary": summary, "results": rows}))


if __name__ == "__main__":
    main()
