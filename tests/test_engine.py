"""The decoding engine: the low_confidence rules step by step, batching, limits, seeds, penalties."""

import pytest
from fakes import CharTokenizer, ScriptedModel

from clover.engine.engine import Engine
from clover.engine.sampling import SamplingParams
from clover.model.config import CloverConfig

GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True, record_steps=True)


def _table(table, default=(1, 0.1)):
    """script from {(j, position): (token, prob)}."""
    return lambda j, pos: table.get((j, pos), default)


def test_threshold_and_fallback_accept_exactly_the_prescribed_positions():
    # prompt of 11, block 8: prefill 8, first block = 3 prompt tokens + 5 masks at positions 11..15
    table = {
        (0, 11): (20, 0.5), (0, 12): (21, 0.97), (0, 13): (22, 0.2), (0, 14): (23, 0.96), (0, 15): (24, 0.3),
        (1, 11): (30, 0.6), (1, 13): (32, 0.4), (1, 15): (34, 0.7),     # none >= 0.95: only the best, 15
        (2, 11): (40, 0.99), (2, 13): (42, 0.951),                      # both
    }
    model = ScriptedModel(_table(table))
    result = Engine(model).generate([list(range(11))], GREEDY)[0]
    assert model.calls[0] == ("causal", [list(range(8))], [0])       # prefill of floor(P/B)*B tokens
    assert model.calls[1] == ("preview", [[8, 9, 10, 63, 63, 63, 63, 63]], [0])  # prompt tail fixed in block
    assert result.token_ids == [40, 21, 42, 23, 34]
    assert result.accept_steps == [3, 1, 3, 1, 2]
    assert [r.accepted for r in result.trace] == [[4, 6], [7], [3, 5]]
    assert result.stats.preview_forwards == 3 and result.finish_reason == "length"
    assert result.stats.commit_forwards == 0  # the last block is not committed: the sequence is done


def test_cap_per_step_keeps_the_most_confident():
    table = {(0, p): (p, c) for p, c in zip(range(8, 16), [0.96, 0.99, 0.97, 0.98, 0.5, 0.995, 0.96, 0.2], strict=True)}
    model = ScriptedModel(_table(table, default=(1, 0.99)))
    params = GREEDY.with_(max_new_tokens=8, max_accept_per_step=2)
    result = Engine(model).generate([list(range(8))], params)[0]
    assert [r.accepted for r in result.trace][0] == [1, 5]  # 0.99 and 0.995 of the five above 0.95
    assert all(len(r.accepted) <= 2 for r in result.trace)


def test_eos_fills_the_rest_of_the_block_and_stops():
    eos = 62
    table = {(0, 10): (eos, 0.99), (0, 9): (7, 0.3), (1, 9): (7, 0.99), (0, 8): (5, 0.99)}
    model = ScriptedModel(_table(table, default=(3, 0.1)))
    result = Engine(model).generate([list(range(8))], SamplingParams(max_new_tokens=20, record_steps=True))[0]
    first = result.trace[0]
    assert first.accepted == [0, 2, 3, 4, 5, 6, 7] and first.tokens[3:] == [eos] * 5  # later slots: EOS at once
    assert result.token_ids == [5, 7] and result.finish_reason == "stop"
    assert result.stats.preview_forwards == 2 and len(result.trace) == 2


def test_truncated_last_block_and_exact_max_new_tokens():
    model = ScriptedModel(lambda j, pos: (pos % 40, 0.99))  # every slot confident: one preview per block
    result = Engine(model).generate([list(range(11))], GREEDY.with_(max_new_tokens=10))[0]
    previews = [c[1][0] for c in model.calls if c[0] == "preview"]
    assert [len(b) for b in previews] == [8, 5]  # 3 prompt + 5 new, then the last block cut to the 5 left
    assert len(result.token_ids) == 10 and result.finish_reason == "length"
    assert result.token_ids == [p % 40 for p in range(11, 21)]
    # block 1: its preview fused with the prefill; block 2: its preview fused with block 1's commit
    assert result.stats.blocks == 2 and result.stats.commit_forwards == 1 and result.stats.nfe == 2


