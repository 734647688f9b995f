"""Can a layer layout learn to copy? A learnability probe for induction, the skill agents lean on.

An agent copies what it reads (a name from the user's message into a tool call, a number into its
answer); a model learns that through induction: find the earlier occurrence, copy what followed it.
Each layout here (a string over L = Gated DeltaNet, F = full attention, one letter per layer, on the
`--preset` shape) is trained from random weights, same seed, on one synthetic task only: rows
`SEP x SEP x` with x a string of random tokens, next-token loss on the whole row. The first half
cannot be predicted; the second half can be, only by copying the first. Reported per layout: copy
accuracy of the second half (after its first token) on a fixed held-out batch every `--eval-every`
steps, the first step at which it passes `--pass-at`, and training tokens/s. A layout that never
passes within `--steps` cannot form induction at this budget, whatever the data mix.

    python benchmarks/copy_probe.py [--layouts LLLF,LFLF,FFFF] [--seeds 0,1,2] [--steps 800] [--preset tiny-wide]

Prints its conditions, one line per evaluation, a table, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from clover.model.config import CloverConfig, layer_types_of
from clover.model.modeling import CloverForCausalLM, check_gdn_init
from clover.training.trainer import TrainConfig


def copy_rows(batch: int, length: int, vocab: int, gen: torch.Generator, first: int = 100) -> torch.Tensor:
    """[batch, 2 * length + 2] rows SEP x SEP x; x from tokens first .. first + vocab, SEP = 50."""
    x = torch.randint(first, first + vocab, (batch, length), generator=gen)
    sep = torch.full((batch, 1), 50)
    return torch.cat([sep, x, sep, x], dim=1)


def row_losses(model: CloverForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(next-token cross-entropies [N,T-1], logits [N,T-1,V]) through the training forward."""
    n, t = ids.shape
    hidden, _ = model.causal(ids, None, torch.full((n,), t), logits="train")
    logits = model.lm_head(hidden[:, :-1]).float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(n, t - 1), logits


def copy_accuracy(model: CloverForCausalLM, rows: torch.Tensor, second: slice) -> tuple[float, float]:
    """(accuracy, mean loss) of the second x's predictions after its first token, on `rows`."""
    ce, logits = row_losses(model, rows)
    return float((logits[:, second].argmax(-1) == rows[:, 1:][:, second]).float().mean()), float(ce[:, second].mean())


