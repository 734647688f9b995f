"""`verify` decoding (spec section 5b): the causal head decides, so the output is `ar`'s.

Greedy output equals `ar` token for token (random and shipped model, several check windows, mixed
batches, prompt tails inside a block, stop tokens and stop strings inside a draft); poisoned drafts
change nothing and the cache never holds a rejected draft; blocks decoded without a preview equal
`ar` too; sampled output follows `ar`'s distribution; a check followed by a keep leaves the cache a
prefill of the kept tokens would.
"""

import copy
import math
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.engine.engine import Engine
from clover.engine.policies import ContextLookup, VerifyPolicy, lookup_match
from clover.engine.sampling import SamplingParams
from clover.engine.sequence import NO_DRAFT, SequenceState
from clover.engine.trace import trace_data
from clover.model.checkpoint import load_checkpoint
from clover.model.config import CloverConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import Tokenizer

SHIPPED = Path(__file__).resolve().parents[1] / "clover" / "weights" / "clover-tiny"
# prompt lengths around the debug block size 8: tails of 3, 0 (a multiple), 5, 1, 7 and a short prompt
LENGTHS = (11, 16, 13, 9, 23, 2)


@pytest.fixture(scope="module")
def model() -> CloverForCausalLM:
    torch.manual_seed(0)
    m = CloverForCausalLM(CloverConfig.preset("debug")).eval()
    with torch.no_grad():  # Clover extras away from their neutral init, sharper logits
        for mod in m.modules():
            if hasattr(mod, "conv_right"):
                mod.conv_right.normal_(std=0.3)
                mod.history_bias.normal_(std=0.5)
        m.lm_head.weight.mul_(8.0)
    return m


def _prompts(vocab: int = 500, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.mark.parametrize(("window", "cost_ratio"), [(1, 0), (3, 0), (8, 0), (32, 0), (8, None), (8, 1.6), (8, 1e9)])
def test_greedy_verify_equals_ar_token_for_token(model, window, cost_ratio):
    """Every check window; drafts always checked (cost ratio 0), never (an `ar` step each time), and
    checked where the running estimate of kept drafts says it pays (measured or fixed ratio)."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    ar = Engine(model).generate(_prompts(), params.with_(algorithm="ar"))
    engine = Engine(model, policies={"verify": VerifyPolicy(window=window, cost_ratio=cost_ratio)})
    ve = engine.generate(_prompts(), params.with_(algorithm="verify"))
    assert [v.token_ids for v in ve] == [a.token_ids for a in ar]
    for v in ve:
        s = v.stats
        assert s.check_forwards >= 1 and s.nfe == s.preview_forwards + s.commit_forwards + s.check_forwards
        assert s.drafts_accepted <= s.drafts_proposed
    proposed = sum(v.stats.drafts_proposed for v in ve)
    if cost_ratio == 0:
        assert all(v.stats.drafts_proposed >= v.stats.check_forwards == v.stats.draft_checks for v in ve)
    if cost_ratio == 1e9:
        assert proposed == 0 and all(v.stats.draft_checks == 0 for v in ve)
    if cost_ratio == 1.6:   # some sequences' drafts were worth checking and some forwards were steps
        assert 0 < proposed < sum(v.stats.check_forwards for v in ve) * window


@pytest.mark.slow
def test_compiled_verify_and_ar_equal_eager_ar(model):
    """With the decoding passes compiled (`--compile`), `ar` and `verify` (two check windows), in
    batches of three over prompts with tails inside a block, write eager `ar`'s tokens (the compiled
    passes match the eager ones to 2e-5; the sharpened head leaves no near-ties at that scale)."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [r.token_ids for r in Engine(model).generate(_prompts(), params.with_(algorithm="ar"))]
    fast = copy.deepcopy(model)
    fast.compile_decode()
    for algorithm, policy in (("ar", None), ("verify", VerifyPolicy(cost_ratio=0)),
                              ("verify", VerifyPolicy(window=3, cost_ratio=1.5))):
        engine = Engine(fast, max_batch_size=3, policies=None if policy is None else {"verify": policy})
        got = engine.generate(_prompts(), params.with_(algorithm=algorithm))
        assert [r.token_ids for r in got] == want, (algorithm, policy)
    # it ran compiled, with no fallback (a standalone preview runs only after a check that kept a block's end)
    assert {"step", "check", "fused"} <= fast._compiled_ran and fast._compiled


def test_verify_in_a_batch_mixing_algorithms_equals_verify_alone(model):
    prompts = _prompts()
    algs = ["verify", "ar", "low_confidence", "verify", "ar", "verify"]
    params = [SamplingParams(max_new_tokens=12 + 3 * i, ignore_eos=True, algorithm=a) for i, a in enumerate(algs)]
    mixed = Engine(model, max_batch_size=3).generate(prompts, params)
    for p, sp, got in zip(prompts, params, mixed, strict=True):
        alone = Engine(model).generate([p], sp)[0]
        assert got.token_ids == alone.token_ids
        if sp.algorithm == "verify":
            assert got.token_ids == Engine(model).generate([p], sp.with_(algorithm="ar"))[0].token_ids


