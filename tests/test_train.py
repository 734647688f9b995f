"""Training: objectives, SFT masking, exact resume after a kill, torchrun equivalence, checkpoints, data."""

import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.cli.commands import main as cli_main
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import IM_END, Tokenizer, TokenizerError, stdlib_sources
from clover.training import objectives, recall_data, synthetic
from clover.training.data import SPLITS, TokenData, chat_example, encode_corpus, require_data, split_of
from clover.training.objectives import ObjectiveConfig, compute_loss, linear_cross_entropy, sample_noise
from clover.training.trainer import TrainConfig, lr_at, make_optimizer, train


def _plain_cross_entropy(hidden, weight, targets, row_weights=None):
    logits = torch.nn.functional.linear(hidden, weight)
    ce = torch.nn.functional.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets,
                                           reduction="none")
    return (ce * row_weights).sum() if row_weights is not None else ce.sum(), ce


@pytest.mark.parametrize("weighted", [False, True])
def test_linear_cross_entropy_equals_the_plain_loss_and_gradients(monkeypatch, weighted):
    """The chunked loss with its gradients computed in the forward is F.cross_entropy over F.linear's logits:
    float64 to rounding, over several chunks and a ragged last one, scaled by the gradient that reaches it."""
    monkeypatch.setattr(objectives, "LCE_CHUNK_ELEMENTS", 3 * 50)   # 3 rows of a 50-token vocabulary a chunk
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=gen, dtype=torch.float64) * 3
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (11,), generator=gen)
    rows = torch.rand(11, generator=gen, dtype=torch.float64) * 4 if weighted else None
    got, want = [], []
    for fn, out in ((linear_cross_entropy, got), (_plain_cross_entropy, want)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        total, ce = fn(h, w, targets, rows)
        (2.5 * total).backward()
        out.extend([total.detach(), ce.detach().double(), h.grad, w.grad])
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a, b)
    with torch.no_grad():   # no gradients asked for: none computed, the same loss
        assert torch.allclose(linear_cross_entropy(hidden, weight, targets, rows)[0], want[0], rtol=1e-12)
    empty, ce = linear_cross_entropy(hidden[:0].requires_grad_(), weight, targets[:0])
    empty.backward()
    assert float(empty.detach()) == 0 and ce.shape == (0,)


def test_linear_cross_entropy_under_bfloat16_autocast_multiplies_as_linear_does():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=gen)
    weight = torch.randn(64, 32, generator=gen) / 4
    targets = torch.randint(0, 64, (40,), generator=gen)
    grads = []
    for fn in (linear_cross_entropy, _plain_cross_entropy):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, ce = fn(h, w, targets)
        total.backward()
        grads.append((total.detach(), ce.detach(), h.grad, w.grad))
    (t1, c1, h1, w1), (t2, c2, h2, w2) = grads
    assert t1.dtype == t2.dtype == torch.float32 and torch.allclose(c1, c2, rtol=1e-5)   # the same bf16 products
    assert torch.allclose(h1, h2, rtol=2e-2, atol=2e-3) and torch.allclose(w1, w2, rtol=2e-2, atol=2e-3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small data directory in the layout `clover data build` writes (no download needed)."""
    out = tmp_path_factory.mktemp("data")
    code = [text for _, text in itertools.islice(stdlib_sources(), 12)]
    import pydoc_data.topics

    english = list(pydoc_data.topics.topics.values())[:12]
    for split in SPLITS:
        (out / "raw" / split).mkdir(parents=True)
        for kind, docs in (("code", code), ("english", english)):
            with open(out / "raw" / split / f"{kind}.jsonl", "w") as f:
                for i, text in enumerate(docs):
                    f.write(json.dumps({"source": kind, "name": str(i), "text": text}) + "\n")
        with open(out / "raw" / split / "chat.jsonl", "w") as f:
            for task in synthetic.tasks(split, 25):
                f.write(json.dumps({"messages": task.messages, "tools": task.tools}) + "\n")
        with open(out / "raw" / split / "recall.jsonl", "w") as f:
            for i, text in enumerate(recall_data.documents(split, 20)):
                f.write(json.dumps({"source": "synthetic-recall", "name": str(i), "text": text}) + "\n")
    tokenizer = Tokenizer.train(code + english, vocab_size=512)
    tokenizer.save(out / "tokenizer")
    encode_corpus(out, tokenizer)
    return out


def _cfg(data_dir, out, **kw):
    base = dict(data=str(data_dir), out=str(out), init="preset:debug", steps=6, batch_size=4, seq_len=32,
                log_every=1, eval_every=3, eval_batches=1, save_every=3, lr=3e-3, warmup=2)
    return TrainConfig(**{**base, **kw})


def _fixed_batch(data_dir, sft=False):
    tok = Tokenizer.load(data_dir / "tokenizer")
    data = TokenData(data_dir, "train", {"chat": 1.0} if sft else {"code": 0.5, "english": 0.5}, 0)
    model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=tok.mask_token_id,
                                                  eos_token_id=tok.eos_token_ids))
    return model, data.batch(0, 1, 4, 640 if sft else 32)  # tool prompts run to ~480 tokens here


@pytest.mark.parametrize("objective", [
    ObjectiveConfig("ar"),
    ObjectiveConfig("diffusion"),
    ObjectiveConfig("diffusion", ar_loss_weight=0.5, complementary=True, mask_mode="exact", loss_weighting="none"),
])
@pytest.mark.parametrize("sft", [False, True])
def test_one_step_of_each_objective_lowers_the_loss_on_a_fixed_batch(data_dir, objective, sft):
    model, batch = _fixed_batch(data_dir, sft)
    valid = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    eligible = batch.loss_mask & valid if sft else valid
    assert eligible.sum() > 20
    noises = sample_noise(eligible, 8, objective, torch.Generator().manual_seed(0)) if objective.kind != "ar" else None
    den = {"tokens": float(eligible.sum()), "ar_targets": float(eligible[:, 1:].sum()), "rows": 4.0}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, _ = compute_loss(model, batch.ids, eligible, batch.lengths, objective, noises, den)
    before.backward()
    opt.step()
    with torch.no_grad():
        after, _ = compute_loss(model, batch.ids, eligible, batch.lengths, objective, noises, den)
    assert float(after) < float(before.detach()) - 1e-3


def test_certainty_forcing_adds_the_entropy_of_right_guesses_and_training_lowers_it(data_dir):
    """The certainty term is w * (entropy summed over masked positions whose argmax is the target) / tokens;
    checked against a computation from the model's noisy logits, then trained on: a few steps with a large
    weight sharpen the right guesses more than the same steps without it."""
    model, batch = _fixed_batch(data_dir)
    eligible = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    base = ObjectiveConfig("diffusion")
    forced = ObjectiveConfig("diffusion", certainty_weight=2.0)
    noises = sample_noise(eligible, 8, base, torch.Generator().manual_seed(0))
    den = {"tokens": float(eligible.sum()), "ar_targets": float(eligible[:, 1:].sum()), "rows": 4.0}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):   # past random guessing, so that some masked tokens are guessed right
        opt.zero_grad()
        compute_loss(model, batch.ids, eligible, batch.lengths, base, noises, den)[0].backward()
        opt.step()

    def entropy_of_right(m):
        noisy = torch.where(noises[0].masked, torch.full_like(batch.ids, m.config.mask_token_id), batch.ids)
        out = m.training_forward(batch.ids, noisy, batch.lengths, output="hidden")
        logits = m.lm_head(out.noisy[noises[0].masked]).float()
        right = logits.argmax(-1) == batch.ids[noises[0].masked]
        p = logits[right].softmax(-1)
        return float(torch.special.entr(p).sum()), int(right.sum())

    with torch.no_grad():
        plain, _ = compute_loss(model, batch.ids, eligible, batch.lengths, base, noises, den)
        loss, sums = compute_loss(model, batch.ids, eligible, batch.lengths, forced, noises, den)
        entropy, right = entropy_of_right(model)
    assert right > 0 and sums["masked_right"] == right
    assert sums["certainty_entropy_sum"] == pytest.approx(entropy, rel=1e-5)
    assert float(loss - plain) == pytest.approx(2.0 * entropy / den["tokens"], rel=1e-4)
    both = sample_noise(eligible, 8, ObjectiveConfig("diffusion", complementary=True), torch.Generator().manual_seed(1))
    with torch.no_grad():   # two noisy copies: the term is normalised by both copies' tokens, like the ELBO
        plain2, _ = compute_loss(model, batch.ids, eligible, batch.lengths, ObjectiveConfig("diffusion", complementary=True),
                                 both, den)
        loss2, sums2 = compute_loss(model, batch.ids, eligible, batch.lengths,
                                    ObjectiveConfig("diffusion", complementary=True, certainty_weight=2.0), both, den)
    assert sums2["masked_right"] > 0
    assert float(loss2 - plain2) == pytest.approx(2.0 * sums2["certainty_entropy_sum"] / (2 * den["tokens"]), rel=1e-4)

    import copy

    sharpened = {}
    for cfg in (base, forced):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(3):
            opt.zero_grad()
            compute_loss(m, batch.ids, eligible, batch.lengths, cfg, noises, den)[0].backward()
            opt.step()
        with torch.no_grad():
            e, r = entropy_of_right(m)
        sharpened[cfg.certainty_weight] = e / max(r, 1)
    assert sharpened[2.0] < sharpened[0.0]
    with pytest.raises(ValueError):
        ObjectiveConfig("diffusion", certainty_weight=-1.0).validate()


def test_eos_tails_fill_a_block_after_a_reply_ends_unless_another_reply_starts_in_it():
    """Block 8, end-of-turn token E = 2: after a reply's eligible E, the rest of its block (its own new line
    included) gets E; a block where the next reply starts, an E in the block's last slot, an E that is not
    eligible and positions past the row's length get nothing; nor does the end-of-text token 0 between the
    documents of a row eligible throughout (SFT's code and English rows)."""
    from clover.training.objectives import eos_tails

    E, NL = 2, 9
    ids = torch.tensor([[5, 5, 5, 7, 7, E, NL, 5, 5, 5, 5, 5, 5, 5, 7, E],     # a reply ending at 5, another at 15
                        [5, 5, 7, E, NL, 5, 7, 7, E, 5, 5, 5, 5, 5, 5, 5],      # the next reply starts at 6, same block;
                        [5, 7, E, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5],       # an E at 8 not eligible; length 5
                        [5, 5, 5, 0, 5, 5, 5, 5, 5, 5, 0, 5, 5, 5, 5, 5]])      # documents, eligible throughout
    eligible = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1],
                             [0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
                             [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                             [1] * 16], dtype=torch.bool)
    lengths = torch.tensor([16, 16, 5, 16])
    got = eos_tails(ids, eligible, lengths, 8, E)
    want = torch.full_like(ids, -1)
    want[0, 6:8] = E
    want[2, 3:5] = E
    assert torch.equal(got, want)
    want = torch.full_like(ids, -1)   # blocks of 4: row 1's E at 3 is its block's last slot
    want[0, 6:8] = E
    want[2, 3] = E
    assert torch.equal(eos_tails(ids, eligible, lengths, 4, E), want)