def probe(layout: str, seed: int, args: argparse.Namespace) -> dict:
    cfg = CloverConfig.preset(args.preset, layer_types=layer_types_of(layout), num_hidden_layers=len(layout),
                              tie_word_embeddings=args.tie)
    if 100 + args.vocab + args.unseen > cfg.vocab_size:
        raise SystemExit(f"--vocab {args.vocab} and --unseen {args.unseen} do not fit the preset's vocabulary "
                         f"({cfg.vocab_size})")
    model = CloverForCausalLM.from_scratch(cfg, seed, args.gdn_gate_z, args.gdn_dt_max)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    train_gen = torch.Generator().manual_seed(seed)
    held_out = copy_rows(args.batch, args.length, args.vocab, torch.Generator().manual_seed(10_000 + seed))
    # rows of tokens training never shows (ids after the training range): does the copy carry over to them?
    unseen = copy_rows(args.batch, args.length, args.unseen, torch.Generator().manual_seed(20_000 + seed),
                       first=100 + args.vocab) if args.unseen else None
    second = slice(args.length + 2, None)   # predictions of the second x after its first token
    curve, passed, t_train = [], None, 0.0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        rows = copy_rows(args.batch, args.length, args.vocab, train_gen)
        if args.unseen_noise:   # rows of the held-out tokens at random: trained on, never copied
            noisy = torch.rand(args.batch, generator=train_gen) < args.unseen_noise
            noise = torch.randint(100 + args.vocab, 100 + args.vocab + args.unseen, rows.shape, generator=train_gen)
            rows = torch.where(noisy[:, None], noise, rows)
        ce, _ = row_losses(model, rows)
        opt.zero_grad()
        ce.mean().backward()
        opt.step()
        t_train += time.perf_counter() - t0
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():
                acc, loss = copy_accuracy(model, held_out, second)
                curve.append({"step": step, "copy_accuracy": round(acc, 4), "copy_loss": round(loss, 4)})
                unseen_text = ""
                if unseen is not None:
                    curve[-1]["unseen_copy_accuracy"] = round(copy_accuracy(model, unseen, second)[0], 4)
                    unseen_text = f", on unseen tokens {curve[-1]['unseen_copy_accuracy']:.3f}"
            print(f"{layout} seed {seed} step {step}: copy accuracy {acc:.3f}, copy loss {curve[-1]['copy_loss']:.3f}"
                  f"{unseen_text}", flush=True)
            if acc >= args.pass_at:
                passed = step
                break
    tokens = step * args.batch * held_out.shape[1]
    return {"layout": layout, "seed": seed, "passed_at_step": passed, "final": curve[-1], "curve": curve,
            "train_tokens_per_s": round(tokens / t_train, 1),
            "parameters": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="LLLF,FFFF,LFLF", help="comma-separated, one letter per layer (L, F)")
    ap.add_argument("--preset", default="tiny-wide")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=20, help="tokens in x")
    ap.add_argument("--vocab", type=int, default=200, help="distinct tokens x is drawn from")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--pass-at", type=float, default=0.9)
    ap.add_argument("--gdn-gate-z", type=float, default=TrainConfig.gdn_gate_z,
                    help="GDN output gates opened to silu(z) at this mean z at init, as `clover train --gdn-gate-z` "
                         "does (default 0: the transformers-style init, `clover train`'s default since session 34)")
    ap.add_argument("--gdn-dt-max", type=float, default=TrainConfig.gdn_dt_max,
                    help="GDN decay steps drawn log-uniform in [0.001, this] at init, as `clover train --gdn-dt-max` "
                         "does (default 0: the transformers-style dt_bias 1)")
    ap.add_argument("--tie", action="store_true", help="tie the LM head to the token embeddings "
                    "(tie_word_embeddings; the presets' default is untied, as the Qwen3.5-MoE family)")
    ap.add_argument("--unseen", type=int, default=0, help="also report copy accuracy on rows of this many tokens "
                    "that training never shows (a name the model cannot know)")
    ap.add_argument("--unseen-noise", type=float, default=0.0, help="share of training rows that are the --unseen "
                    "tokens at random, without a repeat: then they are trained on, only never copied (as a name's "
                    "pieces occur in text)")
    ap.add_argument("--seeds", default="0", help="comma-separated: each layout is trained once per seed (weights "
                    "and rows); when induction forms varies from seed to seed")
    args = ap.parse_args()
    if not 0 <= args.unseen_noise < 1 or (args.unseen_noise and not args.unseen):
        raise SystemExit("copy_probe: --unseen-noise is a share in [0, 1) of rows, and needs --unseen N")
    try:
        check_gdn_init(args.gdn_gate_z, args.gdn_dt_max)
    except ValueError as exc:
        raise SystemExit(f"copy_probe: {exc}") from None
    print(f"copy probe: preset {args.preset}, rows SEP x SEP x with |x| = {args.length} from {args.vocab} tokens, "
          f"{'tied' if args.tie else 'untied'} embeddings, held-out tokens {args.unseen} (in {args.unseen_noise:.0%} of the "
          f"rows, uncopied), batch {args.batch}, AdamW lr {args.lr} constant, GDN gate z {args.gdn_gate_z} and decay steps up to {args.gdn_dt_max or 'transformers-style'} at init, at most {args.steps} steps, seeds {args.seeds}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    layouts, seeds = args.layouts.split(","), [int(s) for s in args.seeds.split(",")]
    for layout in layouts:   # all checked before the first one trains
        try:
            layer_types_of(layout)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    results = [probe(layout, seed, args) for layout in layouts for seed in seeds]
    print(f"\n| layout | seeds passing {args.pass_at:.0%} copy accuracy | step it passed, per seed | final accuracy, per seed "
          f"| on unseen tokens | tokens/s |")
    print("|---|---|---|---|---|---|")
    for layout in layouts:
        rs = [r for r in results if r["layout"] == layout]
        at = ", ".join(str(r["passed_at_step"]) if r["passed_at_step"] is not None else "-" for r in rs)
        final = ", ".join(f"{r['final']['copy_accuracy']:.2f}" for r in rs)
        passed = sum(r["passed_at_step"] is not None for r in rs)
        speed = sum(r["train_tokens_per_s"] for r in rs) / len(rs)
        unseen = ", ".join(f"{r['final'].get('unseen_copy_accuracy', float('nan')):.2f}" for r in rs)
        print(f"| {layout} | {passed} of {len(rs)} | {at} | {final} | {unseen} | {speed:.0f} |")
    print(json.dumps({"benchmark": "copy_probe", "preset": args.preset, "steps": args.steps, "batch": args.batch,
                      "length": args.length, "vocab": args.vocab, "unseen": args.unseen, "unseen_noise": args.unseen_noise, "tie": args.tie, "lr": args.lr, "gdn_gate_z": args.gdn_gate_z, "gdn_dt_max": args.gdn_dt_max, "seeds": seeds,
                      "results": [{k: v for k, v in r.items() if k != "curve"} for r in results]}))


if __name__ == "__main__":
    main()