def test_stop_token_and_stop_string_inside_a_draft_end_where_ar_ends():
    m = load_checkpoint(SHIPPED, dtype="float32").eval()
    tok = Tokenizer.load(SHIPPED)
    prompt = tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    base = SamplingParams(max_new_tokens=48, ignore_eos=True)
    ar = Engine(m, tokenizer=tok).generate([prompt], base.with_(algorithm="ar"))[0]
    assert len(ar.token_ids) == 48
    stop_id = ar.token_ids[20]
    stop_text = tok.decode(ar.token_ids)[40:44]
    for params in (base.with_(stop_token_ids=(stop_id,)), base.with_(stop=(stop_text,))):
        a = Engine(m, tokenizer=tok).generate([prompt], params.with_(algorithm="ar"))[0]
        v = Engine(m, tokenizer=tok, policies={"verify": VerifyPolicy(cost_ratio=0)}).generate(
            [prompt], params.with_(algorithm="verify"))[0]
        assert (v.token_ids, v.text, v.finish_reason) == (a.token_ids, a.text, "stop")


def test_shipped_model_verify_equals_ar_and_keeps_drafts():
    m = load_checkpoint(SHIPPED, dtype="float32").eval()
    tok = Tokenizer.load(SHIPPED)
    texts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ar = Engine(m).generate(prompts, params.with_(algorithm="ar"))
    ve = Engine(m, policies={"verify": VerifyPolicy(cost_ratio=0)}).generate(prompts, params.with_(algorithm="verify"))
    assert [v.token_ids for v in ve] == [a.token_ids for a in ar]
    assert sum(v.stats.drafts_accepted for v in ve) > 0  # the test exercises kept drafts, not only corrections


def test_previewed_blocks_check_the_contexts_drafts_where_those_are_kept_more():
    """Every block previewed and checked a full window at a time (`cost_ratio` 0): on code, where the
    shipped model's previews draft badly and its text repeats what it has read, checks switch to the
    context's drafts (`use_looked`), keep more drafts than the previews alone, and the output stays `ar`'s."""
    m = load_checkpoint(SHIPPED, dtype="float32").eval()
    tok = Tokenizer.load(SHIPPED)
    prompts = [tok.encode(t) for t in ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n"]]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    ar = [r.token_ids for r in Engine(m).generate(prompts, params.with_(algorithm="ar"))]
    runs = {lookup: Engine(m, policies={"verify": VerifyPolicy(cost_ratio=0, lookup=lookup)}).generate(
        prompts, params.with_(algorithm="verify")) for lookup in (True, False)}
    for results in runs.values():
        assert [r.token_ids for r in results] == ar
        assert all(r.stats.previews_skipped == 0 for r in results)        # every block has its preview
    kept = {lookup: sum(r.stats.drafts_accepted for r in rs) for lookup, rs in runs.items()}
    assert sum(r.stats.lookup_accepted for r in runs[True]) > 0 and kept[True] > kept[False]
    assert sum(r.stats.lookup_drafts for r in runs[False]) == 0


class PoisonedVerify(VerifyPolicy):
    """Drafts that are `ar`'s own tokens for a few slots, then a wrong token, then `ar`'s again: the
    check keeps the right ones, replaces the poisoned one, and must never let it into the cache."""

    def __init__(self, truth: list[int], prompt_len: int, vocab: int) -> None:
        super().__init__(cost_ratio=0)
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab

    def _draft(self, engine, s, logits):
        super()._draft(engine, s, logits)
        for slot in (~s.resolved).nonzero().squeeze(-1).tolist():
            k = s.pos + slot - self.prompt_len  # index into the generated tokens
            if 0 <= k < len(self.truth):
                right = self.truth[k]
                s.drafts[slot] = (right + 1) % (self.vocab - 2) if (s.pos + slot) % 5 == 3 else right


class TruthfulVerify(VerifyPolicy):
    """Drafts that are always `ar`'s own tokens: every draft is kept and each full window is followed by
    the causal head's next token, past what the preview drafted."""

    def __init__(self, truth: list[int], prompt_len: int, window: int) -> None:
        super().__init__(window=window, cost_ratio=0)
        self.truth, self.prompt_len = truth, prompt_len

    def _draft(self, engine, s, logits):
        super()._draft(engine, s, logits)
        for slot in (~s.resolved).nonzero().squeeze(-1).tolist():
            k = s.pos + slot - self.prompt_len
            if 0 <= k < len(self.truth):
                s.drafts[slot] = self.truth[k]


@pytest.mark.parametrize("window", [1, 2, 5])
def test_kept_windows_continue_with_the_causal_heads_token(model, window):
    prompt = _prompts()[1]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, algorithm="verify", record_steps=True)
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    result = Engine(model, policies={"verify": TruthfulVerify(truth, len(prompt), window)}).generate([prompt],
                                                                                                      params)[0]
    assert result.token_ids == truth
    s = result.stats
    assert s.drafts_accepted == s.drafts_proposed > 0 and not any(r.rejected for r in result.trace)
    assert s.generated_tokens > s.check_forwards  # more than one token per check


