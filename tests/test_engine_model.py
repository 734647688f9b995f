"""The engine on a real (random-weight) model: thresholds, batch invariance, seeds, joins, AR parity."""

import pytest
import torch
from conftest import perturbed_model

from clover.engine.engine import WARM_UP_MAX_BATCH, Engine
from clover.engine.sampling import SamplingParams
from clover.model.config import CloverConfig

PROMPTS = [[3, 1, 4], list(range(20, 31)), list(range(100, 117)), [7] * 8]


@pytest.fixture(scope="module")
def sharp_model():
    """Random weights with a scaled-up head: peaked distributions, so thresholds accept several slots."""
    torch.manual_seed(0)
    model = perturbed_model(CloverConfig.preset("debug"))
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def test_threshold_one_accepts_one_token_per_step_and_zero_fills_each_block_at_once(sharp_model):
    engine = Engine(sharp_model)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, threshold=1.0, record_steps=True)
    one = engine.generate([PROMPTS[1]], params)[0]
    assert all(len(r.accepted) == 1 for r in one.trace)
    # 20 denoising steps = 20 forwards: 18 previews and the 2 commits that carry their next block's first step
    assert one.stats.nfe == 20 and one.stats.commit_forwards == 2 and sorted(one.accept_steps) == list(range(1, 21))
    zero = engine.generate([PROMPTS[1]], params.with_(threshold=0.0))[0]
    # 5 + 8 + 7 tokens, one step each: the first fused with the prefill, the others with the commits
    assert zero.stats.blocks == 3 and zero.stats.preview_forwards == 1 and zero.stats.commit_forwards == 2
    assert zero.stats.tpf == 20 / 3


def test_a_threshold_under_the_top_confidences_accepts_several_tokens_per_step(sharp_model):
    # confidences of this model's previews lie around 0.5-0.9
    result = Engine(sharp_model).generate([PROMPTS[2]], SamplingParams(max_new_tokens=24, ignore_eos=True,
                                                                       threshold=0.75, record_steps=True))[0]
    assert max(len(r.accepted) for r in result.trace) > 1  # the test exercises parallel acceptance
    assert result.stats.tpf > 1


def test_greedy_output_alone_equals_output_in_a_mixed_batch(sharp_model):
    engine = Engine(sharp_model)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, algorithm=a, threshold=0.75)
              for n, a in zip([13, 20, 9, 16], ["low_confidence", "ar", "low_confidence", "low_confidence"],
                              strict=True)]
    params[3] = params[3].with_(block_size=4, threshold=0.6)
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    together = [r.token_ids for r in engine.generate(PROMPTS, params)]
    assert together == alone
    assert [len(t) for t in alone] == [13, 20, 9, 16]


def test_joining_between_steps_does_not_change_outputs(sharp_model):
    engine = Engine(sharp_model)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, threshold=0.75)
    alone = [engine.generate([p], params)[0].token_ids for p in PROMPTS]
    results = {}
    ids = [engine.add_request(PROMPTS[0], params)]
    steps = 0
    while engine.has_unfinished():
        if steps in (1, 3, 4):
            ids.append(engine.add_request(PROMPTS[len(ids)], params))
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result.token_ids
        steps += 1
    assert [results[i] for i in ids] == alone


def test_finished_rows_are_refilled_from_above_and_no_output_changes(sharp_model):
    """When a sequence finishes, the running sequence in the highest row moves into its row (`Engine._compact`),
    so that each step's rows stay consecutive (a slice of the cache, which compiled passes need), with the
    running list in row order; moving a sequence, mid-block or mid-prefill, changes none of its tokens."""
    engine = Engine(sharp_model, max_batch_size=4)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, algorithm=a, threshold=0.75)
              for n, a in zip([3, 21, 6, 17], ["ar", "verify", "low_confidence", "ar"], strict=True)]
    params[2] = params[2].with_(block_size=4)
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params, strict=True)]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params, strict=True)]
    first_rows, moved, results = {}, set(), {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result.token_ids
        for s in engine.running:
            first_rows.setdefault(s.rid, s.row)
            if s.row != first_rows[s.rid]:
                moved.add(s.rid)
        assert [s.row for s in engine.running] == list(range(len(engine.running)))
    assert moved                                   # the test moved sequences: ...
    assert [results[i] for i in ids] == alone      # ... and none of them changed


def test_aborting_a_lower_row_outside_inference_mode_moves_the_others_unchanged(sharp_model):
    """Found by a hostile pass: the server aborts (a client gone) between steps, outside inference mode, and the
    compaction after it wrote the cache in place, which torch refuses for a tensor made in inference mode: the
    engine thread died and every request hung. Aborting the lowest row now moves the others down, and their
    outputs are those decoded alone."""
    engine = Engine(sharp_model, max_batch_size=4)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, algorithm=a, threshold=0.75)
              for a in ("ar", "verify", "low_confidence")]
    alone = [engine.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS[:3], params, strict=True)]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params, strict=True)]
    engine.step()
    engine.step()
    assert not torch.is_inference_mode_enabled()
    assert engine.abort(ids[0])
    assert [s.row for s in engine.running] == [0, 1]
    results = {}
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.finished:
                results[ev.request_id] = ev.result.token_ids
    assert [results[i] for i in ids[1:]] == alone[1:]
    assert engine.step() == [] and engine.cache is None   # idle: a step does nothing (it raised on the cache before)