def test_eos_fill_trains_the_noisy_stream_on_the_tail_and_leaves_the_rest(data_dir):
    """compute_loss with tails: the noisy stream's input and targets are the tail's token there (those positions
    noised and counted like eligible ones), the clean stream and the AR loss keep the row; checked against a
    direct computation from the model; no tail gives exactly the plain loss."""
    from clover.training.objectives import eos_tails

    model, batch = _fixed_batch(data_dir, sft=True)
    tok = Tokenizer.load(data_dir / "tokenizer")
    valid = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    eligible = batch.loss_mask & valid
    tails = eos_tails(batch.ids, eligible, batch.lengths, 8, tok.special_ids[IM_END])
    assert (tails >= 0).sum() > 4 and (eligible & (tails >= 0)).any()   # (the reply's own new line after its end)
    noised = eligible | (tails >= 0)
    cfg = ObjectiveConfig("diffusion", ar_loss_weight=0.5, eos_fill=True)
    noises = sample_noise(noised, 8, cfg, torch.Generator().manual_seed(0))
    masked = noises[0].masked
    assert (masked & (tails >= 0)).sum() > 0
    den = {"tokens": float(noised.sum()), "ar_targets": float(eligible[:, 1:].sum()), "rows": 4.0}
    model.config.router_aux_loss_coef = 0.0
    with torch.no_grad():
        loss, sums = compute_loss(model, batch.ids, eligible, batch.lengths, cfg, noises, den, tails)
        x0 = torch.where(tails >= 0, tails, batch.ids)
        noisy = torch.where(masked, torch.full_like(x0, model.config.mask_token_id), x0)
        out = model.training_forward(batch.ids, noisy, batch.lengths, output="logits")
        ce = torch.nn.functional.cross_entropy(out.noisy[masked].float(), x0[masked], reduction="none")
        elbo = float((ce / noises[0].t[masked]).sum()) / den["tokens"]
        ar = torch.nn.functional.cross_entropy(out.clean[:, :-1][eligible[:, 1:]].float(), batch.ids[:, 1:][eligible[:, 1:]],
                                               reduction="sum")
        assert float(loss) == pytest.approx(elbo + 0.5 * float(ar) / den["ar_targets"], rel=1e-4)
        assert sums["tokens"] == int(noised.sum()) and sums["ar_targets"] == int(eligible[:, 1:].sum())
        none = torch.full_like(tails, -1)
        plain = compute_loss(model, batch.ids, eligible, batch.lengths, cfg, noises, den)[0]
        assert float(compute_loss(model, batch.ids, eligible, batch.lengths, cfg, noises, den, none)[0]) == float(plain)
    with pytest.raises(ValueError, match="only apply to the diffusion objective"):
        ObjectiveConfig("ar", eos_fill=True).validate()


def test_eos_fill_needs_sft_and_reaches_the_trainer(data_dir, tmp_path):
    with pytest.raises(ValueError, match="eos_fill trains the positions after a reply's end: it needs sft"):
        _cfg(data_dir, tmp_path / "x", objective="diffusion", eos_fill=True).validate()
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=2, eval_every=2, save_every=2, objective="diffusion", sft=True, eos_fill=True,
               mix="chat=1.0", seq_len=640, batch_size=2))
    assert json.loads((run / "train_config.json").read_text())["eos_fill"] is True


def test_certainty_weight_reaches_the_trainer_and_its_log(data_dir, tmp_path):
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=2, eval_every=2, save_every=2, objective="diffusion", certainty_weight=1.0))
    for kind in ("train", "eval"):
        last = _records(run, kind)[-1]
        assert 0 <= last["masked_accuracy"] <= 1 and last["certainty_entropy"] >= 0
    assert json.loads((run / "train_config.json").read_text())["certainty_weight"] == 1.0


def test_twin_coupling_of_tied_embeddings_couples_the_one_matrix_once(data_dir):
    from clover.training.trainer import couple_twins
    tok = Tokenizer.load(data_dir / "tokenizer")
    pairs = torch.tensor(tok.space_twins())
    model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=tok.mask_token_id, vocab_size=tok.vocab_size,
                                                  tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    g = torch.randn_like(model.lm_head.weight)
    model.lm_head.weight.grad = g.clone()
    couple_twins(model, pairs, 1.0)
    shared = g[pairs[:, 0]] + g[pairs[:, 1]]
    torch.testing.assert_close(model.lm_head.weight.grad[pairs[:, 0]], g[pairs[:, 0]] + shared)


def test_twin_coupling_reaches_the_trainer(data_dir, tmp_path):
    """One step with and without the coupling (no clipping, so the other gradients are the same): only paired
    rows of the embedding and the LM head differ."""
    from clover.model.checkpoint import load_checkpoint
    models = {}
    for alpha in (0.0, 1.0):
        train(_cfg(data_dir, tmp_path / str(alpha), steps=1, clip=math.inf, twin_coupling=alpha))
        models[alpha] = load_checkpoint(tmp_path / str(alpha) / "model", dtype="float32").state_dict()
    paired = torch.zeros(models[0.0]["lm_head.weight"].shape[0], dtype=torch.bool)
    paired[torch.tensor(Tokenizer.load(data_dir / "tokenizer").space_twins()).flatten()] = True
    for name, before in models[0.0].items():
        differs = (before != models[1.0][name]).reshape(max(before.dim() and before.shape[0], 1), -1).any(1)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert differs[paired].any() and not differs[~paired].any(), name
        else:
            assert not differs.any(), name
    assert json.loads((tmp_path / "1.0" / "train_config.json").read_text())["twin_coupling"] == 1.0


