"""The prefix cache across requests: a hit never changes the output, for every algorithm."""

import pytest
import torch
from conftest import perturbed_model

from clover.engine.engine import Engine
from clover.engine.policies import VerifyPolicy
from clover.engine.prefix_cache import block_keys
from clover.engine.sampling import SamplingParams
from clover.model.config import CloverConfig
from clover.model.modeling import GDNTrace

ALGORITHMS = ("ar", "low_confidence", "verify")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = perturbed_model(CloverConfig.preset("debug"))  # block size 8
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params(algorithm: str, n: int = 14) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, algorithm=algorithm, threshold=0.6)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_hit_gives_the_same_output_as_a_cold_prefill(model, algorithm):
    """With GDN states after every block (`prefix_state_every=1`): any whole-block prefix is restored."""
    shared = _tokens(37, 1)                               # 4 whole blocks and a tail of 5
    first, second = shared + _tokens(6, 2), shared + _tokens(11, 3)   # the second ends mid-block too
    cold = Engine(model)
    warm = Engine(model, prefix_cache_bytes=64 << 20, prefix_state_every=1)
    warm.generate([first], _params(algorithm))
    for prompt in (second, first, shared[:16], shared[:17]):   # sharing part, all, exactly on / past a boundary
        got = warm.generate([prompt], _params(algorithm))[0]
        want = cold.generate([prompt], _params(algorithm))[0]
        assert got.token_ids == want.token_ids, (algorithm, len(prompt))
        assert got.stats.cached_tokens > 0 and got.stats.cached_tokens % 8 == 0
        # ar and verify prefill at least the prompt's last token (its logits start decoding); block
        # diffusion needs no logits from the prompt and may restore all of its whole blocks
        assert got.stats.cached_tokens <= len(prompt) - (algorithm != "low_confidence")
    stats = warm.prefix.stats
    assert stats.hits == 4 and stats.tokens_reused >= 32 + 40 + 8 + 16