def test_same_seed_same_sample_and_seeds_differ(sharp_model):
    engine = Engine(sharp_model)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.5, top_p=0.95, top_k=50, seed=7)
    a = engine.generate([PROMPTS[1]], params)[0].token_ids
    b = engine.generate([PROMPTS[1], PROMPTS[2]], [params, params.with_(seed=8)])[0].token_ids
    c = engine.generate([PROMPTS[1]], params.with_(seed=9))[0].token_ids
    assert a == b and a != c
    ar = params.with_(algorithm="ar")
    assert engine.generate([PROMPTS[0]], ar)[0].token_ids == engine.generate([PROMPTS[0]], ar)[0].token_ids


def test_eos_ends_generation_on_a_real_model():
    torch.manual_seed(0)
    model = perturbed_model(CloverConfig.preset("debug"))
    head = torch.nn.Linear(64, 512)  # a head whose bias makes EOS (510) likely everywhere, after a start
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[510] = 0.3
    model.lm_head = head
    for algorithm in ("ar", "low_confidence"):
        result = Engine(model).generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, algorithm=algorithm))[0]
        assert result.finish_reason == "stop" and 510 not in result.token_ids
        assert len(result.token_ids) < 20


def test_degenerate_sampling_values_decode_instead_of_failing(sharp_model):
    # temperatures too small to divide by are greedy; penalties that overflow stay finite
    engine = Engine(sharp_model)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True, algorithm="ar"))[0]
    for algorithm in ("ar", "low_confidence", "verify"):
        for extreme in (dict(temperature=1e-300, seed=1), dict(temperature=5e-324, seed=1),
                        dict(temperature=0.7, repetition_penalty=1e-300, seed=1)):
            r = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True, algorithm=algorithm,
                                                             **extreme))[0]
            assert r.finish_reason == "length" and len(r.token_ids) == 12, (algorithm, extreme)
            if extreme["temperature"] < 1e-5 and algorithm != "low_confidence":
                assert r.token_ids == greedy.token_ids


def test_a_failing_request_ends_alone_and_the_batch_goes_on(sharp_model, monkeypatch):
    real = Engine.emit

    def poisoned(self, s, *args, **kw):  # fails inside every policy's per-sequence code, for seed 666
        if s.params.seed == 666 and len(s.generated) >= 2:
            raise RuntimeError("poisoned")
        return real(self, s, *args, **kw)

    monkeypatch.setattr(Engine, "emit", poisoned)
    algs = ["ar", "verify", "low_confidence", "verify", "ar", "low_confidence", "verify", "ar"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    for bad in (0, 1, 2):  # the poisoned request decodes with ar, verify, low_confidence
        params = [SamplingParams(max_new_tokens=10, ignore_eos=True, algorithm=a, seed=666 if i == bad else i)
                  for i, a in enumerate(algs)]
        engine = Engine(sharp_model, max_batch_size=8)
        events = []
        for p, sp in zip(prompts, params, strict=True):
            engine.add_request(p, sp)
        while engine.has_unfinished():
            events += engine.step()
        ends = {e.request_id: e for e in events if e.finished}
        assert ends[f"req-{bad}"].result.finish_reason == "error"
        assert ends[f"req-{bad}"].error == "RuntimeError: poisoned"
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            if i != bad:
                alone = Engine(sharp_model).generate([p], sp)[0]
                assert ends[f"req-{i}"].result.token_ids == alone.token_ids and ends[f"req-{i}"].error is None


def test_warm_up_runs_every_policy_and_leaves_the_engine_idle(sharp_model):
    engine = Engine(sharp_model, prefix_cache_bytes=1 << 20, max_batch_size=5)
    calls = []
    for name, policy in engine.policies.items():
        step = policy.step
        policy.step = lambda e, seqs, events, step=step, name=name: (calls.append((name, len(seqs))),
                                                                      step(e, seqs, events))[1]
    engine.warm_up()
    assert {name for name, _ in calls} == {"ar", "low_confidence", "verify"}
    assert {n for _, n in calls} == {1, 2, 5}   # one sequence, two, a full batch (the passes' shape classes)
    assert not engine.has_unfinished() and not engine.running and engine.cache is None
    # a batch limit past the cap is not decoded whole (`serve --compile --max-batch-size 100000000` never started)
    big = Engine(sharp_model, max_batch_size=10**8)
    sizes = set()
    for policy in big.policies.values():
        policy.step = lambda e, seqs, events, step=policy.step: (sizes.add(len(seqs)), step(e, seqs, events))[1]
    big.warm_up()
    assert sizes == {1, 2, WARM_UP_MAX_BATCH}
    after = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=8, algorithm="ar"))[0]
    assert after.token_ids == Engine(sharp_model).generate([PROMPTS[1]], SamplingParams(max_new_tokens=8,
                                                                                        algorithm="ar"))[0].token_ids