def test_twin_coupling_without_twins_is_refused(data_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(Tokenizer, "space_twins", lambda self: [])   # as a tokenizer that isolates spaces
    with pytest.raises(ValueError, match="no space twins"):
        train(_cfg(data_dir, tmp_path / "run", steps=1, twin_coupling=1.0))


def test_space_twins_pair_tokens_one_leading_space_apart(data_dir):
    tok = Tokenizer.load(data_dir / "tokenizer")
    pairs = tok.space_twins()
    spaced, bare = {a for a, _ in pairs}, {b for _, b in pairs}
    assert len(pairs) > 20 and len(bare) == len(pairs) and not spaced & bare   # no row in two pairs
    for spaced, bare in pairs:
        assert tok.decode([spaced]) == " " + tok.decode([bare]) and not tok.decode([bare])[0].isspace()
    whole = [w for w in ("the", "def", "self", "return", "in", "if", "of", "and") if len(tok.encode(w)) == 1 == len(
        tok.encode(" " + w))]
    assert whole and all((tok.encode(" " + w)[0], tok.encode(w)[0]) in pairs for w in whole)


def test_twin_coupling_trains_a_shared_part_per_pair(data_dir, tmp_path):
    """One plain gradient step with the coupling equals one on `row = own + shared[pair]` (the shared parts
    starting at zero): for both the embedding and the LM head, paired rows move by their own gradient plus the
    pair's summed gradient, the other rows by their own."""
    from clover.training.trainer import couple_twins
    tok = Tokenizer.load(data_dir / "tokenizer")
    pairs = torch.tensor(tok.space_twins())
    model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=tok.mask_token_id, vocab_size=tok.vocab_size))
    ids = torch.tensor([tok.encode(" the cat saw the dog and the cat ran off")])
    weights = (model.model.embed_tokens.weight, model.lm_head.weight)

    def loss_of(emb: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        h = torch.func.functional_call(model, {"model.embed_tokens.weight": emb, "lm_head.weight": head}, (ids,))
        return torch.nn.functional.cross_entropy(h[0, :-1], ids[0, 1:])
    loss_of(*weights).backward()
    couple_twins(model, pairs, 0.5)
    coupled = [w.grad.clone() for w in weights]
    index = torch.full((tok.vocab_size,), len(pairs))   # each row's pair; unpaired rows read a zero row
    index[pairs[:, 0]] = index[pairs[:, 1]] = torch.arange(len(pairs))
    paired = (index < len(pairs))[:, None]
    own = [w.detach().clone().requires_grad_() for w in weights]
    shared = [torch.zeros(len(pairs) + 1, w.shape[1], requires_grad=True) for w in weights]
    loss_of(*(o + s[index] * paired for o, s in zip(own, shared, strict=True))).backward()
    for c, o, s in zip(coupled, own, shared, strict=True):   # alpha 0.5: the shared part at half the rate
        torch.testing.assert_close(c, o.grad + 0.5 * s.grad[index] * paired, rtol=1e-5, atol=1e-7)
        moved = (c - o.grad).abs().sum(1) > 0
        assert moved.any() and not moved[~paired[:, 0]].any()


def test_sft_masking_never_touches_prompt_tokens(data_dir):
    _, batch = _fixed_batch(data_dir, sft=True)
    valid = torch.arange(batch.ids.shape[1])[None, :] < batch.lengths[:, None]
    eligible = batch.loss_mask & valid
    assert eligible.any() and (~eligible & valid).any()  # both prompt and assistant tokens present
    for cfg in (ObjectiveConfig("diffusion", complementary=True), ObjectiveConfig("diffusion", mask_mode="exact")):
        for seed in range(20):
            for noise in sample_noise(eligible, 8, cfg, torch.Generator().manual_seed(seed)):
                assert not (noise.masked & ~eligible).any()
    both = sample_noise(eligible, 8, ObjectiveConfig("diffusion", complementary=True), torch.Generator())
    assert torch.equal(both[0].masked | both[1].masked, eligible) and not (both[0].masked & both[1].masked).any()


def test_exact_mask_mode_masks_round_t_n_per_block():
    eligible = torch.ones(3, 16, dtype=torch.bool)
    cfg = ObjectiveConfig("diffusion", mask_mode="exact")
    noise = sample_noise(eligible, 8, cfg, torch.Generator().manual_seed(1))[0]
    for r in range(3):
        for b in range(2):
            t = float(noise.t[r, b * 8])
            assert int(noise.masked[r, b * 8:(b + 1) * 8].sum()) == round(t * 8)


def test_chat_example_mask_covers_exactly_the_assistant_turns(data_dir):
    tok = Tokenizer.load(data_dir / "tokenizer")
    task = synthetic.make_task("calc", 5, thinking=True)
    ids, mask = chat_example(tok, task.messages, task.tools, thinking=True)
    full = tok.apply_chat_template(task.messages, tools=task.tools, add_generation_prompt=False)
    assert tok.decode(ids) == full
    written = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert written.count("<|im_end|>") == 3 and "<tool_call>" in written and "<tool_response>" not in written
    assert "Use the calculator" not in written


def _records(run, kind="train"):
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if f'"{kind}"' in line]


def _curve(run):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in _records(run)]