def test_stop_token_ids_and_stop_strings_are_exact():
    # tokens spell "abcdefgh..." from position 8 on; AR and diffusion
    for algorithm in ("ar", "low_confidence"):
        model = ScriptedModel(lambda j, pos: (pos - 8, 0.99), ar_script=lambda pos: (pos - 8, 0.99))
        engine = Engine(model, tokenizer=CharTokenizer())
        params = SamplingParams(max_new_tokens=12, algorithm=algorithm, stop=("def",))
        result = engine.generate([list(range(8))], params)[0]
        assert result.text == "abc" and result.finish_reason == "stop", algorithm
        assert result.token_ids == [0, 1, 2, 3, 4, 5]  # up to the token that completes the stop string
        assert result.stop_token is None and result.completion_tokens == 6
        result = engine.generate([list(range(8))], params.with_(stop=(), stop_token_ids=(4,)))[0]
        assert result.token_ids == [0, 1, 2, 3] and result.text == "abcd" and result.finish_reason == "stop"
        # the stop token is not output, but it was generated: usage counts it (vLLM keeps it in token_ids)
        assert result.stop_token == 4 and result.completion_tokens == 5
        result = engine.generate([list(range(8))], params.with_(stop=()))[0]
        assert result.finish_reason == "length" and result.stop_token is None and result.completion_tokens == 12


def test_a_stop_string_completed_before_min_tokens_does_not_count():
    """vLLM's rule: no stop string is looked for before min_tokens tokens. "def" is complete at the 6th token:
    at min_tokens 6 the reply stops there; at 7 it runs on to max_new_tokens (found by a review: min_tokens
    held back stop tokens but not stop strings)."""
    for algorithm in ("ar", "low_confidence"):   # (emit's rule, the same for every decoder)
        model = ScriptedModel(lambda j, pos: (pos - 8, 0.99), ar_script=lambda pos: (pos - 8, 0.99))
        engine = Engine(model, tokenizer=CharTokenizer())
        params = SamplingParams(max_new_tokens=12, algorithm=algorithm, stop=("def",), min_tokens=6)
        result = engine.generate([list(range(8))], params)[0]
        assert (result.text, result.finish_reason) == ("abc", "stop"), algorithm
        result = engine.generate([list(range(8))], params.with_(min_tokens=7))[0]
        assert (result.text, result.finish_reason) == ("abcdefghijkl", "length"), algorithm


def test_a_stop_string_before_a_stop_token_in_one_run_leaves_no_stop_logprob():
    """A run of several tokens (a verified draft) holding a stop string and then a stop token ends at the
    string: the stop token's logprob entry (which scorers read after the reply) is not the reply's (found by
    a review from reading: it was kept, after tokens it does not follow)."""
    import torch

    engine = Engine(ScriptedModel(), tokenizer=CharTokenizer())
    rid = engine.add_request([1, 2], SamplingParams(max_new_tokens=8, algorithm="ar", stop=("b",), logprobs=1))
    s = engine.waiting[0]
    events = []
    engine.emit_final(s, [0, 1, 2, 62], [1, 1, 1, 1], events, torch.zeros(4, 64))   # "abc", then end of sequence
    (ev,) = events
    assert ev.request_id == rid and ev.finished and ev.result.finish_reason == "stop"
    assert ev.result.text == "a" and ev.result.token_ids == [0, 1] and ev.result.stop_logprob is None
    assert ev.result.stop_token is None and ev.result.completion_tokens == 2
    assert len(ev.result.logprobs) == 2


def test_a_stop_string_seen_before_min_tokens_still_stops_the_reply_when_it_comes_again():
    """A run of several tokens (a block) that holds a stop string twice, the first before min_tokens: the reply
    stops at the second, where one-token decoding stops, with a shorter stop beside a longer one too (a review
    found the first version looking for each stop's first occurrence only: the block ran to max_new_tokens)."""
    seq = [23, 0, 23, 1, 2, 3, 4, 5, 6, 7, 8, 9]   # "xaxbcdefghij"
    for algorithm in ("ar", "low_confidence"):
        for stops in (("x",), ("x", "zzzzz")):
            model = ScriptedModel(lambda j, pos: (seq[pos - 8], 0.99), ar_script=lambda pos: (seq[pos - 8], 0.99))
            result = Engine(model, tokenizer=CharTokenizer()).generate([list(range(8))], SamplingParams(
                max_new_tokens=12, algorithm=algorithm, block_size=8, stop=stops, min_tokens=3))[0]
            assert (result.text, result.token_ids, result.finish_reason) == ("xa", [23, 0, 23], "stop"), \
                (algorithm, stops)


