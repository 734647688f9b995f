"""The training loop (`clover train`): AR pretraining, block-diffusion adaptation and SFT, on one
process or many (`torchrun`, DistributedDataParallel; gloo on CPU, nccl on GPU).

A run directory holds `train_config.json`, `log.jsonl` (train and eval records), `checkpoint/`
(model, optimizer and step, replaced atomically every `save_every` steps) and, at the end, `model/`
(the released weights with tokenizer). Every batch and every mask is a pure function of
(seed, step), so `--resume` continues exactly where the checkpoint left off: same data, same
noise, same loss curve.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from clover.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from clover.model.config import CloverConfig
from clover.model.files import json_lines, read_json, recover_directory, write_text_atomic
from clover.model.modeling import CloverForCausalLM, check_gdn_init
from clover.model.tokenizer import EOS_TOKEN, IM_END, Tokenizer
from clover.training.data import Batch, TokenData, check_kinds, require_data
from clover.training.objectives import ObjectiveConfig, compute_loss, eos_tails, noised_positions, sample_noise

INIT_ONLY = ("gdn_gate_z", "gdn_dt_max")   # TrainConfig fields read only when random weights are made


@dataclass
class TrainConfig:
    data: str                                  # data directory (from `clover data build`)
    out: str                                   # run directory
    init: str = "preset:tiny-wide"             # "preset:NAME" (random weights) or a checkpoint directory
    gdn_gate_z: float = 0.0                    # preset init only: GDN output gates opened to this mean z (0: off)
    gdn_dt_max: float = 0.0                    # preset init only: GDN decay steps log-uniform in [1e-3, this] (0: off)
    objective: str = "ar"                      # "ar" or "diffusion"
    sft: bool = False                          # score (and noise) assistant tokens only
    pack: bool = False                         # fill chat rows with several conversations
    pack_whole: bool = False                   # with pack: whole conversations only (a row's rest padded)
    mix: str = "code=0.5,english=0.3,chat=0.2"
    steps: int = 1000
    batch_size: int = 16                       # sequences per optimizer step, all ranks together
    grad_accum: int = 1
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    clip: float = 1.0
    dtype: str = "float32"                     # "float32" or "bfloat16" (autocast; fp32 master weights)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 200
    eval_batches: int = 4
    save_every: int = 200
    ar_loss_weight: float = 0.0
    loss_weighting: str = "elbo"
    complementary: bool = False
    mask_mode: str = "bernoulli"
    aux_loss_coef: float | None = None
    certainty_weight: float = 0.0
    eos_fill: bool = False                     # diffusion SFT: the noisy stream learns end-of-turn after a reply's end
    twin_coupling: float = 0.0                 # space twins' embedding and head rows share this much of their gradients
    compile: bool = False                      # torch.compile the forward (speed only: may change on --resume)

    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(self.objective, self.ar_loss_weight, self.loss_weighting, self.complementary,
                               self.mask_mode, aux_loss_coef=self.aux_loss_coef,
                               certainty_weight=self.certainty_weight, eos_fill=self.eos_fill)

    def mix_weights(self) -> dict[str, float]:
        try:
            pairs = [(k.strip(), float(v)) for k, v in (part.split("=") for part in self.mix.split(","))]
        except ValueError as exc:
            raise ValueError(f"mix must look like 'code=0.5,english=0.3,chat=0.2', got {self.mix!r}") from exc
        weights = dict(pairs)
        if len(weights) < len(pairs):
            raise ValueError(f"mix names a kind twice: {self.mix!r}")
        check_kinds(weights)
        if not all(0 <= w < math.inf for w in weights.values()) or not sum(weights.values()) > 0:
            raise ValueError(f"mix weights must be finite numbers >= 0, some of them positive, got {self.mix!r}")
        return weights

    def validate(self) -> None:
        self.objective_config().validate()
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "log_every", "eval_every", "eval_batches",
                     "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2 (a row predicts its tokens from the ones before), got {self.seq_len}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be a number in [0, 1], got {self.min_lr_ratio}")
        if not self.warmup >= 0:
            raise ValueError(f"warmup must be 0 or more steps, got {self.warmup}")
        if not 0 <= self.weight_decay < math.inf:   # NaN fails both comparisons
            raise ValueError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not self.clip > 0:
            raise ValueError(f"clip (the gradient-norm limit; inf: none) must be a positive number, got {self.clip}")
        if self.aux_loss_coef is not None and not 0 <= self.aux_loss_coef < math.inf:
            raise ValueError(f"aux_loss_coef must be a finite number >= 0, got {self.aux_loss_coef}")
        if not 0 <= self.twin_coupling < math.inf:
            raise ValueError(f"twin_coupling must be a finite number >= 0, got {self.twin_coupling}")
        if self.pack_whole and not self.pack:
            raise ValueError("pack_whole keeps packed conversations whole: it needs pack")
        if self.eos_fill and not self.sft:   # (without SFT every position is eligible: no reply has an end)
            raise ValueError("eos_fill trains the positions after a reply's end: it needs sft")
        check_gdn_init(self.gdn_gate_z, self.gdn_dt_max)
        if (self.gdn_gate_z or self.gdn_dt_max) and not self.init.startswith("preset:"):
            raise ValueError("gdn_gate_z and gdn_dt_max shape random weights: they need init preset:NAME, not the "
                             f"checkpoint {self.init}")
        self.mix_weights()


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr; `step` counts from 1."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(cfg.warmup, 1)
    progress = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class _LossModule(nn.Module):
    """The model with the loss as its forward, so DistributedDataParallel sees every step."""

    def __init__(self, model: CloverForCausalLM, objective: ObjectiveConfig) -> None:
        super().__init__()
        self.model, self.objective = model, objective

    def forward(self, ids: torch.Tensor, eligible: torch.Tensor, lengths: torch.Tensor, noises: list | None,
                denominators: dict[str, float], tails: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        return compute_loss(self.model, ids, eligible, lengths, self.objective, noises, denominators, tails)


@dataclass
class _Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0


def _setup_distributed() -> _Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return _Dist()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    return _Dist(rank, world, device)


def _same_path(saved: str, now: str, saved_cwd: str | None) -> bool:
    """Whether a path setting of a saved run and today's name the same directory (not a `preset:` name). A saved
    relative path is taken from the directory the run was started in (`saved_cwd`, kept in its trainer state since
    2026-12-07), so a run resumed from elsewhere may name its data another way, or from today's (a project that
    moved, or an older state)."""
    if saved.startswith("preset:") or now.startswith("preset:"):
        return False
    bases = {Path.cwd()} | ({Path(saved_cwd)} if saved_cwd is not None else set())
    return Path(now).resolve() in {(base / saved).resolve() for base in bases}   # (an absolute `saved` ignores them)


RUN_FILES = ("train_config.json", "log.jsonl", "checkpoint", "model", "DONE")   # what a run (and make_model.sh) writes


def _check_fresh_out(out: Path, data: Path) -> None:
    """A fresh run writes its files into --out: refuse one inside the data directory, or one that holds files a
    run does not write (a user's train_config.json was overwritten, their other files kept beside a run's)."""
    out_r, data_r = out.resolve(), data.resolve()
    if out_r == data_r or data_r in out_r.parents:
        raise ValueError(f"--out {out} is inside --data {data}: write the run elsewhere")
    if not out.is_dir():
        return
    others = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES and not p.name.startswith("."))
    if others:
        raise ValueError(f"{out} holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}, which a training "
                         "run does not write: choose an empty or new --out")
    try:   # a train_config.json of ours: a run that stopped before its log (else it is someone's own file)
        saved = read_json(out / "train_config.json")
        ours = isinstance(saved, dict) and isinstance(saved.get("data"), str)
    except FileNotFoundError:
        ours = True
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ValueError(f"{out}/train_config.json is not a training run's settings: choose an empty or new --out")


def _build_model(cfg: TrainConfig, tokenizer: Tokenizer, device: torch.device) -> CloverForCausalLM:
    if cfg.init.startswith("preset:"):
        config = CloverConfig.preset(cfg.init.split(":", 1)[1], mask_token_id=tokenizer.mask_token_id,
                                     eos_token_id=tokenizer.eos_token_ids)
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens, the preset only {config.vocab_size}")
        return CloverForCausalLM.from_scratch(config, cfg.seed, cfg.gdn_gate_z, cfg.gdn_dt_max).to(device)
    model = load_checkpoint(cfg.init, dtype="float32", device=device)
    tokenizer.check_model(cfg.init, model.config.vocab_size, f"the data in {cfg.data}")
    if model.config.mask_token_id != tokenizer.mask_token_id:   # diffusion would mask with an ordinary token
        raise ValueError(f"{cfg.init}: config.json mask_token_id {model.config.mask_token_id} is not the mask token "
                         f"of the data's tokenizer ({tokenizer.mask_token_id}); convert the source again without "
                         "--mask-token-id, or set mask_token_id in config.json to the tokenizer's")
    return model


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (betas 0.9 / 0.95), weight decay on the matrices only; torch's fused kernel where the parameters'
    device has one (on 2 idle AVX2 cores a step of tiny-wide's 13M parameters took 16 ms against 52-55 ms for the
    multi-tensor one: ~1% of an AR training step at 8 x 512; weights equal to 1e-8 after 5 steps;
    docs/measurements.md, session 40). Its state is the same either way, so a run may resume on a device with or
    without it."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    # (torch checks a fused optimizer's devices only at its first step: the devices it has kernels for since 2.4)
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in decay + rest)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused or None)


def couple_twins(model: CloverForCausalLM, pairs: torch.Tensor, alpha: float) -> None:
    """Add `alpha` times each pair's summed gradient to both rows of the pair, in the embedding and the LM head
    (`pairs` [P, 2]: `Tokenizer.space_twins`). Under plain gradient descent this trains `row = own + shared`
    with a `shared` part per pair (alpha 1: at the same rate as the own parts): whatever the model learns to
    read from `Oth` or write as `Oth` (copying it, above all) it learns for ` Oth` too. Under AdamW it is that
    only roughly, and it comes before the gradient-norm clip, whose norm it raises. The weights keep their
    shape: nothing to fold at save time, and the checkpoint loads anywhere."""
    if alpha == 0 or pairs.numel() == 0:
        return
    seen: set[int] = set()
    for w in (model.model.embed_tokens.weight, model.lm_head.weight):
        if w.grad is None or id(w) in seen:   # tied embeddings: one matrix
            continue
        seen.add(id(w))
        g = w.grad
        shared = (g[pairs[:, 0]] + g[pairs[:, 1]]) * alpha
        g.index_add_(0, pairs[:, 0], shared)
        g.index_add_(0, pairs[:, 1], shared)


class _Progress:
    def __init__(self, total: int, start: int) -> None:
        self.total, self.start, self.t0 = total, start, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def show(self, step: int, loss: float | None, tokens_per_s: float) -> None:
        """`loss` is None for a logging window without scored tokens (SFT rows whose window holds no
        assistant token)."""
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / max(done, 1) * (self.total - step)
        shown = "-" if loss is None else f"{loss:.4f}"
        line = (f"step {step}/{self.total} | loss {shown} | {tokens_per_s:,.0f} tok/s | "
                f"ETA {int(eta // 3600):d}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def _eligible(batch: Batch, sft: bool) -> torch.Tensor:
    valid = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    return (batch.loss_mask & valid) if sft else valid


def _reduce(sums: dict[str, float], d: _Dist) -> dict[str, float]:
    if d.world == 1:
        return sums
    keys = sorted(sums)
    t = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=d.device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist(), strict=True))


def _metrics(sums: dict[str, float]) -> dict[str, float]:
    out = {}
    if sums.get("ar_targets"):
        out["ar_loss"] = sums["ar_ce_sum"] / sums["ar_targets"]
    if sums.get("tokens"):
        out["diffusion_loss"] = sums["diffusion_loss_sum"] / sums["tokens"]
        out["masked_ce"] = sums["masked_ce_sum"] / max(sums["masked"], 1)
    if "masked_right" in sums:   # certainty forcing: how often a masked token is guessed right, and how surely
        out["masked_accuracy"] = sums["masked_right"] / max(sums["masked"], 1)
        out["certainty_entropy"] = sums["certainty_entropy_sum"] / max(sums["masked_right"], 1)
    if "aux_sum" in sums and sums.get("rows"):
        out["aux_loss"] = sums["aux_sum"] / sums["rows"]
    return out


def _run_batch(module: nn.Module, batch: Batch, cfg: TrainConfig, step: int, d: _Dist, block_size: int,
               train: bool, autocast: torch.autocast | None, end_id: int = -1) -> dict[str, float]:
    """Forward (and backward when training) over this rank's share of a global batch. `end_id`: the token
    that ends a reply (`<|im_end|>`, for `eos_fill`)."""
    obj = cfg.objective_config()
    eligible = _eligible(batch, cfg.sft)
    tails = eos_tails(batch.ids, eligible, batch.lengths, block_size, end_id) if obj.eos_fill else None
    noised = noised_positions(eligible, tails)
    gen = torch.Generator().manual_seed((cfg.seed * 7_000_003 + step * 2 + (0 if train else 1)) % 2**62)
    noises = sample_noise(noised, block_size, obj, gen) if obj.kind == "diffusion" else None
    denominators = {"tokens": float(noised.sum()), "ar_targets": float(eligible[:, 1:].sum()),
                    "rows": float(batch.ids.shape[0])}
    rows = torch.arange(d.rank, cfg.batch_size, d.world)  # this rank's rows of the global batch
    # (a rank with fewer rows than grad_accum has empty micro-batches: the gradients are all-reduced in the
    # backward of its last non-empty one, so that every rank joins the all-reduce exactly once)
    micro = [idx for idx in rows.tensor_split(cfg.grad_accum) if idx.numel()]
    total: dict[str, float] = {}
    for i, idx in enumerate(micro):
        part_noise = None if noises is None else [type(n)(n.masked[idx], n.t[idx]) for n in noises]
        sync = (not train) or i == len(micro) - 1 or not isinstance(module, nn.parallel.DistributedDataParallel)
        ctx = module.no_sync() if not sync else nullcontext()
        with ctx, (autocast or nullcontext()):
            loss, sums = module(batch.ids[idx].to(d.device), eligible[idx].to(d.device), batch.lengths[idx].to(d.device),
                                None if part_noise is None else [type(n)(n.masked.to(d.device), n.t.to(d.device))
                                                                 for n in part_noise], denominators,
                                None if tails is None else tails[idx].to(d.device))
        if train:
            (loss * d.world).backward()  # DDP averages over ranks; the denominators are global
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + v
    total["rows"] = float(rows.numel())
    return total


def saved_settings(out: str | Path) -> dict:
    """The settings of the run in directory `out` (its train_config.json, written when a sitting starts, after
    the settings were checked against its checkpoint's), or {} where it has none: what `--resume` continues
    with where the command line does not say. Keys this version does not know are left out (`train` then
    compares the checkpoint's own); a value of the wrong type is an error naming it."""
    path = Path(out) / "train_config.json"
    state = Path(out) / "checkpoint" / "trainer_state.pt"
    if not path.is_file():   # (removed, or lost: the checkpoint's own settings, else a list of settings the user
        if not state.is_file():   # never gave came back as "changed")
            return {}
        saved = _read_state(state)["config"]
        path = state
    else:
        try:
            saved = read_json(path)
        except ValueError as exc:   # (not UTF-8, not JSON, nested too deeply: named by read_json)
            raise ValueError(f"not a settings file: {exc}") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path}: not a settings file (a JSON object)")
    defaults = TrainConfig(data="", out="")
    settings = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in saved:
            continue
        value, default = saved[f.name], getattr(defaults, f.name)
        want = (bool,) if isinstance(default, bool) else (int,) if isinstance(default, int) else \
            (int, float) if isinstance(default, float) or f.name == "aux_loss_coef" else (str,)
        if not (isinstance(value, want) and (bool in want or not isinstance(value, bool))) and not (
                value is None and f.name == "aux_loss_coef"):
            raise ValueError(f"{path}: {f.name} must be {' or '.join(t.__name__ for t in want)}, got {value!r}")
        settings[f.name] = value
    return settings


def train(cfg: TrainConfig, resume: bool = False) -> dict:
    """Run (or continue) a training run. Returns the last logged record."""
    cfg.validate()
    d = _setup_distributed()
    try:
        return _train(cfg, resume, d)
    finally:
        if d.world > 1:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, resume: bool, d: _Dist) -> dict:
    if cfg.batch_size < d.world:   # (every rank raises it: none waits for the others' gradients)
        raise ValueError(f"batch_size {cfg.batch_size} gives no rows to some of the {d.world} processes: use at least "
                         "one row per process")
    out = Path(cfg.out)
    tokenizer = Tokenizer.load(require_data(cfg.data) / "tokenizer")
    ckpt = out / "checkpoint"
    start = 0
    state = None
    if resume and d.main:
        recover_directory(ckpt)   # a run killed between the two renames of a checkpoint swap
    if d.world > 1:
        dist.barrier()
    if resume and (ckpt / "trainer_state.pt").is_file():
        state = _read_state(ckpt / "trainer_state.pt")
        # init-only settings shape the random weights and nothing after; a resumed run keeps the saved ones
        # (runs older than a setting made their weights without it: 0)
        saved = TrainConfig(**{**{name: 0.0 for name in INIT_ONLY}, **state["config"]})
        cfg = dataclasses.replace(cfg, **{name: getattr(saved, name) for name in INIT_ONLY})
        # (a run directory may move: `out` is where it is now; a path is the same one spelt another way too,
        # e.g. with a trailing slash or through a link)
        changed = [f.name for f in dataclasses.fields(cfg)
                   if f.name not in ("steps", "out", "compile") and getattr(saved, f.name) != getattr(cfg, f.name)
                   and not (f.name in ("data", "init")
                            and _same_path(getattr(saved, f.name), getattr(cfg, f.name), state.get("cwd")))]
        if changed:
            raise ValueError(f"--resume with different settings than the run in {out} ("
                             + ", ".join(f"{k}: {getattr(saved, k)!r} there, {getattr(cfg, k)!r} now" for k in changed)
                             + "); only --steps and --compile may change")
        if state["step"] > cfg.steps:
            raise ValueError(f"the run in {out} is at step {state['step']}, past --steps {cfg.steps}")
        if state["step"] == cfg.steps and _model_after(out / "model", ckpt):   # finished: nothing to do
            if d.main:
                print(f"the run in {out} finished at step {cfg.steps} (its model: {out / 'model'}); nothing to "
                      "do: pass a larger --steps to train on", file=sys.stderr)
            return _last_record(out / "log.jsonl", "train")
        model = load_checkpoint(ckpt, dtype="float32", device=d.device)
        # the data may have been rebuilt since (with another tokenizer): its ids would read as other tokens, and the
        # finished model would carry that tokenizer
        tokenizer.check_model(ckpt, model.config.vocab_size, f"the data in {cfg.data}")
        start = state["step"]
    elif resume:
        early = (out / "log.jsonl").exists() and not (out / "model").exists()
        raise CheckpointError(f"nothing to resume: {ckpt} holds no complete checkpoint"
                              + (f" (the run in {out} stopped before its first one, every --save-every steps: "
                                 f"remove {out} to start it again)" if early else ""))
    else:
        held = [name for name in ("log.jsonl", "checkpoint", "model") if (out / name).exists()]
        if held and d.main:   # a fresh run would replace them
            if held == ["log.jsonl"]:
                raise ValueError(f"{out} holds a run that stopped before its first checkpoint (log.jsonl only): "
                                 f"remove {out} to start it again, or choose another --out")
            raise ValueError(f"{out} already holds a run ({', '.join(held)}); pass --resume to continue it or choose "
                             "another --out")
        _check_fresh_out(out, Path(cfg.data))
        model = _build_model(cfg, tokenizer, d.device)
    if cfg.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's context of {model.config.max_position_embeddings} "
                         "tokens (max_position_embeddings)")
    model.train()
    if cfg.compile:   # (the layer stack, inside the DDP wrapper: DDP's hooks see the gradients as eager ones)
        model.compile_training()
    optimizer = make_optimizer(model, cfg)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    module: nn.Module = _LossModule(model, cfg.objective_config())
    if d.world > 1:
        module = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16) if cfg.dtype == "bfloat16" else None
    eos = tokenizer.special_ids[EOS_TOKEN]
    data = TokenData(cfg.data, "train", cfg.mix_weights(), eos, cfg.pack, cfg.pack_whole, tokenizer.vocab_size)
    val = TokenData(cfg.data, "val", cfg.mix_weights(), eos, cfg.pack, cfg.pack_whole, tokenizer.vocab_size)
    if cfg.sft and data.chat is not None and not data.chat[1].any():   # (every step's loss would be empty)
        raise ValueError(f"{data.paths['chat']} marks no assistant tokens: --sft would score nothing")
    block = model.config.block_size
    end_id = tokenizer.special_ids[IM_END] if cfg.eos_fill else -1   # (the end of a chat reply)
    twins = torch.tensor(tokenizer.space_twins() if cfg.twin_coupling else [], dtype=torch.long,
                         device=d.device).view(-1, 2)
    if cfg.twin_coupling and not len(twins):
        raise ValueError(f"twin_coupling: the tokenizer of {cfg.data} has no space twins (tokens one leading space "
                         "apart) to couple")
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        _truncate_log(out / "log.jsonl", start)
    progress = _Progress(cfg.steps, start) if d.main else None
    record: dict = {}
    t_last, tokens_since = time.perf_counter(), 0
    for step in range(start + 1, cfg.steps + 1):
        lr = lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = data.batch(cfg.seed, step, cfg.batch_size, cfg.seq_len)
        sums = _reduce(_run_batch(module, batch, cfg, step, d, block, True, autocast, end_id), d)
        couple_twins(model, twins, cfg.twin_coupling)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens_since += int(batch.lengths.sum())
        if step % cfg.log_every == 0 or step == cfg.steps:
            now = time.perf_counter()
            record = {"step": step, "kind": "train", "lr": lr, "grad_norm": grad_norm, **_metrics(sums),
                      "tokens_per_s": tokens_since / (now - t_last), "tokens_seen": step * cfg.batch_size * cfg.seq_len}
            record["loss"] = record.get("diffusion_loss", record.get("ar_loss"))
            t_last, tokens_since = now, 0
            if d.main:
                _append_log(out / "log.jsonl", record)
                progress.show(step, record["loss"], record["tokens_per_s"])
        if step % cfg.eval_every == 0 or step == cfg.steps:
            model.eval()
            with torch.no_grad():
                ev: dict[str, float] = {}
                for i in range(cfg.eval_batches):
                    vb = val.batch(cfg.seed + 1_000_000, i, cfg.batch_size, cfg.seq_len)
                    for k, v in _run_batch(module, vb, cfg, 10**9 + i, d, block, False, autocast, end_id).items():
                        ev[k] = ev.get(k, 0.0) + v
            model.train()
            rec = {"step": step, "kind": "eval", **_metrics(_reduce(ev, d))}
            if d.main:
                _append_log(out / "log.jsonl", rec)
        if step % cfg.save_every == 0 or step == cfg.steps:
            if d.main:
                _save(model, optimizer, cfg, step, ckpt, tokenizer)
            if d.world > 1:
                dist.barrier()
    if progress:
        progress.close()
    if d.main:
        final = out / "model"
        save_checkpoint(model, final, extra_files=tokenizer.files())
    return record or _last_record(out / "log.jsonl", "train")   # (resumed at its last step: the model written)