def test_resume_after_a_kill_reproduces_the_uninterrupted_curve(data_dir, tmp_path):
    args = ["--data", str(data_dir), "--init", "preset:debug", "--objective", "diffusion", "--ar-loss-weight", "0.5",
            "--steps", "40", "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--save-every", "10",
            "--eval-every", "20", "--eval-batches", "1"]
    whole = tmp_path / "whole"
    assert subprocess.run([sys.executable, "-m", "clover", "train", "--out", str(whole), *args],
                          capture_output=True, timeout=300).returncode == 0
    cut = tmp_path / "cut"
    proc = subprocess.Popen([sys.executable, "-m", "clover", "train", "--out", str(cut), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill it after its first checkpoint, mid-way to the next
        log = cut / "log.jsonl"
        if (cut / "checkpoint").is_dir() and log.exists() and len(_records(cut)) >= 14:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (cut / "model").exists()
    out = subprocess.run([sys.executable, "-m", "clover", "train", "--out", str(cut), *args, "--resume"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert _curve(cut) == _curve(whole)
    assert [r["diffusion_loss"] for r in _records(cut, "eval")] == [r["diffusion_loss"] for r in _records(whole, "eval")]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_torchrun_two_processes_match_one_process(data_dir, tmp_path, compiled):
    """Also compiled (`--compile`: each process compiles the layer stack inside its DDP wrapper), against the
    compiled one-process run (measured 2026-12-06: losses apart by at most 1.7e-6). Each process's 2 rows make
    4 micro-batches of which 2 are empty: its gradients are all-reduced after the last non-empty one (after the
    last of all before, so never, and the processes trained apart)."""
    # the router aux loss is a product of batch means, which ranks cannot split exactly: off here
    args = ["--data", str(data_dir), "--init", "preset:debug", "--objective", "diffusion", "--steps", "4",
            "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--aux-loss-coef", "0", "--grad-accum", "4",
            "--compile" if compiled else "--no-compile"]
    one = subprocess.run([sys.executable, "-m", "clover", "train", "--out", str(tmp_path / "one"), *args],
                         capture_output=True, text=True, timeout=900)
    assert one.returncode == 0, one.stderr
    # (--standalone: a free port of its own; a fixed one let two test runs at once meet in one rendezvous)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    two = subprocess.run([*torchrun, "-m", "clover", "train", "--out", str(tmp_path / "two"), *args],
                         capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert two.returncode == 0, two.stderr[-2000:]
    assert two.stdout.count('"kind": "train"') == 1   # the last record, printed by rank 0 only
    a, b = _records(tmp_path / "one"), _records(tmp_path / "two")
    assert len(a) == len(b) == 4
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) < 1e-5, (ra["loss"], rb["loss"])


def test_interrupted_checkpoint_write_is_never_loaded(data_dir, tmp_path, monkeypatch):
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3))
    before = (run / "checkpoint" / "model.safetensors").read_bytes()
    import clover.model.checkpoint as ckpt

    real = ckpt._write_weights
    calls = {"n": 0}

    def dying(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt  # the process dies after the weights, before the rename

    monkeypatch.setattr(ckpt, "_write_weights", dying)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(data_dir, run, steps=6), resume=True)
    monkeypatch.setattr(ckpt, "_write_weights", real)
    assert (run / "checkpoint" / "model.safetensors").read_bytes() == before
    assert not [p for p in run.iterdir() if p.name.startswith(".checkpoint.tmp")]
    state = torch.load(run / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 3 and calls["n"] == 0
    record = train(_cfg(data_dir, run, steps=6), resume=True)
    assert record["step"] == 6 and (run / "model" / "tokenizer.json").is_file()


def test_resume_after_a_kill_mid_swap_and_mid_append(data_dir, tmp_path):
    """A kill between the two renames of a checkpoint swap leaves the checkpoint moved aside, and one
    mid-append a partial last log record: --resume moves the checkpoint back and drops the partial record."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3))
    (run / "checkpoint").rename(run / ".checkpoint.old-4242")
    with open(run / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 4, "lo')
    record = train(_cfg(data_dir, run, steps=6), resume=True)
    assert record["step"] == 6 and not (run / ".checkpoint.old-4242").exists()
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4, 5, 6]


def test_resume_continues_with_the_runs_settings_and_compile_may_change(data_dir, tmp_path, monkeypatch, capsys):
    """`clover train --resume` with only --data and --out continues the run with its own settings (a diffusion
    run here, far from the defaults); a setting given again must match, except --steps and --compile."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3, objective="diffusion", ar_loss_weight=0.5, save_every=3))
    compiled = []
    monkeypatch.setattr(CloverForCausalLM, "compile_training", lambda self, enabled=True: compiled.append(enabled))
    base = ["train", "--data", str(data_dir), "--out", str(run), "--resume"]
    assert cli_main([*base, "--steps", "4", "--compile"]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert compiled == [True] and saved["objective"] == "diffusion" and saved["compile"] and saved["steps"] == 4
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4] and "diffusion_loss" in _records(run)[-1]
    capsys.readouterr()
    assert cli_main([*base, "--steps", "5", "--lr", "0.01"]) == 1
    assert "lr: 0.003 there, 0.01 now); only --steps and --compile may change" in capsys.readouterr().err
    assert cli_main([*base, "--steps", "5"]) == 0 and compiled == [True, True]   # (the run's own: compiled)
    assert cli_main([*base, "--steps", "6", "--no-compile"]) == 0 and compiled == [True, True]
    assert _records(run)[-1]["step"] == 6
    capsys.readouterr()
    settings = json.loads((run / "train_config.json").read_text())
    (run / "train_config.json").write_text(json.dumps({**settings, "lr": None}))
    assert cli_main([*base, "--steps", "7"]) == 1
    assert "train_config.json: lr must be int or float, got None" in capsys.readouterr().err


def test_resuming_a_finished_run_changes_nothing_and_says_so(data_dir, tmp_path, capsys):
    """Found in session 54: `--resume` of a run that had reached its --steps saved its model again and printed {}.
    Now it leaves every file as it is, says the run is finished and prints the run's last training record."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=2, save_every=2))
    files = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert cli_main(["train", "--data", str(data_dir), "--out", str(run), "--resume"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == _records(run)[-1] and json.loads(out)["step"] == 2
    assert "finished at step 2" in err and "larger --steps" in err
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in run.rglob("*") if p.is_file()} == files
    # killed after its last checkpoint, before its model was written: the resume writes it
    shutil.rmtree(run / "model")
    assert cli_main(["train", "--data", str(data_dir), "--out", str(run), "--resume"]) == 0
    assert (run / "model" / "model.safetensors").is_file() and json.loads(capsys.readouterr().out)["step"] == 2
    # a model older than the checkpoint (an earlier finish, the run extended since and killed at the new end's
    # checkpoint, found by a review) is written again from the checkpoint
    old = (run / "model" / "model.safetensors").read_bytes()
    os.utime(run / "model" / "config.json", ns=(0, 0))
    (run / "model" / "model.safetensors").write_bytes(b"stale")
    assert cli_main(["train", "--data", str(data_dir), "--out", str(run), "--resume"]) == 0
    assert (run / "model" / "model.safetensors").read_bytes() == old


def test_compile_is_used_with_bfloat16(data_dir, tmp_path, monkeypatch, capsys):
    """bf16 autocast compiles too (left out until 2026-12-06 for NaN losses no longer seen: the slow tests compare
    compiled bf16 steps with eager ones)."""
    compiled = []
    monkeypatch.setattr(CloverForCausalLM, "compile_training", lambda self, enabled=True: compiled.append(enabled))
    train(_cfg(data_dir, tmp_path / "run", steps=1, dtype="bfloat16", compile=True))
    assert compiled == [True] and "--compile is not used" not in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["ar", "diffusion"])
def test_compiled_bfloat16_training_runs_finite_and_follows_the_eager_run(data_dir, tmp_path, objective):
    """The trial that gave NaN losses on 2026-12-01 (this shape, compiled bf16 autocast): every loss finite, and
    within 1% of the eager bf16 run's at each step. The compiled graphs round at other points, and the differences
    compound through AdamW at lr 3e-3; measured 2026-12-06 at most 7.4e-4 relative over the 6 steps."""
    runs = {}
    for compiled in (False, True):
        run = tmp_path / f"run-{compiled}"
        train(_cfg(data_dir, run, objective=objective, dtype="bfloat16", compile=compiled))
        runs[compiled] = [r["loss"] for r in _records(run)]
    assert len(runs[True]) == len(runs[False]) == 6
    for eager, compiled in zip(runs[False], runs[True], strict=True):
        assert math.isfinite(compiled) and abs(compiled - eager) <= 1e-2 * abs(eager), runs


def test_run_directory_protects_existing_runs_and_settings(data_dir, tmp_path):
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=2))
    with pytest.raises(ValueError, match="already holds a run"):
        train(_cfg(data_dir, run, steps=2))
    with pytest.raises(ValueError, match="only --steps and --compile may change"):
        train(_cfg(data_dir, run, steps=4, lr=1e-2), resume=True)
    # without its log, a run's trained weights are still not replaced by a fresh run (a hostile pass lost them)
    (run / "log.jsonl").unlink()
    weights = (run / "model" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint, model\)"):
        train(_cfg(data_dir, run, steps=2))
    assert (run / "model" / "model.safetensors").read_bytes() == weights


def test_resume_never_drops_a_log_line_it_cannot_read_but_the_cut_short_last(data_dir, tmp_path):
    """Only a kill mid-append leaves a line that does not parse, and only as the last: any other such line
    is the user's to fix, and --resume refuses rather than rewriting the log without it."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3))
    lines = (run / "log.jsonl").read_text().splitlines()
    for text in ["\n".join([lines[0], bad, *lines[1:]]) + "\n" for bad in ("not json", '{"kind": "train"}')] + [
            "\n".join([*lines, "not json"]) + "\n"]:   # a last line with its newline was not cut short
        (run / "log.jsonl").write_text(text)
        with pytest.raises(ValueError, match="fix or remove it"):
            train(_cfg(data_dir, run, steps=4), resume=True)
        assert (run / "log.jsonl").read_text() == text


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(data="", out="", steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(cfg, 5) == 0.5 and lr_at(cfg, 10) == 1.0
    assert abs(lr_at(cfg, 100) - 0.1) < 1e-12 and lr_at(cfg, 55) < lr_at(cfg, 30)


def test_synthetic_tasks_are_deterministic_and_correct():
    for family in synthetic.FAMILIES:
        a, b = synthetic.make_task(family, 7), synthetic.make_task(family, 7)
        assert a.messages == b.messages and a.answer == b.answer
        assert a.check(a.messages[-1]["content"]), family
        assert not a.check("nothing useful"), family
    assert synthetic.make_task("calc", 1).messages != synthetic.make_task("calc", 2).messages
    train_seeds = {t.seed for t in synthetic.tasks("train", 50)}
    assert not train_seeds & {t.seed for t in synthetic.tasks("test", 50)}
    assert synthetic.calculate("(2 + 3) * 4") == "20" and synthetic.calculate("7 / 2") == "3.5"
    assert synthetic.calculate("__import__('os')").startswith("error")


def test_recall_drills_are_seeded_per_split_and_copy_what_they_state(data_dir):
    import random
    assert list(recall_data.documents("val", 3)) == list(recall_data.documents("val", 3))
    assert not set(recall_data.documents("train", 200)) & set(recall_data.documents("val", 200))
    rng = random.Random(1)
    for _ in range(50):
        first, again = recall_data.sequence(rng).split("\n")
        assert first.split(": ", 1)[1] == again.split(": ", 1)[1]
        head, _, asked = recall_data.table(rng).partition("\n\n")
        stated = head.split("\n")[1:]
        pairs = [_key_value(line) for line in stated]
        for line in asked.split("\n"):   # every line asks a stated key and answers its value
            assert any(k in line and line.rstrip(".").endswith(" " + v) for k, v in pairs), (line, pairs)
    tokens = np.fromfile(data_dir / "tokens" / "val_recall.bin", dtype=np.uint16)
    assert len(tokens) > 0 and TokenData(data_dir, "val", {"recall": 1.0}, 0).batch(0, 0, 2, 16).ids.shape == (2, 16)


def test_crossing_drills_restate_each_value_in_the_other_spelling(monkeypatch):
    import itertools
    import random
    import re
    made = (f"Qv{i}x" for i in itertools.count())   # values that occur in no key or form
    monkeypatch.setattr(recall_data, "_spelt", lambda rng: next(made))

    def spellings(v: str, block: str) -> set[str]:
        return ({"line"} if re.search(rf"(^|\n){v}(\n|$)", block) else set()) | ({"space"} if " " + v in block else set())
    rng, crossed = random.Random(0), 0
    for _ in range(200):
        stated, _, asked = recall_data.crossing(rng).partition("\n\n")
        for v in set(re.findall(r"Qv\d+x", asked)):
            before, after = spellings(v, stated), spellings(v, asked)
            assert len(before) == len(after) == 1 and before != after, (stated, asked)
            crossed += 1
    assert crossed > 200
    monkeypatch.undo()
    docs = list(recall_data.documents("val", 40, crossing_share=1.0))
    assert len(docs) == 40 and docs != list(recall_data.documents("val", 40))
    with pytest.raises(ValueError, match="crossing_share"):
        next(recall_data.documents("val", 1, crossing_share=1.5))


def test_recall_documents_at_no_crossing_are_those_of_before():
    import hashlib
    # sha256 of the first 50 validation documents as written before crossing drills existed (session 37): the
    # default data, and the recipe's, must not drift when an option is added
    text = "".join(recall_data.documents("val", 50, crossing_share=0.0))
    assert hashlib.sha256(text.encode()).hexdigest() == "6c869b410eb65a138ff2dac25b00e813d579854b5f40947f7d6809a5603d6099"


def _key_value(line: str) -> tuple[str, str]:
    for sep in (": ", " = ", " -> ", "\t"):
        if sep in line:
            k, v = line.split(sep, 1)
            return k, v
    raise AssertionError(line)


def test_a_package_unpacked_part_way_is_never_taken_for_the_whole(tmp_path, monkeypatch):
    """`fetch_package` unpacks beside the cache and renames into place (found by a hostile pass: a kill mid-way
    left a partial tree that every later `data build` read as the package, a corpus short of texts, silently)."""
    import io
    import tarfile

    from clover.training import data

    monkeypatch.setattr(data, "PACKAGES", {"pkg": "1.0"})
    cache = tmp_path / "cache"
    cache.mkdir()
    with tarfile.open(cache / "pkg-1.0.tar.gz", "w:gz") as tar:
        for name in ("a.txt", "b.txt"):
            info = tarfile.TarInfo(f"pkg-1.0/texts/{name}")
            info.size = 5
            tar.addfile(info, io.BytesIO(b"words"))
    whole = tarfile.TarFile.extractall

    def killed(self, path, *args, **kwargs):
        (Path(path) / "pkg-1.0" / "texts").mkdir(parents=True)
        (Path(path) / "pkg-1.0" / "texts" / "a.txt").write_text("wor")
        raise KeyboardInterrupt

    monkeypatch.setattr(tarfile.TarFile, "extractall", killed)
    with pytest.raises(KeyboardInterrupt):
        data.fetch_package("pkg", cache)
    assert sorted(p.name for p in cache.iterdir()) == ["pkg-1.0.tar.gz"]
    monkeypatch.setattr(tarfile.TarFile, "extractall", whole)
    root = data.fetch_package("pkg", cache)
    assert sorted(p.name for p in (root / "texts").iterdir()) == ["a.txt", "b.txt"]
    assert (root / "texts" / "a.txt").read_text() == "words"


def test_split_is_a_stable_hash():
    names = [f"doc{i}" for i in range(2000)]
    counts = {s: sum(split_of(n) == s for n in names) for s in SPLITS}
    assert 20 < counts["test"] < 70 and 20 < counts["val"] < 70
    assert split_of("python-stdlib/json/decoder.py") == split_of("python-stdlib/json/decoder.py")


def test_bfloat16_training_and_plot(data_dir, tmp_path):
    run = tmp_path / "bf16"
    record = train(_cfg(data_dir, run, steps=2, dtype="bfloat16", objective="diffusion", ar_loss_weight=1.0))
    assert record["step"] == 2 and 0 < record["loss"] < 20
    from clover.cli.commands import main as cli_main

    assert cli_main(["plot", str(run), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty").mkdir()   # a log with nothing to draw (it wrote an empty PNG and exited 0)
    (tmp_path / "empty" / "log.jsonl").write_text('{"kind": "train", "step": 1, "ar_loss": "high"}\n')
    assert cli_main(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "none.png")]) == 1
    assert not (tmp_path / "none.png").exists()


def test_sft_steps_without_an_assistant_token_in_the_window_log_no_loss(data_dir, tmp_path, capsys):
    """Tool prompts run to ~480 tokens here: packed 32-token SFT windows can hold no assistant token, so a
    step may have no loss to report; the run goes on (it used to end on formatting None)."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=4, eval_every=4, save_every=4, sft=True, pack=True, mix="chat=1.0"))
    losses = [r["loss"] for r in _records(run)]
    assert len(losses) == 4 and None in losses
    assert "| loss - |" in capsys.readouterr().err


def test_distill_data_holds_the_models_own_greedy_outputs_and_trains(data_dir, tmp_path):
    from clover.engine.engine import Engine
    from clover.engine.sampling import SamplingParams
    from clover.model.checkpoint import save_checkpoint
    from clover.training.distill import build_distill_data

    tok = Tokenizer.load(data_dir / "tokenizer")
    model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=tok.mask_token_id,
                                                  eos_token_id=tok.eos_token_ids)).eval()
    save_checkpoint(model, tmp_path / "m", extra_files=tok.files())
    counts = build_distill_data(tmp_path / "m", data_dir, tmp_path / "d", chat=6, code=3, new_tokens=8, batch=4)
    assert counts["chat_examples"] == 6 and counts["code_examples"] == 3
    z = np.load(tmp_path / "d" / "tokens" / "train_chat.npz")
    ids, mask, offsets = z["ids"].astype(int), z["mask"].astype(bool), z["offsets"]
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        row, scored = ids[a:b].tolist(), mask[a:b]
        first = int(scored.argmax())
        assert scored[first:].sum() >= 1 and not scored[:first].any()   # prompt unscored, reply scored
        greedy = Engine(model).generate([row[:first]], SamplingParams(max_new_tokens=8, algorithm="ar"))[0]
        assert row[first: first + len(greedy.token_ids)] == greedy.token_ids  # the model's own reply
    code = np.fromfile(tmp_path / "d" / "tokens" / "train_code.bin", dtype=np.uint16)
    assert len(code) == 3 * (192 + 8 + 1)
    run = train(_cfg(tmp_path / "d", tmp_path / "run", objective="diffusion", sft=True, pack=True, seq_len=256,
                     steps=2, mix="chat=0.7,code=0.3"))
    assert math.isfinite(run["loss"])


def test_a_checkpoint_of_another_tokenizer_is_refused_for_training_and_distillation(data_dir, tmp_path):
    """The data's ids would mean other tokens to it: training or distilling from it would go on silently wrong.
    Weights with no tokenizer beside them are refused only where the data's ids fall outside their vocabulary."""
    from clover.model.checkpoint import save_checkpoint
    from clover.model.tokenizer import TokenizerError
    from clover.training.distill import build_distill_data

    other = Tokenizer.train(["completely different words, " * 40, "def g(y):\n    return y\n" * 30], vocab_size=400)
    model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=other.mask_token_id,
                                                  eos_token_id=other.eos_token_ids))
    save_checkpoint(model, tmp_path / "m", extra_files=other.files())
    with pytest.raises(TokenizerError, match="trained with another tokenizer"):
        train(_cfg(data_dir, tmp_path / "run", init=str(tmp_path / "m")))
    with pytest.raises(TokenizerError, match="trained with another tokenizer"):
        build_distill_data(tmp_path / "m", data_dir, tmp_path / "d", chat=2, code=1, new_tokens=4, batch=2)
    assert not (tmp_path / "d").exists()
    tok = Tokenizer.load(data_dir / "tokenizer")
    for vocab, refused in ((tok.vocab_size - 1, True), (tok.vocab_size, False)):
        bare = CloverForCausalLM(CloverConfig.preset("debug", vocab_size=vocab, mask_token_id=tok.mask_token_id,
                                                     eos_token_id=tok.eos_token_ids))
        save_checkpoint(bare, tmp_path / f"bare{vocab}")
        run = tmp_path / f"run{vocab}"
        if refused:
            with pytest.raises(TokenizerError, match=f"the model in .* only {vocab}"):
                train(_cfg(data_dir, run, init=str(tmp_path / f"bare{vocab}"), steps=1))
        else:
            assert math.isfinite(train(_cfg(data_dir, run, init=str(tmp_path / f"bare{vocab}"), steps=1))["loss"])


def test_a_checkpoint_whose_mask_token_is_an_ordinary_token_is_refused_for_training(data_dir, tmp_path):
    """Found by a hostile pass: `clover convert --mask-token-id 100` made such a checkpoint, training masked with
    token 100 (which clean text also holds) to the end, and only generation refused the result."""
    from clover.model.checkpoint import save_checkpoint

    tok = Tokenizer.load(data_dir / "tokenizer")
    for mask, refused in ((100, True), (tok.mask_token_id, False)):
        model = CloverForCausalLM(CloverConfig.preset("debug", mask_token_id=mask, eos_token_id=tok.eos_token_ids))
        save_checkpoint(model, tmp_path / f"m{mask}", extra_files=tok.files())
        cfg = _cfg(data_dir, tmp_path / f"run{mask}", init=str(tmp_path / f"m{mask}"), steps=1, objective="diffusion")
        if refused:
            with pytest.raises(ValueError, match="mask_token_id 100 is not the mask token of the data's tokenizer"):
                train(cfg)
            assert not (tmp_path / "run100" / "log.jsonl").exists()
        else:
            assert math.isfinite(train(cfg)["loss"])


def test_a_batch_with_no_row_for_some_process_is_refused_before_anything_runs(data_dir, tmp_path):
    """With fewer rows than processes a rank would never join the gradients' all-reduce (the others wait for it
    forever): refused on every rank before the data or weights are touched."""
    from clover.training.trainer import _Dist, _train

    cfg = _cfg(data_dir, tmp_path / "run", batch_size=3, steps=1)
    with pytest.raises(ValueError, match="batch_size 3 gives no rows to some of the 4 processes"):
        _train(cfg, False, _Dist(rank=1, world=4))
    assert not (tmp_path / "run").exists()


def test_a_run_stopped_before_its_first_checkpoint_says_how_to_start_it_again(data_dir, tmp_path):
    """Its directory holds a log and settings but no checkpoint: a fresh start and --resume both refused it,
    each pointing at the other; both now say to remove the directory."""
    from clover.model.checkpoint import CheckpointError

    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (run / "train_config.json").write_text("{}")
    with pytest.raises(ValueError, match="stopped before its first checkpoint .*remove"):
        train(_cfg(data_dir, run, steps=1))
    with pytest.raises(CheckpointError, match="stopped before its first one.*remove"):
        train(_cfg(data_dir, run, steps=1), resume=True)


def test_resume_refuses_a_trainer_state_that_would_run_code(data_dir, tmp_path):
    from clover.model.checkpoint import CheckpointError

    cfg = _cfg(data_dir, tmp_path / "run", steps=3, save_every=3, eval_every=3)
    train(cfg)
    state = tmp_path / "run" / "checkpoint" / "trainer_state.pt"
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"step": 3, "optimizer": Payload(), "config": {}}, state)
    with pytest.raises(CheckpointError, match="refused, nothing was run"):
        train(_cfg(data_dir, tmp_path / "run", steps=6, save_every=3, eval_every=3), resume=True)
    assert not marker.exists()