def test_overlapping_stop_strings_stop_where_one_token_decoding_stops():
    # "bcdefg" starts first but "de" completes first: a block that commits "abcdefgh" at once must stop where
    # `ar`, one token at a time, stops (after "e", the text before "de")
    for algorithm in ("ar", "low_confidence"):
        model = ScriptedModel(lambda j, pos: (pos - 8, 0.99), ar_script=lambda pos: (pos - 8, 0.99))
        result = Engine(model, tokenizer=CharTokenizer()).generate([list(range(8))], SamplingParams(
            max_new_tokens=12, algorithm=algorithm, block_size=8, stop=("bcdefg", "de")))[0]
        assert (result.text, result.token_ids, result.finish_reason) == ("abc", [0, 1, 2, 3, 4], "stop"), algorithm


def test_streamed_text_never_shows_a_partial_stop_string():
    model = ScriptedModel(lambda j, pos: (pos - 8, 0.99))
    engine = Engine(model, tokenizer=CharTokenizer())
    params = SamplingParams(max_new_tokens=30, stop=("jkl",), block_size=4)
    events = list(engine.stream(list(range(8)), params))
    assert "".join(e.text for e in events) == "abcdefghi"
    assert [e.text for e in events][:2] == ["abcd", "efgh"]
    assert events[-1].finished and events[-1].result.text == "abcdefghi"


def test_the_held_back_tail_is_the_longest_stop_prefix_as_the_text_grows():
    """`_stop_tail` bounds each stop's tail by the last one (the work is the new text's, not every prefix of
    every stop on every event: 16 stops of 1 KiB slowed a whole batch ~10x): the same tail as trying every
    prefix, on random texts over a small alphabet (many partial matches) grown a few characters at a time."""
    import random

    from clover.engine.sequence import SequenceState

    rng = random.Random(0)
    for _ in range(200):
        stops = tuple("".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 3)))
        s = SequenceState(rid="x", prompt=[], params=SamplingParams(), block_size=8, generator=None, counts=None,
                          started=0.0)
        s.params = s.params.with_(stop=stops)
        for _ in range(12):
            s.decoded += "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            want = max((k for stop in stops for k in range(len(stop) - 1, 0, -1) if s.decoded.endswith(stop[:k])),
                       default=0)
            assert Engine._stop_tail(s) == want, (stops, s.decoded)


def test_penalties_count_response_tokens_only():
    # AR model that always prefers token 5 (p=0.05, every other token 0.95/62 ~ 0.015)
    model = ScriptedModel(ar_script=lambda pos: (5, 0.05))
    engine = Engine(model)
    base = SamplingParams(max_new_tokens=3, algorithm="ar", ignore_eos=True)
    assert engine.generate([[5, 5, 5]], base)[0].token_ids == [5, 5, 5]   # prompt occurrences do not count
    out = engine.generate([[5, 5, 5]], base.with_(frequency_penalty=2.0))[0].token_ids
    assert out[0] == 5 and out[1] != 5                                   # penalised once it was generated
    out = engine.generate([[1]], base.with_(repetition_penalty=10.0))[0].token_ids
    assert out[0] == 5 and out[1] != 5


@pytest.mark.parametrize("bad,message", [
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(threshold=1.5), "threshold"),
    (dict(algorithm="beam"), "algorithm"),
    (dict(block_size=0), "block_size"),
    (dict(max_accept_per_step=0), "max_accept_per_step"),
    (dict(stop_token_ids=(99,)), "stop_token_ids"),
    (dict(max_new_tokens=2000), "exceeds the context limit of 1024"),
    (dict(stop=("x",)), "stop strings need a tokenizer"),
    # found by a hostile pass (session 55): raw TypeErrors, a RuntimeError, a failure at the first step, or
    # True taken as 1
    (dict(stop_token_ids=5), "stop_token_ids must be a list"),
    (dict(stop_token_ids=tuple(range(2000))), "up to 1024"),
    (dict(logit_bias=5), "logit_bias"),
    (dict(logit_bias=((True, 5.0),)), "logit_bias"),
    (dict(logit_bias=((1, "5"),)), "logit_bias"),
    (dict(seed=True), "seed"),
    (dict(block_size=True), "block_size"),
    (dict(top_k=True), "top_k"),
    (dict(max_accept_per_step=True), "max_accept_per_step"),
    (dict(temperature="0.5"), "temperature"),
    (dict(min_p=1.5), "min_p"),
    (dict(temperature=10**400), "temperature"),   # (too large for a float: an OverflowError, a review found)
])
def test_bad_parameters_are_rejected_with_the_field_named(bad, message):
    with pytest.raises(ValueError, match=message):
        Engine(ScriptedModel()).add_request([1, 2], SamplingParams(**bad))