def _assert_cache_is_prefill_of(model, engine, s, tokens):
    n = s.cached
    assert s.pos - (0 if s.behind is None else len(s.behind)) <= n <= len(tokens)
    cache, row = engine.cache, s.row
    assert int(cache.lengths[row]) == n
    if n == 0:
        return
    ref = model.new_cache(1)
    model.causal(torch.tensor([tokens[:n]]), ref, logits="none")
    for layer in range(len(cache.keys)):
        if cache.keys[layer] is not None:
            torch.testing.assert_close(cache.keys[layer][row, :, :n], ref.keys[layer][0, :, :n], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.values[layer][row, :, :n], ref.values[layer][0, :, :n], atol=1e-5,
                                       rtol=0)
        else:
            torch.testing.assert_close(cache.states[layer][row], ref.states[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.rings[layer][row], ref.rings[layer][0], atol=1e-5, rtol=0)


def test_poisoned_drafts_change_nothing_and_never_reach_the_cache(model):
    prompt = _prompts()[0]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True, algorithm="verify")
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    engine = Engine(model, policies={"verify": PoisonedVerify(truth, len(prompt), model.config.vocab_size)})
    rid = engine.add_request(prompt, params.with_(record_steps=True))
    result, checked = None, 0
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                result = ev.result
        for s in engine.running:
            if s.rid == rid and s.finish_reason is None:
                _assert_cache_is_prefill_of(model, engine, s, prompt + s.generated)
                checked += 1
    assert result.token_ids == truth
    assert checked >= 3 and result.stats.drafts_accepted > 0
    assert any(r.rejected for r in result.trace)  # poisoned drafts were seen and replaced
    for r in result.trace:
        for slot in r.rejected:
            assert r.draft[slot] != r.tokens[slot]


def test_sampled_verify_follows_the_ar_distribution():
    """Marginals of the first three sampled tokens, against their exact values under `ar` (computed by
    enumerating the 16-token vocabulary); a chi-square test per position at p = 0.001."""
    cfg = CloverConfig.preset("debug", vocab_size=16, mask_token_id=15, eos_token_id=14)
    torch.manual_seed(3)
    m = CloverForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)  # peaked but not degenerate distributions
    prompt, n, temp = [3, 1, 4, 1, 5, 9, 2], 3000, 0.9
    usable = 14  # the mask token and EOS are excluded (EOS ignored) by both decoders

    def dist(logits):
        lg = logits.float().clone()
        lg[..., 15] = float("-inf")
        return torch.softmax(lg / temp, -1)

    with torch.no_grad():
        p1 = dist(m(torch.tensor([prompt]))[0, -1])
        ctx1 = torch.tensor([prompt + [a] for a in range(16)])
        p2_given = dist(m(ctx1)[:, -1])                                         # [16,16]
        p2 = p1 @ p2_given
        ctx2 = torch.tensor([prompt + [a, b] for a in range(16) for b in range(16)])
        p3_given = dist(m(ctx2)[:, -1]).reshape(16, 16, 16)
        p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    exact = [p1, p2, p3]

    def chi2(samples, probs):
        counts = torch.bincount(samples, minlength=16).double()
        expected = probs.double() * len(samples)
        keep = expected > 5
        lumped = (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(float(expected[~keep].sum()), 1e-9)
        return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum() + lumped), int(keep.sum())

    def run(alg, t, policy=None):
        params = [SamplingParams(max_new_tokens=3, temperature=t, seed=i, ignore_eos=True, algorithm=alg)
                  for i in range(n)]
        return Engine(m, max_batch_size=n, policies=policy).generate([prompt] * n, params)

    crit = {k: k + 3.1 * math.sqrt(2 * k) + 6 for k in range(1, usable + 1)}  # about the 0.001 tail
    # the default window; and a window of one draft, where a kept draft is followed by the causal
    # head's own sampled token
    for policy in ({"verify": VerifyPolicy(cost_ratio=0)}, {"verify": VerifyPolicy(window=1, cost_ratio=0)}):
        ve = run("verify", temp, policy)
        assert sum(r.stats.drafts_accepted for r in ve) > n // 10   # both branches of the acceptance rule run
        assert sum(r.stats.drafts_proposed - r.stats.drafts_accepted for r in ve) > n // 10
        tokens = torch.tensor([r.token_ids for r in ve])
        for pos in range(3):
            stat, dof = chi2(tokens[:, pos], exact[pos])
            assert stat < crit[dof], (policy, pos, stat, dof)
    # the test has power: samples at another temperature are rejected at the third position
    other = torch.tensor([r.token_ids for r in run("ar", 1.6)])
    assert max(chi2(other[:, pos], exact[pos])[0] - crit[chi2(other[:, pos], exact[pos])[1]] for pos in range(3)) > 0


def test_check_then_keep_equals_a_commit_of_the_kept_rows(model):
    """`model.check` gives the causal logits of its rows without committing them, and `model.keep` of the
    first n rows leaves the cache exactly as a causal commit of those n rows (K/V, GDN state and conv
    ring, lengths); rows of different cache lengths, check lengths and kept counts (none included)."""
    ids = torch.randint(0, 500, (4, 40), generator=torch.Generator().manual_seed(5))
    past, check_len, kept = [11, 5, 8, 16], [7, 3, 7, 5], [4, 3, 0, 1]
    with torch.no_grad():
        base = model.new_cache(4)
        model.causal(ids[:, :16], base, lengths=torch.tensor(past), logits="none")
        rows = torch.stack([ids[r, p: p + 7] for r, p in enumerate(past)])
        got, want = copy.deepcopy(base), copy.deepcopy(base)
        logits, trail = model.check(rows, got, lengths=torch.tensor(check_len))
        assert got.lengths.tolist() == past                                   # nothing committed yet
        ref = model.causal(rows, copy.deepcopy(base), lengths=torch.tensor(check_len), logits="all")
        for r, n in enumerate(check_len):
            torch.testing.assert_close(logits[r, :n], ref[r, :n], atol=2e-5, rtol=0)
        model.keep(got, trail, kept)
        model.causal(rows, want, lengths=torch.tensor(kept), logits="none")
    assert want.lengths.tolist() == [p + k for p, k in zip(past, kept, strict=True)]
    _assert_same_cache(got, want)