def test_train_config_refuses_a_gdn_decay_range_it_cannot_draw():
    """gdn_dt_max 0 turns the slow-decay init off; a positive value under the range's floor (0.001) or a negative
    one is refused before any data or weights are touched, with the flag's name in the message."""
    TrainConfig(data="d", out="o", gdn_dt_max=0.0).validate()
    TrainConfig(data="d", out="o", gdn_dt_max=0.1).validate()
    for bad in (1e-4, -0.1, math.inf, math.nan):
        with pytest.raises(ValueError, match="gdn_dt_max"):
            TrainConfig(data="d", out="o", gdn_dt_max=bad).validate()
    with pytest.raises(ValueError, match="gdn_gate_z"):
        TrainConfig(data="d", out="o", gdn_gate_z=math.inf).validate()


@pytest.mark.parametrize("change,message", [
    ({"weight_decay": math.nan}, "weight_decay"), ({"clip": -1.0}, "clip"), ({"clip": math.nan}, "clip"),
    ({"ar_loss_weight": math.nan}, "ar_loss_weight"), ({"certainty_weight": math.inf}, "certainty_weight"),
    ({"mix": "code=-1,english=1"}, "mix weights"), ({"mix": "code=nan"}, "mix weights"),
    ({"mix": "code=0"}, "mix weights"), ({"eval_batches": 0}, "eval_batches"), ({"aux_loss_coef": -1.0}, "aux_loss"),
    ({"pack_whole": True}, "needs pack"), ({"twin_coupling": -0.5}, "twin_coupling"),
    ({"twin_coupling": math.nan}, "twin_coupling"), ({"mix": "code=1,code=2"}, "names a kind twice"),
    ({"mix": "code=1,chat=1,bogus=1"}, "mix names 'bogus', not a kind of data"), ({"seq_len": 1}, "seq_len must be at least 2"),
    ({"init": "runs/x/model", "gdn_gate_z": 2.0}, "need init preset:NAME"),   # (ignored there before, and recorded)
    # (these three were one message, "need 0 < lr < 1, 0 <= min_lr_ratio <= 1 and warmup >= 0", naming no value)
    ({"lr": 2.0}, r"lr must be a number in \(0, 1\), got 2.0"), ({"lr": math.nan}, "lr must be"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be a number in \[0, 1\], got 1.5"),
    ({"warmup": -3}, "warmup must be 0 or more steps, got -3"),
])
def test_train_config_refuses_values_that_would_train_nonsense(change, message):
    """Each of these was accepted and trained before (a NaN weight decay, a negative clip, a NaN loss weight):
    refused before any data or weights are touched, naming the setting. Unusual but meaningful values pass."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(data="d", out="o", **change).validate()
    TrainConfig(data="d", out="o", clip=math.inf, weight_decay=1.0, mix="code=1,chat=0").validate()


def test_seq_len_beyond_the_models_context_is_refused_before_a_batch(data_dir, tmp_path):
    """--seq-len 100000000 used to allocate batch_size x 1e8 ids and hang; the model's context bounds it."""
    with pytest.raises(ValueError, match="exceeds the model's context of 1024"):
        train(_cfg(data_dir, tmp_path / "run", seq_len=1025))
    assert not (tmp_path / "run" / "log.jsonl").exists()


def test_resume_keeps_the_init_settings_the_run_was_made_with(data_dir, tmp_path):
    """The GDN init settings only shape the random weights: a resumed run keeps the saved ones whatever the
    command line says, and a run saved before a setting existed is recorded as made without it (0), not with
    today's default."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=2, init="preset:debug"))
    path = run / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]["gdn_gate_z"], state["config"]["gdn_dt_max"]   # as a run from before both
    torch.save(state, path)
    train(_cfg(data_dir, run, steps=3, init="preset:debug", gdn_dt_max=0.05), resume=True)
    saved = json.loads((run / "train_config.json").read_text())
    assert (saved["gdn_gate_z"], saved["gdn_dt_max"], saved["steps"]) == (0.0, 0.0, 3)


def test_a_corrupt_trainer_state_is_named_before_anything_runs(data_dir, tmp_path):
    """A trainer state cut short, empty, of another shape, from a newer version, or at a step past --steps:
    one CheckpointError or ValueError naming it (tracebacks, or a run from step -4 with a negative learning
    rate, before); the run's log is left as it was."""
    from clover.model.checkpoint import CheckpointError

    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3, save_every=3, eval_every=3))
    state = run / "checkpoint" / "trainer_state.pt"
    good, log = state.read_bytes(), (run / "log.jsonl").read_text()
    saved = torch.load(state, weights_only=True)
    for content, message in ((good[:100], "cut short or corrupt"), (b"", "cut short or corrupt"),
                             (b"\x00garbage" * 8, "cut short or corrupt"), (b"junk\n", "cut short or corrupt"),
                             ([1, 2], "not a trainer state"),
                             ({**saved, "step": -5}, "not a trainer state"), ({**saved, "step": "3"}, "not a trainer state"),
                             ({**saved, "config": {**saved["config"], "new_knob": 1}}, "does not know: \\['new_knob'\\]"),
                             ({**saved, "cwd": 7}, "its working directory is not a path"),
                             ({**saved, "step": 9}, "at step 9, past --steps 6")):
        if isinstance(content, bytes):
            state.write_bytes(content)
        else:
            torch.save(content, state)
        with pytest.raises((CheckpointError, ValueError), match=message):
            train(_cfg(data_dir, run, steps=6, save_every=3, eval_every=3), resume=True)
        assert (run / "log.jsonl").read_text() == log