def test_parameters_take_the_spellings_of_other_apis():
    """One stop string, lists, OpenAI's logit_bias mapping and top_k -1 (off), as vLLM's SamplingParams takes
    them: a bare string was read as one stop string per character."""
    p = SamplingParams(stop="\n\n", stop_token_ids=[3, 4], logit_bias={5: 1.0, 6: -2.0}, top_k=-1)
    assert p.stop == ("\n\n",) and p.stop_token_ids == (3, 4) and p.logit_bias == ((5, 1.0), (6, -2.0))
    assert p.top_k == 0 and p.with_(top_k=5).top_k == 5
    p.validate(64)
    q = SamplingParams(logit_bias=[[5, 1.0]])   # (JSON's pairs: lists)
    assert q.logit_bias == ((5, 1.0),) and hash(q) == hash(SamplingParams(logit_bias=((5, 1.0),)))
    q.validate(64)


def test_generate_leaves_nothing_queued_when_a_request_is_refused_and_a_dropped_stream_aborts():
    engine = Engine(ScriptedModel())
    ok, bad = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([[1, 2], [1, 2], [1, 2]], [ok, ok, bad])
    assert not engine.has_unfinished()
    stream = engine.stream([1, 2], SamplingParams(max_new_tokens=50, algorithm="ar", ignore_eos=True))
    next(stream)
    assert engine.has_unfinished()
    stream.close()
    assert not engine.has_unfinished()


def test_bad_prompts_are_rejected():
    engine = Engine(ScriptedModel())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 64])
    engine.add_request([1], request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], request_id="a")


def test_rows_are_reused_and_the_cache_is_freed_when_idle():
    model = ScriptedModel(lambda j, pos: (1, 0.99))
    engine = Engine(model, max_batch_size=2)
    for n in (3, 9, 17):
        engine.add_request(list(range(n)), SamplingParams(max_new_tokens=4 + n, ignore_eos=True))
    engine.step()
    assert engine.num_running == 2 and len(engine.waiting) == 1
    rows = engine.cache.batch_size
    while engine.has_unfinished():
        engine.step()
        if engine.cache is not None:
            assert engine.cache.batch_size == rows  # the third request reused a freed row
    assert engine.cache is None


def test_abort_frees_the_row():
    engine = Engine(ScriptedModel(lambda j, pos: (1, 0.1)))
    a = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.abort(a) and not engine.has_unfinished() and engine.cache is None
    assert not engine.abort("nope")


def test_incremental_text_equals_a_full_decode_at_every_split():
    """The engine decodes each new token with only the few before it; on multi-byte characters split
    across tokens and chunks of any size, the streamed text equals decoding everything at once."""
    import random
    from pathlib import Path

    from clover.model.tokenizer import Tokenizer

    tok = Tokenizer.load(Path(__file__).resolve().parents[1] / "clover" / "weights" / "clover-tiny")
    text = "naïve café — 東京 ☃ emoji 🙂🙂 done\n" * 3
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some tokens end inside a character
    model = ScriptedModel(lambda j, pos: (ids[(pos - 8) % len(ids)], 0.99),
                          ar_script=lambda pos: (ids[(pos - 8) % len(ids)], 0.99),
                          config=CloverConfig.preset("debug", vocab_size=tok.vocab_size, mask_token_id=tok.mask_token_id,
                                                     eos_token_id=tok.eos_token_ids))
    rng = random.Random(0)
    for algorithm in ("ar", "low_confidence"):
        engine = Engine(model, tokenizer=tok)
        params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, algorithm=algorithm,
                                block_size=rng.choice([2, 3, 5, 8]))
        streamed = "".join(ev.text for ev in engine.stream(list(range(8)), params))
        assert streamed == tok.decode(ids) == text
    stop = "🙂 done"
    for algorithm in ("ar", "low_confidence"):
        result = Engine(model, tokenizer=tok).generate([list(range(8))], SamplingParams(
            max_new_tokens=len(ids), ignore_eos=True, algorithm=algorithm, stop=(stop,)))[0]
        assert result.text == text[: text.index(stop)] and result.finish_reason == "stop"
        k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
        assert result.token_ids == ids[:k]