def _assert_same_cache(got, want):
    """Same lengths, GDN states and conv rings, and K/V at every committed position, to 1e-5."""
    assert got.lengths.tolist() == want.lengths.tolist()
    for a, b in ((got.states, want.states), (got.rings, want.rings)):
        for x, y in zip(a, b, strict=True):
            if x is not None:
                torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    for layer, k in enumerate(want.keys):
        if k is not None:
            for r, n in enumerate(want.lengths.tolist()):
                torch.testing.assert_close(got.keys[layer][r, :, :n], k[r, :, :n], atol=1e-5, rtol=0)
                torch.testing.assert_close(got.values[layer][r, :, :n], want.values[layer][r, :, :n], atol=1e-5,
                                           rtol=0)


def test_fused_commit_and_preview_equal_the_separate_passes(model):
    b = model.config.block_size
    ids = torch.randint(0, 500, (3, 40), generator=torch.Generator().manual_seed(5))
    past, clean_len, block_len = [11, 5, 8], torch.tensor([b, 3, 0]), torch.tensor([b, 5, b])
    with torch.no_grad():
        base = model.new_cache(3)
        model.causal(ids[:, :11], base, lengths=torch.tensor(past), logits="none")
        clean = ids[:, 11: 11 + b]
        block = torch.full((3, b), model.config.mask_token_id)
        block[:, :2] = ids[:, 20:22]
        sep, fus = copy.deepcopy(base), copy.deepcopy(base)
        want_clean = model.causal(clean, sep, lengths=clean_len, logits="all")
        want_block = model.preview(block, sep, lengths=block_len)
        got_clean, got_block = model.causal_and_preview(clean, block, fus, clean_len, block_len, clean_logits="all")
        for r in range(3):
            n = int(clean_len[r])
            torch.testing.assert_close(got_clean[r, :n], want_clean[r, :n], atol=2e-5, rtol=0)
            n = int(block_len[r])
            torch.testing.assert_close(got_block[r, :n], want_block[r, :n], atol=2e-5, rtol=0)
        assert sep.lengths.tolist() == [p + int(c) for p, c in zip(past, clean_len, strict=True)]
        _assert_same_cache(fus, sep)