def _save(model: CloverForCausalLM, optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int, ckpt: Path,
          tokenizer: Tokenizer) -> None:
    buf = io.BytesIO()
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "config": dataclasses.asdict(cfg),
                "cwd": os.getcwd()}, buf)   # (what the config's relative paths are relative to)
    save_checkpoint(model, ckpt, extra_files={"trainer_state.pt": buf.getvalue(), **tokenizer.files()})


def _read_state(path: Path) -> dict:
    """A checkpoint's trainer state (step, optimizer state, settings), checked before anything is run."""
    try:  # tensors, numbers, strings and containers only: a crafted file cannot run code
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        crafted = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]   # code it would call
        if not crafted:
            raise CheckpointError(f"{path} is cut short or corrupt (not a pickle torch.load reads)") from None
        raise CheckpointError(f"{path} holds more than optimizer state and settings (refused, nothing was run): "
                              f"{crafted[0]}") from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        # (text that is no zip archive goes to the legacy unpickler, which fails in many ways: `junk` is a KeyError)
        raise CheckpointError(f"{path} is cut short or corrupt: {str(exc).splitlines()[0] if str(exc) else exc!r}") \
            from None
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    if not isinstance(state, dict) or not isinstance(state.get("optimizer"), dict) \
            or not isinstance(state.get("config"), dict) or type(state.get("step")) is not int or state["step"] < 0:
        raise CheckpointError(f"{path} is not a trainer state of `clover train` (step, optimizer, config)")
    if not isinstance(state.get("cwd", ""), str):
        raise CheckpointError(f"{path}: its working directory is not a path ({state['cwd']!r})")
    unknown = sorted(set(state["config"]) - fields)
    if unknown:
        raise CheckpointError(f"{path} has settings this version of Clover does not know: {unknown}")
    return state


def _append_log(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _model_after(model: Path, ckpt: Path) -> bool:
    """Whether the run's model was written after its checkpoint, as a finished run's is (a model from before
    the checkpoint is an older finish of a run extended since, with --steps raised, and killed before its end)."""
    try:
        return (model / "config.json").stat().st_mtime_ns >= (ckpt / "trainer_state.pt").stat().st_mtime_ns
    except OSError:
        return False


def _last_record(path: Path, kind: str) -> dict:
    """The last record of `kind` in a run's log ({} where there is none)."""
    last: dict = {}
    if path.exists():
        for _, record in json_lines(path):
            if isinstance(record, dict) and record.get("kind") == kind:
                last = record
    return last


def _truncate_log(path: Path, step: int) -> None:
    """Keep the records up to `step` (a resumed run rewrites what followed its checkpoint; a partial
    record a kill left is dropped)."""
    if not path.exists():
        return
    keep = []
    for line, record in json_lines(path):
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path} holds a line that is not a training record ({line[:80]!r}); fix or remove it")
        if record["step"] <= step:
            keep.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in keep))
