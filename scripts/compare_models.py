"""Compare a candidate model with a baseline on validation seeds only, and apply a release rule.

    python scripts/compare_models.py CANDIDATE [--baseline DIR] [--data data] [--out runs/compare]

Both models are measured by the same code with the same settings (never on test seeds, which are kept for
the figures of the model that is chosen):
  turns        `clover eval turns --split val --tool-grammar`, pools train and heldout (--conversations each)
  bpb          `clover eval bpb --split val`: bits per byte on code and English
  match        `clover eval match --split val --thresholds 0.95`: low_confidence's TPF and per-token match
  shown, not judged: turns by task family, and `clover eval copy --split val` (teacher-forced accuracy on
  the digits an agent conversation copies, and on other tokens seen before in it): where turns are lost;
  the train pool's turns written by block diffusion (block 32, threshold 0.95): exact, the share written
  as `ar` writes them, and its tokens per forward
Each result is written to OUT/<first 16 hex digits of the weights' SHA-256>/<evaluation>.json with what made
it: the weights, the model's tokenizer and chat template, the package's source, the settings, the
conversations drawn and the data files read. It is reused only when all of those are the same (the figures
are greedy and deterministic, so a baseline need not be measured again for every candidate; except `verify`'s
TPF, shown, not judged: its drafts per check follow the forward times it measures, so the machine's load moves it).

The rule (the defaults: the one written before any of its figures for the recipe rebuilt from the opened-gate,
slow-decay init, docs/measurements.md, session 29; earlier releases had rules of their own): the candidate
replaces the baseline iff
  its turns gain at least --turns-gain points on both pools, or hold on both pools while its code bits
  per byte fall to at most --bpb-code-better x the baseline's (0 turns this second way off);
  and its bits per byte are at most --bpb-code x (code) and --bpb-english x (English) the baseline's;
  and low_confidence's TPF at 0.95 is at least --tpf x, its per-token match at least the baseline's
  minus --match-drop.
Prints a table and the verdict, then one JSON line; exits 0 either way (the verdict is in the JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from clover.cli.evaluate import files_digest, source_digest, weights_digest  # noqa: E402  (the package from ROOT)
from clover.model.files import write_text_atomic  # noqa: E402

SOURCE = source_digest()


def measure(model_dir: str | None, data: str, out: Path, conversations: int, prompts: int) -> dict:
    """Every figure the rule reads for one model, from OUT's files where the same inputs made them."""
    from clover.engine.sampling import SamplingParams
    from clover.model.checkpoint import default_model_dir, load_for_generation
    from clover.training import scores
    from clover.training.agent_data import training_tasks

    directory = Path(model_dir) if model_dir else default_model_dir()
    digest = weights_digest(model_dir)
    identity = {"weights_sha256": digest, "source_sha256": SOURCE, "model_files_sha256": files_digest(
        [f for f in sorted(directory.iterdir()) if f.name.startswith("tokenizer") or f.suffix == ".jinja"])}
    root = out / digest[:16]
    root.mkdir(parents=True, exist_ok=True)
    loaded = None

    def cached(name: str, settings: dict, compute: Callable) -> dict:
        nonlocal loaded
        path = root / f"{name}.json"
        if path.is_file():
            kept = json.loads(path.read_text())
            if kept.get("settings") == settings and kept.get("identity") == identity:
                return kept["result"]
        if loaded is None:
            loaded = load_for_generation(model_dir, "float32", "cpu")
        t0 = time.perf_counter()
        result = compute(loaded.model, loaded.tokenizer)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        write_text_atomic(path, json.dumps({"identity": identity, "model": str(directory), "settings": settings,
                                            "result": result}, indent=2) + "\n")
        return result

    figures: dict = {"model": str(directory), "weights_sha256": digest}
    for pool in ("train", "heldout"):
        tasks = hashlib.sha256(json.dumps([[t.messages, t.tools] for t in training_tasks("val", conversations, pool)],
                                          sort_keys=True, default=str).encode()).hexdigest()
        settings = {"count": conversations, "split": "val", "pool": pool, "tool_grammar": True}
        r = cached(f"turns_{pool}", settings | {"tasks_sha256": tasks, "replies": True},   # (results with the texts)
                   lambda m, t, s=settings: scores.turn_accuracy(m, t, **s))
        figures[f"turns_{pool}"] = r["exact"]
        figures[f"turns_{pool}_n"] = r["turns"]
        figures[f"turns_{pool}_by_family"] = {f: v["exact"] for f, v in r["by_family"].items()}
        if pool == "train":   # shown, not judged: the same turns written by block diffusion, against ar's
            block = {"algorithm": "low_confidence", "block_size": 32, "threshold": 0.95}
            b = cached("turns_train_block32", settings | {"tasks_sha256": tasks, "decoder": block},
                       lambda m, t, s=settings, d=block: scores.turn_accuracy(m, t, **s, decoder=SamplingParams(**d)))
            figures["block32_turns"], figures["block32_tpf"] = b["exact"], b["tpf"]
            figures["block32_same_as_ar"] = scores.same_turns(r, b)
    raw = files_digest([Path(data) / "raw" / "val" / f"{kind}.jsonl" for kind in ("code", "english")])
    settings = {"kinds": ["code", "english"], "split": "val", "raw_sha256": raw}
    r = cached("bpb", settings, lambda m, t: [scores.bits_per_byte(m, t, data, k, "val") for k in settings["kinds"]])
    for row in r:
        figures[f"bpb_{row['kind']}"] = row["model_bits_per_byte"]
    settings = {"count": prompts, "thresholds": [0.95], "split": "val",   # prompts in the model's own tokens
                "code_sha256": files_digest([Path(data) / "raw" / "val" / "code.jsonl"])}
    r = cached("match", settings, lambda m, t: scores.continuation_match(m, t, data, prompts, thresholds=(0.95,),
                                                                        split="val"))
    rows = {(x["algorithm"], x["threshold"]): x for x in r["results"]}
    settings = {"count": conversations, "split": "val"}   # shown, not judged: where the turns are lost
    r = cached("copy", settings, lambda m, t, s=settings: scores.copy_accuracy(m, t, **s))
    figures["copy_numbers"], figures["copy_other"] = (r["results"][k]["accuracy"] for k in ("number_copied",
                                                                                             "other_copied"))
    words = r.get("words", {})   # whole words copied, in the same spelling or respelt (none: shown as -)
    figures["copy_words_same"], figures["copy_words_respelt"] = (words.get(k, {}).get("accuracy") for k in
                                                                 ("same_spelling", "respelt"))
    figures["copy_unseen_names"] = r.get("unseen_names", {}).get("accuracy")   # a name no model can know, copied
    figures["lc_tpf"], figures["lc_match"] = rows["low_confidence", 0.95]["tpf"], rows["low_confidence", 0.95]["match"]
    figures["ar_match"], figures["verify_tpf"] = rows["ar", None]["match"], rows["verify", None]["tpf"]
    return figures