def test_each_forward_checks_the_number_of_drafts_that_yields_the_most_tokens_per_second():
    """1 + p + ... + p^m expected tokens per sequence over the measured time of a forward checking m
    drafts (m = 0: an `ar` step), the fastest recent time of each; every choice tried twice first,
    per batch size. A fixed cost ratio, or compiled passes, choose between a step and a full check;
    sampling checks all."""

    def seq(p, left=8, **params):
        s = SequenceState("r", [1], SamplingParams(**params), 8, torch.Generator(), torch.zeros(4), 0.0)
        s.block, s.resolved, s.verified = torch.zeros(8, dtype=torch.long), torch.arange(8) < 8 - left, 8 - left
        s.drafts, s.draft_hit = torch.ones(8, dtype=torch.long), p
        return s

    fixed = VerifyPolicy(window=4, cost_ratio=1.7)
    assert fixed.drafts_to_check([seq(0.5)]) == 4                  # 1.94 expected tokens
    assert fixed.drafts_to_check([seq(0.3)]) == 0                  # 1.42
    assert fixed.drafts_to_check([seq(0.3), seq(0.5)]) == 4        # one forward serves the batch
    # a block without a preview whose context offers nothing expects one token, whatever its draft_hit
    bare = seq(0.9)
    bare.drafts = None
    both, looked = [seq(0.3), bare], [[], []]
    assert fixed.drafts_to_check(both, looked=looked) == 0     # (use: use_looked, the default)
    bare.lookup_hit = 0.5                                          # ... and drafts from the context where it has some
    assert fixed.drafts_to_check(both, looked=[[], [7] * 4], use=[False, True]) == 4

    measured = VerifyPolicy(window=4)
    assert measured.choices == [0, 1, 2, 4]
    order = []
    for took in (60.0, 0.010, 0.012, 0.012, 0.013, 0.013, 0.020, 0.020):   # the first step compiled
        m = measured.drafts_to_check([seq(0.5)])
        order.append(m)
        measured.seconds.setdefault((m, 1), deque(maxlen=8)).append(took)
    assert order == [0, 0, 1, 1, 2, 2, 4, 4]
    # tokens per second: m=0 1/0.010 = 100, m=1 1.5/0.012 = 125, m=2 1.75/0.013 = 135, m=4 1.94/0.020 = 97
    assert measured.drafts_to_check([seq(0.5)]) == 2
    assert measured.drafts_to_check([seq(0.95)]) == 4              # 4.52 / 0.020 = 226 > 2.85 / 0.013 = 219
    assert measured.drafts_to_check([seq(0.1)]) == 0               # 1.1 / 0.012 = 92 < 100
    assert measured.drafts_to_check([seq(0.95, left=1)]) == 1      # one slot left: 1.95 tokens whatever m >= 1
    # another batch size: its step is measured (twice), the checks scaled from batch size 1 by the steps' ratio
    assert measured.drafts_to_check([seq(0.5)] * 2) == 0
    measured.seconds[(0, 2)] = deque([0.015, 0.015])
    assert measured._time(2, 2) == pytest.approx(0.013 * 1.5) and measured._time(4, 3) is None
    assert measured.drafts_to_check([seq(0.5)] * 2) == 2            # 2 * 1.75 / 0.0195 > 2 * 1.5 / 0.018 > 2 / 0.015
    measured.seconds[(2, 2)] = deque([0.040])                       # one sample: not trusted over the scaled
    assert measured._time(2, 2) == pytest.approx(0.0195) and measured.drafts_to_check([seq(0.5)] * 2) == 2
    measured.seconds[(2, 2)].append(0.040)                          # measured twice: no longer scaled
    assert measured.drafts_to_check([seq(0.5)] * 2) == 1
    assert measured.drafts_to_check([seq(0.1, temperature=0.8)]) == 4
    compiled = VerifyPolicy(window=4)   # compiled passes: a step or a full check (one graph per length)
    order = []
    for took in (0.010, 0.010, 0.020, 0.020):
        m = compiled.drafts_to_check([seq(0.5)], compiled=True)
        order.append(m)
        compiled.seconds.setdefault((m, 1), deque(maxlen=8)).append(took)
    assert order == [0, 0, 4, 4] and compiled.drafts_to_check([seq(0.95)], compiled=True) == 4


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_request_block_sizes_other_than_the_models_equal_ar(model, block_size):
    """One-slot blocks (full before their first check), and blocks longer than the model's (a prompt
    tail of up to 15 tokens in the first check), for every way of choosing checks."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, block_size=block_size)
    ar = [r.token_ids for r in Engine(model).generate(_prompts(), params.with_(algorithm="ar"))]
    for ratio in (0, None, 1e9):
        engine = Engine(model, max_batch_size=3, policies={"verify": VerifyPolicy(cost_ratio=ratio)})
        got = engine.generate(_prompts(), params.with_(algorithm="verify"))
        assert [r.token_ids for r in got] == ar and all(r.finish_reason == "length" for r in got), ratio


def test_seeded_sampled_verify_gives_the_same_tokens_alone_and_in_a_batch(model):
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, seed=7 + i, ignore_eos=True, algorithm="verify")
              for i in range(len(prompts))]
    batch = Engine(model, max_batch_size=4).generate(prompts, params)
    for p, sp, got in zip(prompts, params, batch, strict=True):
        assert Engine(model).generate([p], sp)[0].token_ids == got.token_ids


class EveryOtherPreview(VerifyPolicy):
    """Previews only the blocks of even index (the others decode by `ar` steps); drafts are `ar`'s own
    tokens, every fifth replaced by a wrong one when `poison`. Records, for each block decoded without
    a preview, whether the block before it left a token to commit (else the causal head's prediction of
    the first slot, from the check that kept all of the block's last drafts, fills it)."""

    def __init__(self, truth: list[int], prompt_len: int, vocab: int, window: int, poison: bool,
                 lookup: bool = True) -> None:
        super().__init__(window=window, cost_ratio=0, lookup=lookup)
        self.truth, self.prompt_len, self.vocab, self.poison = truth, prompt_len, vocab, poison
        self.left_behind: list[bool] = []

    def preview_worth(self, s, n, k, compiled=False, prefill=False):
        if prefill:
            return True                                   # the first block (index 0)
        worth = (s.pos // s.block_size + 1) % 2 == 0      # the next block's index
        if not worth:
            self.left_behind.append(self.waiting(s))
        return worth

    def _draft(self, engine, s, logits):
        super()._draft(engine, s, logits)
        for slot in (~s.resolved).nonzero().squeeze(-1).tolist():
            k = s.pos + slot - self.prompt_len
            if 0 <= k < len(self.truth):
                wrong = self.poison and (s.pos + slot) % 5 == 3
                s.drafts[slot] = (self.truth[k] + 1) % (self.vocab - 2) if wrong else self.truth[k]


@pytest.mark.parametrize(("window", "poison"), [(1, True), (4, True), (1, False), (4, False)])
def test_blocks_without_a_preview_equal_ar_and_leave_the_cache_a_prefill(model, window, poison):
    """Blocks decoded without a preview (after a block whose last token waits for the cache, and after
    one whose check predicted the next slot) write `ar`'s tokens, cost no preview, and the cache after
    every step is a prefill of the tokens before it."""
    prompt = _prompts()[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, algorithm="verify")
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    policy = EveryOtherPreview(truth, len(prompt), model.config.vocab_size, window, poison)
    engine = Engine(model, policies={"verify": policy})
    engine.add_request(prompt, params)
    result = None
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                result = ev.result
        for s in engine.running:
            if s.finish_reason is None:
                _assert_cache_is_prefill_of(model, engine, s, prompt + s.generated)
    assert result.token_ids == truth
    st = result.stats
    assert st.lookup_drafts > 0                         # blocks without a preview drafted from the context
    assert st.previews_skipped == len(policy.left_behind) >= 2
    # every block previewed (alone, fused with the prefill, or with the commit before it) or not
    assert st.preview_forwards + st.commit_forwards + st.previews_skipped == st.blocks
    assert st.nfe == st.preview_forwards + st.commit_forwards + st.check_forwards
    if poison:   # some blocks end on a rejected draft: its replacement waits for the cache
        assert any(policy.left_behind)
    else:        # every draft kept: the last check predicted the next block's first slot
        assert not any(policy.left_behind)


@pytest.mark.parametrize("skipped", [True, False])
def test_a_stop_on_a_blocks_first_slot_still_counts_the_block(model, skipped):
    """A block whose first slot is filled from the check before it (every draft kept) and is a stop
    token ends the sequence with no step of its own: that block is counted, previewed or not."""
    prompt = _prompts()[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, algorithm="verify")
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    b = model.config.block_size
    # the first slots of generated blocks that EveryOtherPreview previews (even index) or not (odd)
    first = [k for k in range(1, len(truth)) if (len(prompt) + k) % b == 0 and truth[k] not in truth[:k]
             and (len(prompt) + k) // b % 2 == int(skipped)]
    k = first[0]
    stop = params.with_(stop_token_ids=(truth[k],))
    policy = EveryOtherPreview(truth, len(prompt), model.config.vocab_size, 4, poison=False)
    result = Engine(model, policies={"verify": policy}).generate([prompt], stop)[0]
    assert result.token_ids == truth[:k] and result.finish_reason == "stop"   # the stop token is not output
    st = result.stats
    assert st.previews_skipped == len(policy.left_behind) >= int(skipped)
    assert st.preview_forwards + st.commit_forwards + st.previews_skipped == st.blocks
    assert st.blocks == (len(prompt) + k) // b - len(prompt) // b + 1


def test_the_trace_of_a_block_without_a_preview_shows_no_drafts(model):
    """The slots of a block decoded by `ar` steps have no draft: recorded as NO_DRAFT at confidence 0,
    shown as such by the trace page, never as the mask token at full confidence."""
    prompt = _prompts()[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, algorithm="verify", record_steps=True)
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    policy = EveryOtherPreview(truth, len(prompt), model.config.vocab_size, 4, poison=True, lookup=False)
    result = Engine(model, policies={"verify": policy}).generate([prompt], params)[0]
    assert result.stats.previews_skipped >= 1 and result.stats.lookup_drafts == 0
    data = trace_data(result, "", lambda ids: " ".join(map(str, ids)))
    started = len(prompt) // model.config.block_size   # the block of the prompt's tail, previewed by the prefill
    plain = [(rec, step) for rec, step in zip(result.trace, data["steps"], strict=True)
             if rec.block > started and rec.block % 2 == 1]
    assert plain
    assert any(model.config.mask_token_id in rec.tokens for rec, _ in plain)
    for rec, step in plain:
        unknown = [i for i, t in enumerate(rec.tokens) if t == model.config.mask_token_id]
        assert all(rec.draft[i] == NO_DRAFT and rec.confidence[i] == 0.0 and not step["drafted"][i] for i in unknown)
        assert all(str(model.config.mask_token_id) not in step["pieces"][i] for i in unknown)
    previewed = [rec for rec in result.trace if rec.block % 2 == 0 or rec.block == started]
    assert previewed and all(NO_DRAFT not in rec.draft for rec in previewed)


def test_a_block_is_previewed_when_its_drafts_save_more_than_the_preview_costs():
    def seq(p, **params):
        s = SequenceState("r", [1], SamplingParams(**params), 32, torch.Generator(), torch.zeros(4), 0.0)
        s.draft_hit = p
        s.block, s.pos, s.cached = torch.zeros(32, dtype=torch.long), 0, 31   # its last token waits for the cache
        return s

    policy = VerifyPolicy(window=4)
    assert policy.preview_worth(seq(0.1), 1, 1)                     # nothing measured yet: preview
    for key, took in (((0, 1), 0.010), ((4, 1), 0.020), (("preview", 1), 0.040)):
        policy.seconds[key] = deque([took])
    # p = 0.9: a check of 4 yields 4.1 tokens in 0.020 s; 32 slots save 32 * (0.010 - 0.0049) = 0.16 s > the
    # preview's 0.040 - 0.010
    assert policy.preview_worth(seq(0.9), 1, 1)
    # ... unless drafts from the context do as well without a preview (found at every step, kept at 0.9)
    copier = seq(0.9)
    copier.lookup_found, copier.lookup_hit = 1.0, 0.9
    assert not policy.preview_worth(copier, 1, 1)
    copier.skipped = 0
    no_lookup = VerifyPolicy(window=4, lookup=False)
    no_lookup.seconds = dict(policy.seconds)
    assert no_lookup.preview_worth(copier, 1, 1)
    # p = 0.3: 1.42 tokens per 0.020 s is slower than a step: skip, probing after 1, 2, 4, 8, 8 skips
    low = seq(0.3)
    got = [policy.preview_worth(low, 1, 1) for _ in range(30)]
    probes = [i for i, g in enumerate(got) if g]
    assert probes == [1, 4, 9, 18, 27]
    low.draft_hit = 0.9                                              # the probe found drafts worth it again
    assert policy.preview_worth(low, 1, 1) and low.skip_limit == 1
    # p = 0.59: saves 32 * (0.010 - 0.020 / 2.26) = 0.037 s; worth at batch 1 (0.040 - 0.010 = 0.030), not
    # where one of 4 sequences needs its own preview forward (0.040 in full)
    policy.seconds[(0, 4)], policy.seconds[(4, 4)] = deque([0.010]), deque([0.020])
    assert policy.preview_worth(seq(0.59), 1, 1) and not policy.preview_worth(seq(0.59), 4, 1)
    # the same where the last check kept every draft (the block's tokens are all in the cache): the preview
    # is a forward of its own, timed apart, and saves no step: not worth at 0.040, worth at 0.030
    alone = seq(0.59)
    alone.cached = 32                                                # the whole block is in the cache
    assert policy.preview_worth(alone, 1, 1)                         # not measured yet: preview
    policy.seconds[("preview alone", 1)] = deque([0.040])
    assert not policy.preview_worth(alone, 1, 1)
    policy.seconds[("preview alone", 1)] = deque([0.030])
    alone.skipped = 0
    assert policy.preview_worth(alone, 1, 1)
    assert policy.preview_worth(seq(0.1, temperature=0.8), 1, 1)     # sampled: always (seeded tokens)
    assert VerifyPolicy(cost_ratio=0).preview_worth(seq(0.0), 1, 1)
    fixed = VerifyPolicy(window=4, cost_ratio=1.7)
    assert fixed.preview_worth(seq(0.5), 1, 1) and not fixed.preview_worth(seq(0.3), 1, 1)



class _PlainFirstBlock(VerifyPolicy):
    """`verify` whose first blocks are never previewed (the prefill commits whole prompt blocks causally;
    a prompt tail waits for the first check); later blocks as the policy decides."""

    def preview_worth(self, s, n, k, compiled=False, prefill=False):
        return False if prefill else super().preview_worth(s, n, k, compiled)


@pytest.mark.parametrize(("lookup", "setup"), [(True, "plain"), (False, "plain"), (True, "chunked"), (True, "prefix")])
def test_a_first_block_without_a_preview_equals_ar_and_leaves_the_cache_a_prefill(model, lookup, setup):
    """Prompts with a tail, on a block boundary, shorter than a block, decoded together (prefilled at
    once, in chunks of a block, or after a prefix restored from the cache): the first block drafts from
    the context or steps, and the output and the cache after each step are `ar`'s."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, algorithm="verify")
    prompts = _prompts()
    truth = [r.token_ids for r in Engine(model).generate(prompts, params.with_(algorithm="ar"))]
    opts = {"chunked": {"max_prefill_tokens": 8}, "prefix": {"prefix_cache_bytes": 64 << 20}}.get(setup, {})
    engine = Engine(model, max_batch_size=len(prompts), policies={"verify": _PlainFirstBlock(window=4, lookup=lookup)},
                    **opts)
    if setup == "prefix":   # the same prompts once before: their whole blocks are restored
        assert [r.token_ids for r in engine.generate(prompts, params)] == truth
    rids = [engine.add_request(p, params) for p in prompts]
    results = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result
        for s in engine.running:
            if s.finish_reason is None and s.cached >= s.pos:
                _assert_cache_is_prefill_of(model, engine, s, s.prompt + s.generated)
    assert [results[r].token_ids for r in rids] == truth
    for r, p in zip(rids, prompts, strict=True):
        st = results[r].stats
        # chunks of a block before the policy's prefill, up to the block under `reusable`, where that is past 8
        limit = (len(p) // 8 * 8 - (len(p) % 8 == 0)) // 8 * 8
        chunks = limit // 8 if setup == "chunked" and limit > 8 else 0
        assert st.previews_skipped >= 1 and st.prefill_forwards == 1 + chunks
        assert st.preview_forwards + st.commit_forwards + st.previews_skipped == st.blocks
        assert st.nfe == st.preview_forwards + st.commit_forwards + st.check_forwards
        if setup == "prefix":
            assert st.cached_tokens == (len(p) - 1) // 8 * 8


def test_new_sequences_start_from_what_earlier_ones_found(model):
    """The policy's prior (kept drafts, drafts found in the context) follows every observation, and a new
    sequence starts from it: with a fixed cost ratio its first block is previewed iff the prior says the
    drafts pay. The output is `ar`'s either way."""
    prompt = _prompts()[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, algorithm="verify")
    truth = Engine(model).generate([prompt], params.with_(algorithm="ar"))[0].token_ids
    policy = VerifyPolicy(window=4, cost_ratio=1.7)   # preview iff 1 + p + .. + p^4 > 1.7: p > 0.41
    engine = Engine(model, policies={"verify": policy})
    for hit, previewed in ((0.1, False), (0.9, True)):
        policy.prior["draft_hit"] = hit
        engine.add_request(prompt, params)
        engine.step()                                         # admission and prefill
        (s,) = engine.running
        assert s.draft_hit == hit and (s.drafts is not None) == previewed
        while engine.has_unfinished():
            for ev in engine.step():
                if ev.finished:
                    assert ev.result.token_ids == truth
        assert policy.prior["draft_hit"] != hit               # it learned from this sequence's checks
    before = dict(policy.prior)
    s = SequenceState("r", [1], SamplingParams(), 8, torch.Generator(), torch.zeros(4), 0.0)
    policy._learn(s, "lookup_hit", 1.0)
    assert s.lookup_hit == 0.5 + policy._RATE * 0.5
    assert policy.prior["lookup_hit"] == pytest.approx(before["lookup_hit"] + policy._PRIOR * (1 - before["lookup_hit"]))


def test_lookup_match_continues_the_last_earlier_occurrence_of_the_longest_suffix():
    ctx = np.array([5, 1, 2, 3, 9, 1, 2, 4, 7, 8, 1, 2])
    assert lookup_match(ctx, 3)[0] == [4, 7, 8]            # "1 2" last seen before "4 7 8" (not "3 9")
    assert lookup_match(ctx, 3, longest=1)[0] == [4, 7, 8]  # "2" alone: the same occurrence
    assert lookup_match(ctx, 3, shortest=2)[0] == [4, 7, 8] and lookup_match(ctx, 3, shortest=3)[0] == []  # "8 1 2" is new
    assert lookup_match(ctx, 3) == ([4, 7, 8], 2) and lookup_match(np.array([1, 2, 3]), 2) == ([], 0)
    assert lookup_match(np.array([3, 1, 2, 0, 1, 2, 3, 1, 2]), 2)[0] == [0, 1]   # "3 1 2" beats "1 2"
    assert lookup_match(np.array([1, 2, 3]), 4)[0] == []    # the last token is new
    assert lookup_match(np.array([4, 6, 4]), 5)[0] == [6, 4, 6, 4, 6]   # up to the end, then the loop again
    assert lookup_match(np.array([7, 7, 7]), 4)[0] == [7, 7, 7, 7]
    assert lookup_match(np.array([4]), 2)[0] == [] and lookup_match(np.array([], dtype=np.int64), 2)[0] == []


def test_context_lookup_equals_lookup_match_as_the_context_grows():
    """The incremental index the decoder keeps gives what the full scan gives, step by step: small
    vocabularies (many repeats, loops into the context's end), every suffix range, tokens arriving one or
    several at a time, an empty start."""
    rng = np.random.default_rng(0)
    for _ in range(400):
        vocab = int(rng.choice([2, 3, 8, 100]))
        shortest = int(rng.integers(1, 3))
        longest = int(rng.integers(shortest, 5))
        lookup = ContextLookup(rng.integers(0, vocab, int(rng.integers(0, 20))).tolist(), longest, shortest)
        for _ in range(15):
            k = int(rng.integers(1, 9))
            ref = lookup_match(np.asarray(lookup.tokens, dtype=np.int64), k, longest, shortest)
            got = lookup.match(k)
            assert got == ref, (lookup.tokens, k, longest, shortest)
            assert all(type(x) is int for x in got[0] + ref[0])   # plain ints, as token lists are
            lookup.tokens += rng.integers(0, vocab, int(rng.integers(0, 4))).tolist()


def test_lookup_drafts_are_offered_to_greedy_requests_and_checked_where_they_are_kept_more(model):
    """Greedy requests draft from the context (sampled ones do not, and `lookup=False` turns it off); the
    drafts stay within the block. A block without a preview checks them; a previewed block checks them only
    where they have been kept more often than the preview's (`use_looked`). (Under a grammar they are drafted
    too: the check masks each row, tests/test_structured.py holds verify == ar there.)"""
    policy = VerifyPolicy(window=4)
    prompt = [3, 4, 5, 6, 3, 4]
    s = SequenceState(rid="x", prompt=prompt, params=SamplingParams(algorithm="verify"), block_size=3,
                      generator=torch.Generator(), counts=None, started=0.0)
    s.block = torch.zeros(3, dtype=torch.long)
    s.verified = 1
    assert policy.looked_up(s) == [5, 6]                  # 2 slots left in the block
    assert VerifyPolicy(lookup=False).looked_up(s) == []
    assert policy.use_looked(s, [5, 6]) and policy.use_looked(s, [])   # no preview: the context's, or none
    s.drafts = s.block.clone()                            # a previewed block
    assert policy.looked_up(s) == [5, 6]
    s.draft_hit, s.lookup_hit = 0.5, 0.5
    assert not policy.use_looked(s, [5, 6])               # a tie keeps the preview's drafts
    s.lookup_hit = 0.6
    assert policy.use_looked(s, [5, 6]) and not policy.use_looked(s, [])
    s.drafts = None
    s.params = SamplingParams(algorithm="verify", temperature=0.7)
    assert policy.looked_up(s) == []


def test_min_tokens_yields_to_a_grammar_completed_inside_a_check():
    """`ar` ends a constrained reply when its grammar completes, min_tokens or not (nothing but the end
    may follow); a check whose drafts complete the grammar must end it at the same token rather than mask
    the row after it to nothing (it failed with "no token is allowed")."""
    from clover.engine.structured import Constraint

    tok = Tokenizer.load(SHIPPED)
    torch.manual_seed(0)
    m = CloverForCausalLM(CloverConfig.preset("debug", vocab_size=tok.vocab_size, mask_token_id=tok.mask_token_id,
                                              eos_token_id=tok.eos_token_ids)).eval()
    prompt = tok.encode("The answer is")
    free = Engine(m, tok).generate([prompt], SamplingParams(max_new_tokens=4, algorithm="ar", ignore_eos=True))[0]
    pattern = r"[A-Z][a-z]{2,5}-\d{3}"
    for constraint in (Constraint("regex", pattern), Constraint("regex", pattern, trigger=free.token_ids[1])):
        params = SamplingParams(max_new_tokens=30, algorithm="ar", constraint=constraint, min_tokens=25)
        a = Engine(m, tok).generate([prompt], params)[0]
        assert a.finish_reason == "stop" and len(a.token_ids) < 25   # the grammar ended it before min_tokens
        truth = a.token_ids + [tok.eos_token_ids[0]] * 2               # drafts: the reply, then its end
        for window in (3, 8):
            v = Engine(m, tok, policies={"verify": TruthfulVerify(truth, len(prompt), window)}).generate(
                [prompt], params.with_(algorithm="verify"))[0]
            assert (v.token_ids, v.finish_reason) == (a.token_ids, "stop"), (constraint.trigger, window)