def test_greedy_picks_the_first_largest_finite_logit_with_or_without_its_confidence():
    """The greedy pick takes one reduction when every row's maximum is finite and the general path else:
    NaN is never chosen, +inf is the largest value (the first of several), a row with nothing allowed
    is an error; the confidence is the chosen token's softmax probability, or None when not asked for."""
    import math

    import torch

    from clover.engine.sampling import pick_tokens, token_distribution

    inf, nan = math.inf, math.nan
    greedy = SamplingParams(max_new_tokens=1)
    rows = torch.tensor([[0.0, 2.0, 2.0, 1.0],     # equal maxima: the first
                         [nan, 1.0, 3.0, nan],     # NaN is not a candidate
                         [1.0, inf, 0.0, inf],     # +inf: the first of them
                         [-inf, -inf, 5.0, -inf]])
    counts = torch.zeros(4)
    tokens, conf = pick_tokens(rows, greedy, counts, None)
    assert tokens.tolist() == [1, 2, 1, 2]
    assert torch.allclose(conf[[0, 3]], torch.tensor([torch.softmax(rows[0], -1)[1], 1.0]))
    assert torch.allclose(conf[1], torch.softmax(torch.tensor([-inf, 1.0, 3.0, -inf]), -1)[2])
    no_conf = pick_tokens(rows, greedy, counts, None, confidence=False)
    assert no_conf[1] is None and no_conf[0].tolist() == tokens.tolist()
    assert token_distribution(rows, greedy, counts).argmax(-1).tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="no token is allowed"):
        pick_tokens(torch.tensor([[0.0, 1.0], [-inf, -inf]]), greedy, torch.zeros(2), None, confidence=False)
    nan = float("nan")   # broken weights: said as such, not blamed on a grammar
    with pytest.raises(ValueError, match="logits are NaN"):
        pick_tokens(torch.tensor([[0.0, 1.0], [nan, nan]]), greedy, torch.zeros(2), None, confidence=False)


def test_the_batchs_plain_argmax_equals_the_pick_one_by_one_and_leaves_the_rest_to_it():
    """`Engine.greedy_picks`: one reduction for the rows whose pick is a plain argmax (the mask token
    excluded), the same token `pick_tokens` takes for them; None for a row with a penalty, a logit bias,
    a grammar, a stop held back by min_tokens, logprobs, sampling, or a maximum that is not finite."""
    import math

    import torch

    from clover.engine.sampling import pick_tokens
    from clover.engine.sequence import SequenceState

    engine = Engine(ScriptedModel())
    v, mask = engine.config.vocab_size, engine.config.mask_token_id
    logits = torch.randn(10, v, generator=torch.Generator().manual_seed(0))
    logits[0, mask] = 50.0                  # the mask token is never picked
    logits[1, 5] = logits[1, 7] = 40.0      # equal maxima: the first
    logits[8, 3] = math.nan                 # not finite: left to the one-by-one pick
    logits[7, mask] = math.nan              # NaN at the mask token only: masked out, the row is still plain
    plain = SamplingParams(max_new_tokens=8)
    params = [plain, plain, plain.with_(presence_penalty=0.5), plain.with_(logit_bias=((4, 2.0),)),
              plain.with_(min_tokens=3), plain.with_(logprobs=2), plain.with_(temperature=0.7, seed=1), plain.with_(min_tokens=2), plain, plain]
    seqs = [SequenceState(f"r{i}", [1], p, 8, torch.Generator(), torch.zeros(v), 0.0) for i, p in enumerate(params)]
    seqs[7].generated = [1, 2, 3]           # past its min_tokens: nothing held back, plain
    seqs[9].matcher = object()              # a grammar (only its presence matters here)
    picks = engine.greedy_picks(seqs, logits)
    assert picks[2:7] == [None] * 5 and picks[8] is None and picks[9] is None
    assert picks[1] == 5 and picks[0] != mask
    for i in (0, 1, 7):
        want = pick_tokens(engine.mask_out(logits[i: i + 1]), plain, torch.zeros(v), None)[0]
        assert picks[i] == int(want[0])
    # a check's positions [N,T,V]: T picks per plain row; a lazy grammar (waiting for its trigger, which
    # the drafts may hold) now leaves the row to the one-by-one check as well
    seqs[0].pending = object()
    several = torch.stack([logits, logits.roll(1, dims=0), logits.roll(2, dims=0)], dim=1)   # [10,3,V]
    rows = engine.greedy_picks(seqs, several)    # several[i, t] = logits[i - t]
    assert rows[0] is None and rows[2:7] == [None] * 5 and rows[8] is None and rows[9] is None
    assert rows[1] == [5, picks[0], int(engine.mask_out(logits[9]).argmax())]
    assert rows[7] == [picks[7], int(engine.mask_out(logits[6]).argmax()), int(engine.mask_out(logits[5]).argmax())]
    # bfloat16 logits (a model decoding in bf16), the mask token winning a row: the same picks
    half = several.bfloat16()
    assert engine.greedy_picks(seqs, half)[1] == [int(engine.mask_out(half[1, t]).argmax()) for t in range(3)]
    assert engine.greedy_picks(seqs, half[:, 0])[0] == int(engine.mask_out(half[0, 0]).argmax())
    # a maximum of +inf, and a row with nothing finite: left to the one-by-one pick (which says what is wrong)
    odd = logits[:2].clone()
    odd[0, 3], odd[1] = math.inf, -math.inf
    assert engine.greedy_picks(seqs[:2], odd) == [None, None]
    assert engine.greedy_picks(seqs[:2], odd[:, None].expand(-1, 2, -1)) == [None, None]