def verdict(cand: dict, base: dict, a: argparse.Namespace) -> tuple[bool, list[tuple[str, bool]]]:
    """Whether the candidate replaces the baseline, and each condition with its outcome."""
    # (rounded: a bound met exactly must not fail on the last bit of a float)
    gain = [round(100 * (cand[f"turns_{p}"] - base[f"turns_{p}"]), 6) for p in ("train", "heldout")]
    code = round(cand["bpb_code"] / base["bpb_code"], 6)
    english = round(cand["bpb_english"] / base["bpb_english"], 6)
    tpf = round(cand["lc_tpf"] / base["lc_tpf"], 6)
    match = round(cand["lc_match"] - base["lc_match"], 6)
    turns = (min(gain) >= a.turns_gain) or (min(gain) >= 0 and code <= a.bpb_code_better)
    checks = [
        (f"turns {gain[0]:+.2f} / {gain[1]:+.2f} points (>= {a.turns_gain} on both, or >= 0 on both with code bpb "
         f"<= {a.bpb_code_better}x)", turns),
        (f"code bpb {code:.4f}x (<= {a.bpb_code}x)", code <= a.bpb_code),
        (f"English bpb {english:.4f}x (<= {a.bpb_english}x)", english <= a.bpb_english),
        (f"lc0.95 TPF {tpf:.4f}x (>= {a.tpf}x)", tpf >= a.tpf),
        (f"lc0.95 match {match:+.4f} (>= -{a.match_drop})", match >= -a.match_drop),
    ]
    return all(ok for _, ok in checks), checks


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("candidate")
    p.add_argument("--baseline", default=None, help="checkpoint (default: the shipped model)")
    p.add_argument("--data", default="data", help="directory from `clover data build`")
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--conversations", type=int, default=120, help="agent conversations per pool")
    p.add_argument("--prompts", type=int, default=48, help="code continuations")
    p.add_argument("--turns-gain", type=float, default=2.0)
    p.add_argument("--bpb-code-better", type=float, default=0.98)
    p.add_argument("--bpb-code", type=float, default=1.01)
    p.add_argument("--bpb-english", type=float, default=1.03)
    p.add_argument("--tpf", type=float, default=0.9)
    p.add_argument("--match-drop", type=float, default=0.05)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    from clover.model.checkpoint import CheckpointError, default_model_dir, weight_files

    for d in (a.candidate, a.baseline or default_model_dir()):
        if not (Path(d) / "config.json").is_file():
            p.error(f"{d}: not a checkpoint directory (no config.json)")
        try:
            weight_files(Path(d))
        except CheckpointError as exc:
            p.error(str(exc))
    needed = [Path(a.data) / "raw" / "val" / f"{kind}.jsonl" for kind in ("code", "english")]
    missing = [str(f) for f in needed if not f.is_file()]
    if missing:
        p.error(f"{a.data} lacks {', '.join(missing)} (run `clover data build --out {a.data}` first)")
    out = Path(a.out)
    print("== baseline", file=sys.stderr)
    base = measure(a.baseline, a.data, out, a.conversations, a.prompts)
    print("== candidate", file=sys.stderr)
    cand = measure(a.candidate, a.data, out, a.conversations, a.prompts)
    keys = ("turns_train", "turns_heldout", "bpb_code", "bpb_english", "lc_tpf", "lc_match", "ar_match", "verify_tpf")
    print(f"{'':20}{'baseline':>12}{'candidate':>12}")
    for k in keys:
        print(f"{k:20}{base[k]:12.4f}{cand[k]:12.4f}")
    print("shown, not judged:")
    for pool in ("train", "heldout"):
        by_base, by_cand = base[f"turns_{pool}_by_family"], cand[f"turns_{pool}_by_family"]
        for family in sorted(by_base.keys() | by_cand.keys()):
            print(f"{f'  {pool} {family}':20}{by_base.get(family, float('nan')):12.4f}"
                  f"{by_cand.get(family, float('nan')):12.4f}")
    for k in ("copy_numbers", "copy_other", "copy_words_same", "copy_words_respelt", "copy_unseen_names",
              "block32_turns", "block32_same_as_ar", "block32_tpf"):
        shown = [f"{x[k]:12.4f}" if isinstance(x.get(k), float) else f"{'-':>12}" for x in (base, cand)]
        print(f"{'  ' + k:20}{shown[0]}{shown[1]}")
    replace, checks = verdict(cand, base, a)
    for text, ok in checks:
        print(f"  [{'x' if ok else ' '}] {text}")
    print("verdict:", "replace the baseline" if replace else "keep the baseline")
    print(json.dumps({"baseline": base, "candidate": cand, "replace": replace,
                      "checks": [{"condition": t, "holds": ok} for t, ok in checks]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