def test_resume_names_the_settings_that_differ_and_follows_a_moved_run(data_dir, tmp_path):
    train(_cfg(data_dir, tmp_path / "run", steps=3, save_every=3, eval_every=3))
    (tmp_path / "run").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="lr: 0.003 there, 0.01 now"):
        train(_cfg(data_dir, tmp_path / "moved", steps=6, save_every=3, eval_every=3, lr=1e-2), resume=True)
    record = train(_cfg(data_dir, tmp_path / "moved", steps=4, save_every=3, eval_every=3), resume=True)
    assert record["step"] == 4


def test_resume_takes_the_data_by_where_it_is_and_refuses_it_rebuilt_with_another_tokenizer(data_dir, tmp_path):
    """Found by a hostile pass (session 51): the data path was compared as text (a trailing slash or a link was
    "different settings"), and data rebuilt in place with another tokenizer was resumed on without a word (its
    ids read as other tokens; the finished model carried that tokenizer)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    link = tmp_path / "link"
    link.symlink_to(data)
    train(_cfg(data, tmp_path / "run", steps=3, save_every=3, eval_every=3))
    assert train(_cfg(f"{data}/", tmp_path / "run", steps=4, save_every=3, eval_every=3), resume=True)["step"] == 4
    assert train(_cfg(link, tmp_path / "run", steps=5, save_every=3, eval_every=3), resume=True)["step"] == 5
    Tokenizer.train(["something else entirely, other merges"] * 40, vocab_size=300).save(data / "tokenizer")
    with pytest.raises(TokenizerError, match="another tokenizer"):
        train(_cfg(data, tmp_path / "run", steps=6, save_every=3, eval_every=3), resume=True)


def test_a_run_started_with_a_relative_data_path_resumes_from_another_directory(data_dir, tmp_path, monkeypatch):
    """The saved relative path was resolved against today's working directory (left open by session 51): started
    as `--data data` in the project, resumed from its parent as `--data project/data`, the run was refused as
    "different settings". The trainer state now keeps the directory the run was started in."""
    import shutil

    project = tmp_path / "project"
    shutil.copytree(data_dir, project / "data")
    monkeypatch.chdir(project)
    train(_cfg("data", "run", steps=3, save_every=3, eval_every=3))
    monkeypatch.chdir(tmp_path)
    record = train(_cfg("project/data", "project/run", steps=4, save_every=3, eval_every=3), resume=True)
    assert record["step"] == 4
    shutil.copytree(data_dir, tmp_path / "other")
    with pytest.raises(ValueError, match="data: 'project/data' there, 'other' now"):   # (as the last sitting spelt it)
        train(_cfg("other", "project/run", steps=5, save_every=3, eval_every=3), resume=True)
    # a state from before the working directory was kept: its relative paths are taken from today's, as then
    state_path = project / "run" / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    del state["cwd"]
    torch.save(state, state_path)
    assert train(_cfg("project/data/", "project/run", steps=5, save_every=3, eval_every=3), resume=True)["step"] == 5
    # a project that moved: the saved directory is gone, today's spelling of the same relative path still resumes
    moved = tmp_path / "moved"
    project.rename(moved)
    monkeypatch.chdir(moved)
    state_path = moved / "run" / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    state["config"]["data"] = "data"   # (as it was saved where it started)
    torch.save(state, state_path)
    assert train(_cfg("data/", "run", steps=6, save_every=3, eval_every=3), resume=True)["step"] == 6


def test_corrupt_token_shards_are_named_not_looped_on(data_dir, tmp_path):
    """Chat offsets that never advance looped forever in `batch`; a cut-short shard was a BadZipFile or an
    IndexError mid-batch. Each is a ValueError naming the file, before a batch."""
    import shutil

    import numpy as np

    bad = tmp_path / "data"
    shutil.copytree(data_dir, bad)
    chat = bad / "tokens" / "train_chat.npz"
    with np.load(chat) as z:
        ids, mask, offsets = z["ids"], z["mask"], z["offsets"]
    stuck = offsets.copy()
    stuck[2] = stuck[1]   # an empty conversation: `batch` took 0 tokens from it, again and again
    for shard, message in (({"ids": ids, "mask": mask, "offsets": np.zeros_like(offsets)}, "offsets must rise"),
                           ({"ids": ids, "mask": mask, "offsets": stuck}, "offsets must rise"),
                           ({"ids": ids, "mask": mask[:-1], "offsets": offsets}, "mask as long as the ids"),
                           ({"ids": ids, "mask": mask}, "not a chat shard"), (b"PK\x03\x04cut", "not a chat shard")):
        if isinstance(shard, bytes):
            chat.write_bytes(shard)
        else:
            np.savez(chat, **shard)
        with pytest.raises(ValueError, match=message):
            TokenData(bad, "train", {"chat": 1.0}, 0, pack=True)
    code = bad / "tokens" / "train_code.bin"
    code.write_bytes(b"\x01\x00" * 10)
    with pytest.raises(ValueError, match="train_code.bin holds 10 tokens: too few for windows of 32"):
        TokenData(bad, "train", {"code": 1.0}, 0).batch(0, 1, 2, 32)
    code.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="train_code.bin is not a token shard"):
        TokenData(bad, "train", {"code": 1.0}, 0)
    code.write_bytes(b"")   # (distillation data of no code prompts was "not a token shard ... 0 bytes")
    with pytest.raises(ValueError, match="train_code.bin is empty: no code tokens to train on"):
        TokenData(bad, "train", {"code": 1.0}, 0)


def test_a_missing_data_directory_says_how_to_make_it_or_where_it_was_moved(tmp_path, capsys):
    """Commands that read --data name a missing one clearly; one that a build killed mid-swap left moved aside
    (`.NAME.old-PID`) is pointed at, not silently reported missing."""
    assert require_data(tmp_path) == tmp_path
    missing = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match=r"data is missing: make a data directory with `clover data build"):
        require_data(missing)
    (tmp_path / ".data.old-4242").mkdir()
    with pytest.raises(FileNotFoundError, match=r"\.data\.old-4242 holds its previous version .* move it back"):
        require_data(missing)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        require_data(tmp_path / "file")
    for command in (["train", "--data", str(missing), "--out", str(tmp_path / "run")],
                    ["data", "distill", "--model", "m", "--data", str(missing), "--out", str(tmp_path / "d")]):
        assert cli_main(command) == 1
        assert ".data.old-4242 holds its previous version" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_optimizer_is_fused_adamw_equal_to_the_multi_tensor_one():
    """The trainer's AdamW takes torch's fused kernel on CPU; its updates equal the multi-tensor AdamW's with the
    same groups (decay on matrices only) up to float rounding (5 steps: 1e-6 at weights of order 1)."""
    weights = []
    for fused in (True, False):
        torch.manual_seed(0)
        model = CloverForCausalLM(CloverConfig.preset("debug"))
        cfg = TrainConfig(data="", out="", lr=1e-2, weight_decay=0.1)
        opt = make_optimizer(model, cfg)
        assert [g["fused"] for g in opt.param_groups] == [True, True]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        if not fused:
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in opt.param_groups]
            opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
            assert not opt.param_groups[0]["fused"]
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert (weights[0] - weights[1]).abs().max() < 1e-6


def _copy_data(data_dir, tmp_path, name="data"):
    import shutil

    out = tmp_path / name
    shutil.copytree(data_dir, out)
    return out


def test_shards_are_checked_against_the_tokenizer_as_they_load(data_dir, tmp_path):
    """Found by a hostile pass on training (session 54): an id outside the vocabulary was met only when a window
    held it (the run stopped at that step on every resume, the message naming no file); shards of a 512-token
    tokenizer trained without a word beside a smaller one; bool chat ids, a mask of 255, and --sft on a shard that
    marks no assistant token (every loss empty) trained too."""
    import numpy as np

    d = _copy_data(data_dir, tmp_path)
    code = np.memmap(d / "tokens" / "train_code.bin", dtype=np.uint16, mode="r+")
    code[len(code) // 2] = 40000
    code.flush()
    del code
    with pytest.raises(ValueError, match=r"train_code.bin holds token id 40000, outside the tokenizer's vocabulary"):
        train(_cfg(d, tmp_path / "r1", steps=1))
    d = _copy_data(data_dir, tmp_path, "small-tok")
    Tokenizer.train([t for _, t in itertools.islice(stdlib_sources(), 4)], vocab_size=300).save(d / "tokenizer")
    with pytest.raises(ValueError, match=r"outside the tokenizer's vocabulary \[0, 300\)"):
        train(_cfg(d, tmp_path / "r2", steps=1))

    def chat(name, edit):
        c = _copy_data(data_dir, tmp_path, name)
        with np.load(c / "tokens" / "train_chat.npz") as z:
            arrays = dict(z)
        edit(arrays)
        np.savez(c / "tokens" / "train_chat.npz", **arrays)
        return c

    cases = [(chat("bool", lambda a: a.update(ids=a["ids"] > 5)), {}, "ids must be integers, got bool"),
             (chat("mask", lambda a: a.update(mask=np.where(a["mask"] > 0, 255, 0).astype(np.uint8))), {},
              "the assistant mask must hold 0 and 1 only"),
             (chat("nomask", lambda a: a.update(mask=np.zeros_like(a["mask"]))), {"sft": True},
              "marks no assistant tokens: --sft would score nothing")]
    for i, (c, kw, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            train(_cfg(c, tmp_path / f"c{i}", steps=1, mix="chat=1", **kw))
    d = _copy_data(data_dir, tmp_path, "fifo")   # (a pipe where a shard belongs was reported missing)
    (d / "tokens" / "train_code.bin").unlink()
    os.mkfifo(d / "tokens" / "train_code.bin")
    with pytest.raises(ValueError, match="train_code.bin is not a regular file"):
        train(_cfg(d, tmp_path / "r3", steps=1))


def test_a_fresh_run_writes_only_into_a_new_empty_or_earlier_run_directory(data_dir, tmp_path):
    """Found by a hostile pass on training (session 54): --out holding a user's notes.txt and own train_config.json
    was trained into (their train_config.json overwritten), and --out inside --data put a run in the data."""
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="holds notes.txt, which a training run does not write"):
        train(_cfg(data_dir, user, steps=1))
    (user / "notes.txt").unlink()
    (user / "train_config.json").write_text('{"my": "settings"}')
    with pytest.raises(ValueError, match="is not a training run's settings"):
        train(_cfg(data_dir, user, steps=1))
    assert (user / "train_config.json").read_text() == '{"my": "settings"}'
    with pytest.raises(ValueError, match="is inside --data"):
        train(_cfg(data_dir, data_dir / "tokens" / "run", steps=1))
    assert not (data_dir / "tokens" / "run").exists()


def test_data_commands_never_replace_data_they_do_not_own(data_dir, tmp_path, capsys):
    """Found by a hostile pass on training (session 54): `data distill --data D2 --out D1`, D2 distilled from D1,
    exited 0 and deleted D1's corpus, tokenizer and shards (D1's became links to themselves); distilling over a
    `data build` directory replaced its corpus with links; `data build --out` a directory holding someone's
    manifest.json and raw/notes.txt deleted them."""
    d1 = _copy_data(data_dir, tmp_path, "d1")
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "tokens").mkdir()
    for name in ("tokenizer", "raw", "manifest.json"):
        if (d1 / name).exists():
            (d2 / name).symlink_to(d1 / name)
    (d2 / "tokens" / "counts.json").write_text("{}")
    for target in (d1 / "tokens", d1):
        assert cli_main(["data", "distill", "--model", str(tmp_path / "no-model"), "--data", str(d2),
                         "--out", str(target)]) == 1
    err = capsys.readouterr().err
    assert "would replace --data" in err and (d1 / "tokenizer" / "tokenizer.json").is_file()
    other = _copy_data(data_dir, tmp_path, "other")
    assert cli_main(["data", "distill", "--model", str(tmp_path / "no-model"), "--data", str(d1),
                     "--out", str(other)]) == 1
    assert "is a data directory of `clover data build`" in capsys.readouterr().err
    foreign = tmp_path / "foreign"
    (foreign / "raw").mkdir(parents=True)
    (foreign / "manifest.json").write_text('{"mine": 1}')
    (foreign / "raw" / "notes.txt").write_text("keep")
    assert cli_main(["data", "build", "--out", str(foreign)]) == 1
    assert "is not a data directory of `clover data build`" in capsys.readouterr().err
    assert (foreign / "raw" / "notes.txt").read_text() == "keep"


def test_running_out_of_memory_is_one_line(monkeypatch, capsys, tmp_path):
    """Found by a hostile pass on training (session 54): --batch-size 1000000 ended in a 53-line traceback from
    torch's allocator."""
    import clover.cli.train as cli_train

    def oom(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 98304000000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(cli_train, "train", lambda *a, **k: oom(a))
    assert cli_main(["train", "--data", "x", "--out", str(tmp_path / "r"), "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: out of memory" in err[0] and "98304000000 bytes" in err[0]


def test_distillation_refuses_chat_records_of_another_shape_by_line(data_dir, tmp_path):
    """Found by a hostile pass on training (session 54): a chat record without "messages" or "tools", a message
    without a role, or a string for messages was a KeyError / TypeError traceback; no user message "max() arg is an
    empty sequence"; a line that is not UTF-8 named neither file nor line; no usable prompt at all wrote data that
    `train` then refused."""
    import random as _random

    from clover.training.distill import _chat_prompts

    tok = Tokenizer.load(data_dir / "tokenizer")
    for i, (line, message) in enumerate([
        (b'{"tools": []}', 'record 1: a chat record holds "messages"'),
        (b'{"messages": "hello"}', "record 1"), (b'{"messages": [{"content": "x"}]}', "record 1"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', ""),
        (b'{"messages": [{"role": "user", "content": "x"}]}\n\xff\n', "line 2 is not UTF-8"),
    ]):
        d = _copy_data(data_dir, tmp_path, f"d{i}")
        (d / "raw" / "train" / "chat.jsonl").write_bytes(line + b"\n")
        if i == 3:   # (valid: a user turn and no assistant turn: no prompt, and no error in the records)
            assert _chat_prompts(d, tok, 5, _random.Random(0), 10_000) == []
            continue
        with pytest.raises(ValueError, match=message):
            _chat_prompts(d, tok, 5, _random.Random(0), 10_000)


def test_resume_without_train_config_json_continues_with_the_checkpoints_settings(data_dir, tmp_path, capsys):
    """Found by a hostile pass on training (session 54): with train_config.json gone, `--resume` took the command
    line's defaults and refused them as 8 "changed" settings the user never gave; the checkpoint holds the run's."""
    run = tmp_path / "run"
    train(_cfg(data_dir, run, steps=3, save_every=3, eval_every=3))
    (run / "train_config.json").unlink()
    assert cli_main(["train", "--data", str(data_dir), "--out", str(run), "--resume", "--steps", "4"]) == 0, \
        capsys.readouterr().err
    assert json.loads((run / "train_config.json").read_text())["batch_size"] == 4