@pytest.mark.parametrize("block_size", [None, 12, 20])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_next_turn_reuses_the_previous_turn_and_its_reply(model, algorithm, block_size):
    """Also with requests' blocks that do not divide the model's 8: their commits and keeps cross a model
    boundary before their last token (found by a review: low_confidence at 12 and 20 and verify at 12
    reused 8 or 16 of 56 tokens, every later block having lost its parent)."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    params = lambda n: SamplingParams(**{**vars(_params(algorithm, n)), "block_size": block_size})   # noqa: E731
    turn1 = _tokens(21, 4)
    reply = engine.generate([turn1], params(40))[0].token_ids
    turn2 = turn1 + reply + _tokens(9, 5)
    got = engine.generate([turn2], params(14))[0]
    assert got.token_ids == Engine(model).generate([turn2], params(14))[0].token_ids
    # the prompt's blocks and the reply's committed blocks were kept: at most the last partial ones are new
    # (the reply's last request block is not committed; at 12 and 20 it starts on or before 56)
    assert got.stats.cached_tokens == (len(turn1) + len(reply)) // 8 * 8 == 56


@pytest.mark.parametrize("algorithm", ["low_confidence", "verify"])
def test_blocks_kept_from_inside_a_commit_or_a_keep_equal_a_fresh_prefill(model, algorithm):
    """The GDN states snapshotted at a model boundary inside a forward that started mid-block (chunks aligned
    to the sequence's boundaries) or inside a `verify` keep (`model.kept_gdn`) are a prefill's states."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    prompt = _tokens(21, 6)
    reply = engine.generate([prompt], SamplingParams(**{**vars(_params(algorithm, 40)), "block_size": 12}))[0].token_ids
    tokens = prompt + reply
    keys = block_keys(tokens, 8)[:7]
    assert all(k in engine.prefix for k in keys)
    cache, ref = model.new_cache(1), model.new_cache(1)
    engine.prefix.restore(cache, 0, keys)
    model.causal(torch.tensor([tokens[:56]]), ref, logits="none")
    for layer in range(len(ref.keys)):
        if ref.keys[layer] is None:   # (K/V are the cache's own rows, copied)
            torch.testing.assert_close(cache.states[layer][0], ref.states[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.rings[layer][0], ref.rings[layer][0], atol=1e-6, rtol=0)


def test_chunk_states_of_an_input_starting_inside_a_chunk_fall_on_the_sequences_boundaries(model):
    """`align`: row n starts align[n] steps into a chunk; its chunk states are then those at the multiples of
    the chunk size of the whole sequence, and its outputs and final state are those of the plain scan."""
    layer = next(x.linear_attn for x in model.model.layers if not x.is_attention)
    torch.manual_seed(1)
    t, d = 13, model.config.hidden_size
    x = torch.randn(2, t, d)
    state = torch.randn(2, layer.heads, layer.key_dim, layer.value_dim) * 0.1
    ring = torch.randn(2, model.config.linear_conv_kernel_dim - 1, model.config.linear_conv_dim)
    lengths, align = torch.tensor([13, 11]), torch.tensor([5, 0])
    with torch.no_grad():
        plain = layer.causal(x, state, ring, lengths, 8, return_chunk_states=True)
        aligned = layer.causal(x, state, ring, lengths, 8, return_chunk_states=True, align=align)
        for n in range(2):
            valid = int(lengths[n])
            torch.testing.assert_close(aligned.out[n, :valid], plain.out[n, :valid], atol=2e-5, rtol=0)
            torch.testing.assert_close(aligned.state[n], plain.state[n], atol=2e-5, rtol=0)
            for c in range(1, aligned.chunk_states.shape[2]):
                steps = c * 8 - int(align[n])          # rows of x before the c-th boundary
                if steps > valid:
                    break
                part = layer.causal(x[n:n + 1, :steps], state[n:n + 1], ring[n:n + 1], torch.tensor([steps]), 8)
                torch.testing.assert_close(aligned.chunk_states[n, :, c], part.state[0], atol=2e-5, rtol=0)


def test_restored_cache_equals_a_fresh_prefill(model):
    engine = Engine(model, prefix_cache_bytes=64 << 20, prefix_state_every=1)
    prompt = _tokens(35, 6)
    engine.generate([prompt], _params("low_confidence", 2))
    keys = block_keys(prompt, 8)
    assert all(k in engine.prefix for k in keys)           # every block of the prefill was kept
    cache = model.new_cache(1)
    engine.prefix.restore(cache, 0, keys[:3])
    ref = model.new_cache(1)
    model.causal(torch.tensor([prompt[:24]]), ref, logits="none")
    assert int(cache.lengths[0]) == 24
    for layer in range(len(ref.keys)):
        if ref.keys[layer] is not None:
            torch.testing.assert_close(cache.keys[layer][0, :, :24], ref.keys[layer][0, :, :24], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.values[layer][0, :, :24], ref.values[layer][0, :, :24], atol=1e-5, rtol=0)
        else:
            torch.testing.assert_close(cache.states[layer][0], ref.states[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(cache.rings[layer][0], ref.rings[layer][0], atol=1e-6, rtol=0)


def test_eviction_under_a_tiny_budget_never_changes_output(model):
    cold = Engine(model)
    entry = Engine(model, prefix_cache_bytes=1 << 30)
    entry.generate([_tokens(8, 0)], _params("ar", 1))
    one = entry.prefix.nbytes                                # the bytes of one block
    tiny = Engine(model, prefix_cache_bytes=3 * one)
    prompts = [_tokens(33, 7) + _tokens(i + 3, 8 + i) for i in range(5)] + [_tokens(50, 20)]
    for i, p in enumerate(prompts):
        alg = ALGORITHMS[i % 3]
        assert tiny.generate([p], _params(alg))[0].token_ids == cold.generate([p], _params(alg))[0].token_ids
        assert tiny.prefix.nbytes <= 3 * one
    assert tiny.prefix.stats.evictions > 0 and tiny.prefix.stats.hits > 0


def test_requests_in_flight_together_share_a_prefix(model):
    shared = _tokens(24, 9)
    prompts = [shared + _tokens(3 + i, 30 + i) for i in range(6)]
    params = [_params(ALGORITHMS[i % 3], 10) for i in range(6)]
    engine = Engine(model, max_batch_size=2, prefix_cache_bytes=64 << 20)
    got = engine.generate(prompts, params)
    for p, sp, r in zip(prompts, params, got, strict=True):
        assert r.token_ids == Engine(model).generate([p], sp)[0].token_ids
    assert sum(r.stats.cached_tokens > 0 for r in got) >= 4   # all but the first two admitted


def test_a_budget_below_zero_is_refused(model):
    with pytest.raises(ValueError, match="budget"):
        Engine(model, prefix_cache_bytes=-1)


def test_chunked_prefill_grows_the_cache_in_steps_that_run_no_chunk(model, monkeypatch):
    """All rows share one K/V capacity: a long prompt grows it once, for the whole prompt, in a step that
    runs no prefill chunk, so no step of the other streams carries both that copy and a chunk; a second
    long prompt arriving mid-way (chunks of two prompts at different positions in one step) likewise."""
    engine = Engine(model, max_prefill_tokens=96)
    short = engine.add_request(_tokens(5, 50), _params("ar", 300))
    engine.step()
    first = engine.add_request(_tokens(600, 51), _params("ar", 4))
    fed: list[int] = []
    real = model.causal

    def causal(ids, *a, **kw):
        fed.append(int(kw["lengths"].sum()))
        return real(ids, *a, **kw)

    monkeypatch.setattr(model, "causal", causal)
    steps = []                                           # (capacity grew, largest prefill fed, short got a token)
    started: set[str] = set()
    second = None
    while len(started) < 2:
        fed.clear()
        before = engine.cache.capacity
        events = engine.step()
        started |= {ev.request_id for ev in events if ev.request_id in (first, second) and ev.token_ids}
        steps.append((engine.cache.capacity > before, max(fed, default=0),
                      any(ev.request_id == short and ev.token_ids for ev in events)))
        if len(steps) == 3:
            second = engine.add_request(_tokens(900, 52), _params("ar", 4))
    grew = [s for s in steps if s[0]]
    assert 1 <= len(grew) <= 2 and all(s[1] <= 1 for s in grew)  # growth steps feed the short stream only
    assert engine.cache.capacity >= 900 + 8
    assert any(s[1] > 64 for s in steps)                          # the prompts went in chunks, several at once
    assert all(s[2] for s in steps)                               # the short stream advanced every step


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chunked_prefill_gives_the_same_output_and_bounds_each_step(model, algorithm, monkeypatch):
    prompts = [_tokens(150, 40), _tokens(5, 41), _tokens(53, 42)]
    want = [Engine(model).generate([p], _params(algorithm))[0].token_ids for p in prompts]
    sizes: list[int] = []                                 # tokens fed causally, per call of a step
    real, real_fused = model.causal, model.causal_and_preview

    def causal(ids, *a, **kw):
        sizes.append(int(kw["lengths"].sum()))
        return real(ids, *a, **kw)

    def fused(clean, *a, **kw):
        sizes.append(int(kw["clean_lengths"].sum()))
        return real_fused(clean, *a, **kw)

    for cache_bytes in (0, 64 << 20):
        engine = Engine(model, max_prefill_tokens=16, prefix_cache_bytes=cache_bytes)
        monkeypatch.setattr(model, "causal", causal)
        monkeypatch.setattr(model, "causal_and_preview", fused)
        short = engine.add_request(prompts[1], _params(algorithm))
        engine.step()                                    # the short request is decoding
        for p in (prompts[0], prompts[2]):
            engine.add_request(p, _params(algorithm))
        results, short_events = {}, 0
        while engine.has_unfinished():
            sizes.clear()
            for ev in engine.step():
                short_events += ev.request_id == short
                if ev.finished:
                    results[ev.request_id] = ev.result.token_ids
            # one chunk budget, plus per sequence at most a block and a tail (a last prefill, a commit):
            # never the 144 tokens an unchunked prefill of the long prompt would take in one step
            assert sum(sizes) <= 16 + 3 * 16
        monkeypatch.undo()
        got = [results[f"req-{i}"] for i in (1, 0, 2)]
        assert got == want, (algorithm, cache_bytes)
        assert short_events >= 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_only_a_forward_crossing_a_block_boundary_before_its_end_asks_for_a_gdn_trace(model, algorithm,
                                                                                      monkeypatch):
    """A trace keeps a pass eager (compiled passes report no chunk states). The prefill crosses two
    boundaries before its end and needs one; a step or a block's commit ends on the boundary it crosses,
    whose state the cache itself holds."""
    asked = []
    for name in ("causal", "causal_and_preview"):
        real = getattr(model, name)

        def spy(*args, _real=real, **kw):
            if kw.get("write", True) is True:   # the forwards that commit what they run (not a verify check)
                asked.append(kw.get("gdn_trace") is not None)
            return _real(*args, **kw)
        monkeypatch.setattr(model, name, spy)
    prompt = _tokens(21, 6)                                    # two whole blocks of 8 and a tail of 5
    engine = Engine(model, prefix_cache_bytes=64 << 20, prefix_state_every=1)
    got = engine.generate([prompt], _params(algorithm, 19))[0]
    assert asked[0] and not any(asked[1:]) and len(asked) > 2, asked
    assert got.token_ids == Engine(model).generate([prompt], _params(algorithm, 19))[0].token_ids
    again = engine.generate([prompt + got.token_ids], _params(algorithm, 3))[0]
    assert again.stats.cached_tokens == 32   # the prefill kept 16; commits without a trace kept 24 and 32


class _NoPreviews(VerifyPolicy):
    """`verify` that previews no block, the first included; every block drafts "from its context", here
    `ar`'s own next tokens (`truth`), so that every draft is kept and checks cross block boundaries."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__(window=4, cost_ratio=0)
        self.truth = truth

    def preview_worth(self, s, n, k, compiled=False, prefill=False):
        return False

    def looked_up(self, s):
        if s.drafts is not None:
            return []
        n = len(s.generated)
        return self.truth[n: n + min(self.window, len(s.block) - s.verified)]


def test_the_next_turn_reuses_a_verify_reply_drafted_from_its_context(model):
    """Checks of drafts from the context that cross a block boundary still leave every committed block of
    the reply in the prefix cache (the boundaries a keep crosses before its end: `model.kept_gdn`)."""
    turn1 = _tokens(21, 4)
    truth = Engine(model).generate([turn1], _params("ar", 40))[0].token_ids
    engine = Engine(model, prefix_cache_bytes=64 << 20, policies={"verify": _NoPreviews(truth)})
    result = engine.generate([turn1], _params("verify", 40))[0]
    assert result.token_ids == truth
    assert result.stats.previews_skipped >= 3 and result.stats.lookup_accepted > 20
    assert result.stats.lookup_accepted <= result.stats.lookup_drafts <= result.stats.drafts_proposed
    turn2 = turn1 + truth + _tokens(9, 5)
    got = engine.generate([turn2], _params("verify"))[0]
    assert got.token_ids == Engine(model).generate([turn2], _params("verify"))[0].token_ids
    assert got.stats.cached_tokens >= (len(turn1) + len(truth)) // 8 * 8 - 8


@pytest.mark.parametrize("n", range(33, 41))
def test_a_verify_reply_keeps_its_last_check_in_the_prefix_cache(model, n):
    """A reply that finishes inside a check keeps that check's committed rows (pending tokens and drafts up to
    max_tokens): every whole block of the turn and its reply is in the cache for the next one. (Found in
    session 48: a finishing check kept nothing; at n = 35 the reply ends on a block boundary, and that block,
    closed by the finishing check, was lost: 48 tokens reused, not 56.)"""
    turn1 = _tokens(21, 4)
    truth = Engine(model).generate([turn1], _params("ar", n))[0].token_ids
    engine = Engine(model, prefix_cache_bytes=64 << 20, policies={"verify": _NoPreviews(truth)})
    assert engine.generate([turn1], _params("verify", n))[0].token_ids == truth
    turn2 = turn1 + truth + _tokens(9, 5)
    got = engine.generate([turn2], _params("verify"))[0]
    assert got.token_ids == Engine(model).generate([turn2], _params("verify"))[0].token_ids
    # (here the drafts run to the reply's end, so its last token is a kept draft, a row of the last check)
    assert got.stats.cached_tokens == (len(turn1) + n) // 8 * 8


def test_move_row_carries_a_sequence_and_leaves_the_other_rows_alone(model):
    """`PrefixCache.move_row`: the moved row's committed K/V (up to its length), GDN state, ring and length,
    in its new row; the other rows untouched."""
    torch.manual_seed(0)
    cache = model.new_cache(3)
    cache.reserve(16)
    for x in cache.keys + cache.values + cache.states + cache.rings:
        if x is not None:
            x.copy_(torch.randn_like(x))
    cache.lengths[:] = torch.tensor([5, 9, 12])
    kv = [x.clone() for x in cache.keys + cache.values if x is not None]
    recurrent = [x.clone() for x in cache.states + cache.rings if x is not None]
    assert kv and recurrent                        # the model has both kinds of layer
    cache.move_row(2, 0)
    assert cache.lengths.tolist() == [12, 9, 12]
    for a, b in zip(kv, [x for x in cache.keys + cache.values if x is not None], strict=True):
        assert torch.equal(b[0, :, :12], a[2, :, :12]) and torch.equal(b[1:], a[1:])
    for a, b in zip(recurrent, [x for x in cache.states + cache.rings if x is not None], strict=True):
        assert torch.equal(b[0], a[2]) and torch.equal(b[1:], a[1:])


# -- sparse GDN states ------------------------------------------------------------------------------------------


def test_a_trace_holds_the_states_and_rings_of_the_chunks_asked_only(model):
    """`GDNTrace(chunks)`: each GDN layer's state and conv ring at those block boundaries (counted from the one at or
    before each row's start, here a row with 5 tokens cached and one with none), equal to a prefill up to there;
    no other chunk's state is held."""
    tokens = _tokens(40, 12)
    cache = model.new_cache(2)
    model.causal(torch.tensor([tokens[:5]]), cache, logits="none", rows=slice(1, 2))
    ids = torch.tensor([tokens[:30], tokens[5:35]])
    trace = GDNTrace(chunks=[1, 3])
    model.causal(ids, cache, lengths=torch.tensor([30, 30]), logits="none", gdn_trace=trace)
    gdn = [i for i, st in enumerate(cache.states) if st is not None]
    assert sorted(trace.states) == sorted(trace.rings) == gdn and not trace.steps
    for j, c in enumerate(trace.chunks):
        ref = model.new_cache(1)
        model.causal(torch.tensor([tokens[:8 * c]]), ref, logits="none")
        for i in gdn:
            assert trace.states[i].shape[2] == trace.rings[i].shape[1] == 2
            for row in range(2):   # both rows hold the same tokens at the same absolute positions
                torch.testing.assert_close(trace.states[i][row, :, j], ref.states[i][0], atol=1e-5, rtol=0)
                torch.testing.assert_close(trace.rings[i][row, j], ref.rings[i][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_gdn_states_are_kept_every_few_blocks_at_the_prompts_end_and_at_the_frontier(model, algorithm):
    """K/V for every block; GDN states after every 5th block, the prompt's last whole block and the deepest block
    the request reached (each block it went past as its frontier lost them again); a restore from any of them
    equals a fresh prefill."""
    engine = Engine(model, prefix_cache_bytes=64 << 20, prefix_state_every=5)
    prompt = _tokens(61, 13)                                  # 7 whole blocks and a tail of 5
    reply = engine.generate([prompt], _params(algorithm, 40))[0].token_ids
    keys = [k for k in block_keys(prompt + reply, 8) if k in engine.prefix]
    deepest = len(keys) - 1
    assert deepest >= 11 and len(engine.prefix.entries) == len(keys)   # every committed block, K/V at least
    held = [b for b, k in enumerate(keys) if engine.prefix.entries[k].states is not None]
    assert held == sorted({4, 6, 9, deepest})
    assert engine.prefix.stats.snapshots == len(held)
    assert engine.prefix.nbytes == sum(e.nbytes for e in engine.prefix.entries.values())
    for b in held:
        cache, ref = model.new_cache(1), model.new_cache(1)
        engine.prefix.restore(cache, 0, keys[: b + 1])
        model.causal(torch.tensor([(prompt + reply)[: 8 * (b + 1)]]), ref, logits="none")
        for layer in range(len(ref.keys)):
            if ref.keys[layer] is None:
                torch.testing.assert_close(cache.states[layer][0], ref.states[layer][0], atol=1e-5, rtol=0)
                torch.testing.assert_close(cache.rings[layer][0], ref.rings[layer][0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_branch_point_found_by_a_lookup_is_restored_whole_by_the_next_prompt(model, algorithm):
    """Prompts sharing 5 whole blocks (a system prompt) and then differing: the first leaves them as K/V only
    (its states are at its own prompt's end, past the shared part), so the second starts from nothing but keeps
    the states where its lookup stopped; the third restores the whole shared part. Outputs as without a cache."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)   # states every 16 blocks: none in these prompts
    system = _tokens(40, 14)
    prompts = [system + _tokens(12 + i, 15 + i) for i in range(3)]
    got = [engine.generate([p], _params(algorithm))[0] for p in prompts]
    for p, r in zip(prompts, got, strict=True):
        assert r.token_ids == Engine(model).generate([p], _params(algorithm))[0].token_ids
    assert [r.stats.cached_tokens for r in got] == [0, 0, 40]


def _store_and_states(model, n: int, seed: int) -> tuple:
    """An empty prefix store, a cache row holding `n` tokens of `seed`, their block keys, and the GDN states and
    rings after them (one row's: what `PrefixStore.insert` takes)."""
    store, cache = Engine(model, prefix_cache_bytes=64 << 20).prefix, model.new_cache(1)
    model.causal(torch.tensor([_tokens(n, seed)]), cache, logits="none")
    state = ([s[0] if s is not None else None for s in cache.states], [r[0] if r is not None else None
                                                                       for r in cache.rings])
    return store, cache, block_keys(_tokens(n, seed), 8), state


def _block_sizes(model) -> tuple[int, int]:
    """(bytes of a block's K/V, bytes of the GDN states and rings after it) in a prefix cache of `model`."""
    probe = Engine(model, prefix_cache_bytes=64 << 20, prefix_state_every=1)
    probe.generate([_tokens(8, 0)], _params("ar", 1))
    entry = next(iter(probe.prefix.entries.values()))
    return entry.nbytes - entry.state_bytes(), entry.state_bytes()


def test_a_request_drops_its_old_frontier_but_not_states_another_keeps(model):
    """`PrefixStore.insert(..., frontier=True)` returns the claim `drop_frontier` gives back: the states (and their
    bytes) go with the last claim, the K/V stay; states wanted for good by any insert are not dropped; a K/V-only block
    takes states; a claim on an entry evicted (and cached again since) drops nothing."""
    store, cache, keys, state = _store_and_states(model, 24, 16)
    assert store.insert(keys[0], None, cache, 0, 0, None, None) is None           # K/V only
    kv_bytes = store.nbytes
    first = store.insert(keys[0], None, cache, 0, 0, *state, frontier=True)       # takes states
    second = store.insert(keys[0], None, cache, 0, 0, *state, frontier=True)      # a second request's claim
    assert first is second is store.entries[keys[0]] and store.nbytes > kv_bytes and store.stats.snapshots == 1
    store.drop_frontier(keys[0], first)
    assert store.entries[keys[0]].states is not None                              # still claimed
    store.drop_frontier(keys[0], second)
    assert store.nbytes == kv_bytes and store.entries[keys[0]].states is None and store.stats.snapshots == 0
    claim = store.insert(keys[1], keys[0], cache, 0, 1, *state, frontier=True)
    assert store.insert(keys[1], keys[0], cache, 0, 1, *state, frontier=False) is None   # wanted for good now
    store.drop_frontier(keys[1], claim)
    assert store.entries[keys[1]].states is not None
    assert store.match(keys, 3) == (2, 2)
    stale = store.insert(keys[2], keys[1], cache, 0, 2, *state, frontier=True)
    store.entries.pop(keys[2])   # (as an eviction does, by hand)
    store.entries[keys[1]].children -= 1
    store.nbytes -= stale.nbytes
    store.stats.snapshots -= 1
    again = store.insert(keys[2], keys[1], cache, 0, 2, *state, frontier=True)
    store.drop_frontier(keys[2], stale)
    assert store.entries[keys[2]] is again and again.states is not None
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())


def test_eviction_takes_a_chains_earlier_states_before_its_deeper_blocks_and_claims_outlive_it(model):
    """Over the budget, the least recently used of a leaf block (whole) and the GDN states of a block that others
    continue (K/V kept) goes: a chain's earlier states first, so its deepest restore point stays; once the K/V and
    two states no longer fit, leaves go and the inner states left stay as points to fall back to. A frontier claim
    made before its states were evicted, given back after another request brought them again, drops nothing."""
    store, cache, keys, state = _store_and_states(model, 32, 17)
    claim = store.insert(keys[0], None, cache, 0, 0, *state, frontier=True)     # a request's frontier
    for b in (1, 2, 3):
        store.insert(keys[b], keys[b - 1], cache, 0, b, *state)                 # states wanted for good
    full, one = store.nbytes, store.entries[keys[0]].state_bytes()
    assert store.match(keys, 4) == (4, 4) and store.state_nbytes == 4 * one
    for dropped in (1, 2):                        # room for one state less each time: blocks 0 and 1 lose theirs
        store.max_bytes = full - dropped * one
        store._fit()
        assert [store.entries[k].states is None for k in keys] == [b < dropped for b in range(4)]
        assert store.match(keys, 4) == (4, 4) and store.stats.evictions == 0
    store.max_bytes = full - 3 * one              # the K/V and two states do not fit: the leaf goes, block 2 stays
    store._fit()
    assert keys[3] not in store and store.entries[keys[2]].states is not None and store.match(keys, 4) == (3, 3)
    assert (store.stats.state_evictions, store.stats.evictions, store.stats.snapshots) == (2, 1, 1)
    store.max_bytes = 64 << 20
    other = store.insert(keys[0], None, cache, 0, 0, *state, frontier=True)     # another request's frontier
    store.drop_frontier(keys[0], claim)           # the claim from before the eviction
    assert store.entries[keys[0]].states is not None
    store.drop_frontier(keys[0], other)
    assert store.entries[keys[0]].states is None and store.stats.snapshots == 1
    assert store.nbytes == sum(e.nbytes for e in store.entries.values())
    assert store.state_nbytes == sum(e.state_bytes() for e in store.entries.values())


def test_a_conversation_over_the_budget_restores_its_previous_turn(model):
    """A conversation that outgrows the budget keeps reusing all of its previous turn (its earlier states are the
    ones evicted), and the output is unchanged (found by a review: the leaf-only eviction took the newest blocks,
    so the cache stopped growing and each later turn reused less)."""
    kv, states = _block_sizes(model)
    budget = 12 * kv + 3 * states                 # the 80-token history's K/V and a few states, not a state a block
    engine, cold = Engine(model, prefix_cache_bytes=budget, prefix_state_every=1), Engine(model)
    history: list[int] = []
    for turn in range(5):
        prompt = history + _tokens(9, 40 + turn)
        got = engine.generate([prompt], _params("ar", 7))[0]
        assert got.token_ids == cold.generate([prompt], _params("ar", 7))[0].token_ids
        if turn:   # the previous prompt and reply in whole blocks, less the reply's last token (never fed)
            assert got.stats.cached_tokens == (len(history) - 1) // 8 * 8, turn
        assert engine.prefix.nbytes <= budget
        history = prompt + got.token_ids
    assert engine.prefix.stats.state_evictions > 0


def test_a_conversation_whose_kv_outgrows_the_budget_keeps_restoring_a_prefix(model):
    """Once a conversation's K/V and one state no longer fit, leaves go and inner states stay (found by a review:
    evicting inner states whatever the K/V left a chain with no state, and from then on every turn restored
    nothing)."""
    kv, states = _block_sizes(model)
    engine, cold = Engine(model, prefix_cache_bytes=30 * kv + states), Engine(model)
    history = _tokens(40, 100)
    for turn in range(12):
        prompt = history + _tokens(16, 200 + turn)
        got = engine.generate([prompt], _params("ar", 30))[0]
        assert got.token_ids == cold.generate([prompt], _params("ar", 30))[0].token_ids
        assert turn == 0 or got.stats.cached_tokens > 0, turn
        assert engine.prefix.nbytes <= 30 * kv + states
        history = prompt + got.token_ids


@pytest.mark.parametrize("block_size", [12, 20])
@pytest.mark.parametrize("algorithm", ["low_confidence", "verify"])
def test_the_same_prompt_again_restores_what_its_policy_may_at_any_request_block_size(model, algorithm, block_size):
    """States are kept at the last block the request's lookup may restore (its policy's `reusable`, in whole
    request blocks), not only at the prompt's last model block (found by a review: at request blocks of 12 and 20
    the second run of a prompt restored nothing, the third all)."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    params = SamplingParams(**{**vars(_params(algorithm)), "block_size": block_size})
    for prompt in (_tokens(37, 21), _tokens(47, 22)):
        want = Engine(model).generate([prompt], params)[0].token_ids
        runs = [engine.generate([prompt], params)[0] for _ in range(2)]
        assert [r.token_ids for r in runs] == [want, want]
        whole = len(prompt) // block_size * block_size   # the policies' `reusable` (no prompt ends on a boundary)
        assert [r.stats.cached_tokens for r in runs] == [0, whole // 8 * 8]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_finished_reply_keeps_its_last_states_while_a_longer_twin_goes_on(model, algorithm):
    """Two requests of one prompt decoding the same tokens, one stopping early: the short one's deepest block is
    also the long one's frontier for a while, and the long one going past it must not drop it (found by a review:
    the next turn of the short one restored 16 of 45 tokens, not 40)."""
    prompt = _tokens(21, 23)
    engine = Engine(model, max_batch_size=2, prefix_cache_bytes=64 << 20)
    _, short = engine.generate([prompt, prompt], [_params(algorithm, 40), _params(algorithm, 20)])   # (long first)
    turn2 = prompt + short.token_ids + _tokens(4, 24)
    got = engine.generate([turn2], _params(algorithm))[0]
    assert got.token_ids == Engine(model).generate([turn2], _params(algorithm))[0].token_ids
    assert got.stats.cached_tokens == (len(prompt) + 20) // 8 * 8


@pytest.mark.parametrize("every", [0, -1, 1.5, True])
def test_a_state_interval_that_is_not_a_whole_number_of_blocks_is_refused(model, every):
    with pytest.raises(ValueError, match="state interval"):
        Engine(model, prefix_cache_bytes=1 << 20, prefix_state_every=every)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_only_requests_with_the_same_cache_salt_share_prefixes(model, algorithm):
    """vLLM's `cache_salt`: it goes into the first block's key, so a salted prompt shares nothing with the same
    prompt unsalted or under another salt, and everything with the same salt."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    prompt = _tokens(37, 25)
    want = Engine(model).generate([prompt], _params(algorithm))[0].token_ids
    cached = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a", None):
        got = engine.generate([prompt], _params(algorithm).with_(cache_salt=salt))[0]
        assert got.token_ids == want
        cached.append(got.stats.cached_tokens)
    assert cached[:3] == [0, 0, 0] and cached[3] == cached[4] == 32


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_reset_in_the_middle_of_a_request_changes_nothing_it_writes(model, algorithm):
    """`Engine.reset_prefix_cache` drops every block (the counters go on); a request running meanwhile finishes as
    without a cache and caches nothing more (its chain from block 0 is gone: no lookup could reach its blocks); the
    next request fills the cache again, the byte and state counts exact."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    prompt = _tokens(29, 26)
    engine.generate([prompt], _params(algorithm, 6))
    rid = engine.add_request(prompt + _tokens(3, 27), _params(algorithm, 40))
    result = None
    for step in range(200):
        if step == 3:
            blocks, nbytes = engine.reset_prefix_cache()
            assert blocks > 0 and nbytes > 0 and engine.prefix.nbytes == 0 and not engine.prefix.entries
        for ev in engine.step():
            if ev.finished and ev.request_id == rid:
                result = ev.result
        if result is not None:
            break
    want = Engine(model).generate([prompt + _tokens(3, 27)], _params(algorithm, 40))[0].token_ids
    assert result is not None and result.token_ids == want and result.stats.cached_tokens > 0
    store = engine.prefix
    assert not store.entries and store.nbytes == 0
    engine.generate([prompt], _params(algorithm, 6))
    assert store.entries and store.nbytes == sum(e.nbytes for e in store.entries.values())
    assert store.stats.snapshots == sum(e.states is not None for e in store.entries.values())
    assert store.stats.hits == 1
    with pytest.raises(ValueError, match="prefix cache is off"):
        Engine(model).reset_prefix_cache()


def test_cache_points_keep_the_state_at_the_last_block_before_each(model):
    """`SamplingParams.cache_points` (a chat prompt's last <|im_start|>, `Tokenizer.reply_start`): the state after the
    last whole block at or before each position is kept for good; a next prompt parting there restores up to it."""
    engine = Engine(model, prefix_cache_bytes=64 << 20)
    prompt = _tokens(61, 28)
    engine.generate([prompt], _params("low_confidence", 4).with_(cache_points=(29, 46)))
    keys = block_keys(prompt, 8)
    held = [b for b, k in enumerate(keys) if engine.prefix.entries[k].states is not None]
    assert held == [2, 4, 6]                       # 29 -> block 2 (ends 24), 46 -> block 4 (ends 40), the prompt's end
    nxt = prompt[:44] + _tokens(20, 29)            # parts at 44
    got = engine.generate([nxt], _params("low_confidence"))[0]
    assert got.stats.cached_tokens == 40
    assert got.token_ids == Engine(model).generate([nxt], _params("low_confidence"))[0].token_ids
    for bad in ((-1,), (1.5,), tuple(range(65))):
        with pytest.raises(ValueError, match="cache_points"):
            engine.generate([prompt], _params("ar").with_(cache_points=bad))


def test_reply_start_is_the_last_turns_im_start():
    from clover.model.tokenizer import Tokenizer

    tok = Tokenizer.train(["some text to train on"] * 10, vocab_size=280)
    ids = tok.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert len(tok.reply_start(ids)) == 1
    head = tok.encode("<|im_start|>assistant\n")   # (then the generation prompt's think markup, if any)
    assert ids[tok.reply_start(ids)[0]:][: len(head)] == head
    assert tok.reply_start(tok.encode("no chat here")) == ()


def test_a_budget_below_one_block_with_its_states_holds_and_says_so(model, caplog):
    """Found by a review: blocks kept as K/V only (their states do not fit the whole budget) grew the cache past its
    budget without an eviction. The budget holds; nothing can be restored, and the log says so once."""
    probe = Engine(model, prefix_cache_bytes=1 << 30, prefix_state_every=1)
    probe.generate([_tokens(8, 0)], _params("ar", 1))
    one = probe.prefix.nbytes                               # one block with its states
    engine = Engine(model, prefix_cache_bytes=one - 1)
    with caplog.at_level("WARNING", logger="clover.engine.prefix_cache"):
        for seed in range(5):
            prompt = _tokens(64, 30 + seed)
            got = engine.generate([prompt], _params("low_confidence"))[0]
            assert got.token_ids == Engine(model).generate([prompt], _params("low_confidence"))[0].token_ids
            assert engine.prefix.nbytes <= one - 1 and engine.prefix.stats.snapshots == 0
    assert engine.prefix.stats.evictions > 0
    assert caplog.text.count("below one block with its GDN states") == 1


def test_cache_points_past_the_prompt_and_a_bad_state_interval_without_a_cache_are_refused(model):
    with pytest.raises(ValueError, match="cache_points must be positions in the prompt"):
        Engine(model).generate([_tokens(20, 31)], _params("ar").with_(cache_points=(21,)))
    assert Engine(model).generate([_tokens(20, 31)], _params("ar", 2).with_(cache_points=(20,)))[0].token_ids
    with pytest.raises(ValueError, match="state interval"):
        Engine(model, prefix_state_every=0)