def test_token_counts_are_kept_only_for_requests_with_penalties():
    """A request without penalties carries no [vocabulary] count tensor (nothing reads it); one with any of the
    three penalties counts its tokens, the prompt excluded, as before."""
    engine = Engine(ScriptedModel())
    plain = engine.add_request([1, 2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    penalised = engine.add_request([1, 2], SamplingParams(max_new_tokens=4, ignore_eos=True, frequency_penalty=0.5))
    states = {s.rid: s for s in engine.waiting}
    assert states[plain].counts is None
    assert states[penalised].counts is not None and float(states[penalised].counts.sum()) == 0.0
    results = {}
    while engine.has_unfinished():
        results.update({ev.request_id: ev.result for ev in engine.step() if ev.finished})
    counts = states[penalised].counts
    assert states[plain].counts is None and len(results[plain].token_ids) == 4
    assert float(counts.sum()) == len(results[penalised].token_ids)
    for t in set(results[penalised].token_ids):
        assert float(counts[t]) == results[penalised].token_ids.count(t)


def test_the_batchs_confident_picks_equal_pick_tokens_slot_by_slot():
    """`Engine.confident_picks` (a `low_confidence` step's plain greedy sequences in one reduction): the
    tokens and confidences `pick_tokens` gives for each sequence's unresolved slots, bit for bit; None for
    the sequences it leaves to `pick_tokens` (sampling, a grammar, no slot, a maximum that is not finite)."""
    import math

    import torch

    from clover.engine.sampling import pick_tokens
    from clover.engine.sequence import SequenceState

    engine = Engine(ScriptedModel())
    v, mask = engine.config.vocab_size, engine.config.mask_token_id
    logits = torch.randn(5, 6, v, generator=torch.Generator().manual_seed(1)) * 4
    logits[0, 2, mask] = 60.0                # the mask token is never picked
    logits[1, 3, 9] = logits[1, 3, 11] = 50.0  # equal maxima: the first
    logits[4, 1, 0] = math.nan
    plain = SamplingParams(max_new_tokens=8)
    params = [plain, plain, plain.with_(temperature=0.5, seed=3), plain, plain]
    seqs = [SequenceState(f"r{i}", [1], p, 6, torch.Generator(), torch.zeros(v), 0.0) for i, p in enumerate(params)]
    slots = [torch.tensor([0, 2, 5]), torch.tensor([3]), torch.tensor([1, 2]), torch.tensor([], dtype=torch.long),
             torch.tensor([1, 4])]
    out = engine.confident_picks(seqs, logits, slots)
    assert out[2:] == [None, None, None]
    for i in (0, 1):
        want_tokens, want_conf = pick_tokens(engine.mask_out(logits[i, slots[i]]), plain, torch.zeros(v), None)
        assert torch.equal(out[i][0], want_tokens) and torch.equal(out[i][1], want_conf)
    assert int(out[0][0][1]) != mask and int(out[1][0][0]) == 9


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_likeliest():
    import torch

    from clover.engine.sampling import token_distribution

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.2)
    p = token_distribution(logits, params, None)   # 0.2 x 0.5 = 0.1: 0.05 goes, the rest renormalised
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.15, 0.0], [0.25] * 4]) / torch.tensor([[0.95], [1.0]]))
    assert torch.equal(token_distribution(logits, params.with_(min_p=0.0), None) > 0, torch.ones(2, 4, dtype=torch.bool))
