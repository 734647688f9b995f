"""The three entry points: incremental causal use, preview, training forward, and their invariants."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from conftest import perturbed_model

from clover.model.config import CloverConfig
from clover.model.modeling import GDNTrace, LMHead
from clover.model.testing import assert_close

ATOL = 2e-5  # fp32 through a few layers; observed errors are ~3e-7


def test_incremental_causal_equals_one_pass(debug_model):
    b = debug_model.config.block_size
    ids = torch.randint(0, 500, (2, 5 * b + 3))
    with torch.no_grad():
        full = debug_model(ids)
        cache = debug_model.new_cache(2)
        cuts = [0, 3, 4, 2 * b + 1, 3 * b, 4 * b, 5 * b, 5 * b + 3]  # uneven prefill pieces, then block commits
        pieces = [debug_model.causal(ids[:, a:c], cache) for a, c in zip(cuts, cuts[1:], strict=False)]
    assert cache.lengths.tolist() == [5 * b + 3] * 2
    assert_close(torch.cat(pieces, 1), full, atol=ATOL, what="incremental logits")


def test_chunked_model_equals_recurrent_reference_model(debug_model):
    ids = torch.randint(0, 500, (2, 19))
    with torch.no_grad():
        fast = debug_model(ids)
        for layer in debug_model.model.layers:
            if not layer.is_attention:
                layer.linear_attn.use_recurrent_reference = True
            layer.mlp.use_reference = True
        slow = debug_model(ids)
    assert_close(fast, slow, atol=ATOL, what="logits")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_stream_equals_preview_over_causal_prefill(debug_model, seed):
    """The central invariant (spec section 3) for every block j, random masks, a ragged last block."""
    gen = torch.Generator().manual_seed(seed)
    config = debug_model.config
    b = config.block_size
    t = 4 * b + 5
    ids = torch.randint(0, 500, (2, t), generator=gen)
    ratio = torch.rand(2, 1, generator=gen)
    noisy = torch.where(torch.rand(2, t, generator=gen) < ratio, config.mask_token_id, ids)
    with torch.no_grad():
        out = debug_model.training_forward(ids, noisy)
        assert_close(out.clean, debug_model(ids), atol=ATOL, what="clean stream vs causal")
        for j in range(5):
            cache = debug_model.new_cache(2)
            if j:
                debug_model.causal(ids[:, : j * b], cache, logits="none")
            block = noisy[:, j * b : (j + 1) * b]
            assert_close(debug_model.preview(block, cache), out.noisy[:, j * b : j * b + block.shape[1]],
                         atol=ATOL, what=f"block {j}")


def test_invariant_holds_with_prefill_in_pieces_and_block_size_32():
    config = CloverConfig.preset("debug", block_size=32)
    model = perturbed_model(config)
    ids = torch.randint(0, 500, (1, 96))
    noisy = torch.where(torch.rand(1, 96) < 0.6, config.mask_token_id, ids)
    with torch.no_grad():
        out = model.training_forward(ids, noisy)
        cache = model.new_cache(1)
        model.causal(ids[:, :7], cache, logits="none")
        model.causal(ids[:, 7:64], cache, logits="none")
        assert_close(model.preview(noisy[:, 64:], cache), out.noisy[:, 64:], atol=ATOL, what="block 2")


def test_preview_leaves_the_cache_untouched(debug_model):
    """What a commit wrote stays as it was: lengths, GDN states and rings, and every K/V position below
    each row's length (the buffer past it is scratch the attention may use without a copy)."""
    cache = debug_model.new_cache(2)
    ids = torch.randint(0, 500, (2, 11))
    with torch.no_grad():
        debug_model.causal(ids, cache, lengths=torch.tensor([11, 7]), logits="none")

        def committed():
            kv = [x[r, :, :n].clone() for xs in (cache.keys, cache.values) for x in xs if x is not None
                  for r, n in enumerate(cache.lengths.tolist())]
            return kv + [x.clone() for xs in (cache.states, cache.rings) for x in xs if x is not None]

        before, lengths = committed(), cache.lengths.clone()
        debug_model.preview(torch.full((2, 8), debug_model.config.mask_token_id), cache)
        after = committed()
    assert torch.equal(cache.lengths, lengths) and len(before) == len(after)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)


def test_new_parameters_at_neutral_init_do_not_touch_causal_mode(debug_config):
    model = perturbed_model(debug_config)
    ids = torch.randint(0, 500, (1, 20))
    with torch.no_grad():
        before = model(ids)
        for layer in model.model.layers:
            if not layer.is_attention:
                layer.linear_attn.conv_right.normal_()
                layer.linear_attn.history_bias.normal_()
        assert torch.equal(model(ids), before)


def test_batch_of_different_lengths_equals_each_alone(debug_model):
    lengths = [13, 5, 9]
    seqs = [torch.randint(0, 500, (n,)) for n in lengths]
    batch = torch.zeros(3, 13, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    with torch.no_grad():
        cache = debug_model.new_cache(3)
        logits = debug_model.causal(batch, cache, lengths=torch.tensor(lengths))
        last = debug_model.causal(batch, debug_model.new_cache(3), lengths=torch.tensor(lengths), logits="last")
        block = torch.randint(0, 500, (3, 8))
        prev = debug_model.preview(block, cache, lengths=torch.tensor([8, 8, 3]))
        noisy = torch.where(torch.rand(3, 13) < 0.5, debug_model.config.mask_token_id, batch)
        train = debug_model.training_forward(batch, noisy, lengths=torch.tensor(lengths))
        for i, s in enumerate(seqs):
            n = len(s)
            alone_cache = debug_model.new_cache(1)
            alone = debug_model.causal(s[None], alone_cache)
            assert_close(logits[i, :n], alone[0], atol=ATOL, what=f"causal {i}")
            assert_close(last[i], alone[0, -1], atol=ATOL, what=f"last logits {i}")
            m = 3 if i == 2 else 8
            alone_prev = debug_model.preview(block[i : i + 1, :m], alone_cache)
            assert_close(prev[i, :m], alone_prev[0], atol=ATOL, what=f"preview {i}")
            alone_train = debug_model.training_forward(s[None], noisy[i : i + 1, :n])
            assert_close(train.noisy[i, :n], alone_train.noisy[0], atol=ATOL, what=f"noisy stream {i}")
            assert_close(train.clean[i, :n], alone_train.clean[0], atol=ATOL, what=f"clean stream {i}")


def test_cache_select_and_concat_keep_each_sequence(debug_model):
    ids = torch.randint(0, 500, (3, 10))
    with torch.no_grad():
        cache = debug_model.new_cache(3)
        debug_model.causal(ids, cache, lengths=torch.tensor([10, 4, 7]), logits="none")
        one = debug_model.new_cache(1)
        debug_model.causal(ids[1:2, :4], one, logits="none")
        merged = type(cache).concat([cache.select([2, 0]), one])
        block = torch.randint(0, 500, (3, 8))
        got = debug_model.preview(block, merged)
        assert_close(got[2], debug_model.preview(block[2:], one)[0], atol=ATOL, what="joined sequence")
        assert_close(got[0], debug_model.preview(block[:1], cache.select([2]))[0], atol=ATOL, what="kept sequence")


def test_training_forward_gradients_reach_every_parameter(debug_model):
    ids = torch.randint(0, 500, (2, 20))
    noisy = torch.where(torch.rand(2, 20) < 0.5, debug_model.config.mask_token_id, ids)
    out = debug_model.train().training_forward(ids, noisy)
    (out.clean.square().mean() + out.noisy.square().mean() + out.aux_loss).backward()
    dead = [n for n, p in debug_model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


def _gdn_gate_inputs(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """z = in_proj_z(x) of every GDN layer (by layer index) in one causal pass of `ids`."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if not layer.is_attention:
            hooks.append(layer.linear_attn.in_proj_z.register_forward_hook(
                lambda _m, _inputs, out, i=i: seen.setdefault(i, out)))
    try:
        with torch.no_grad():
            model.causal(ids, logits="train")
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("preset", ["debug", "tiny-wide"])
def test_open_gdn_gates_gives_every_gdn_layer_the_asked_gate_and_keeps_the_format(preset):
    """Calibrated on 4 x 64 random tokens, checked on 8 x 128 others: the mean z of each GDN layer's gate is
    the asked one within 0.3 (measured within 0.13 on both presets), and the first GDN layer's z, whose input
    holds the shared direction undiluted, is positive for (nearly) every token and channel (measured z ~ 2
    +- 0.4). The weight format and every other weight stay as the constructor made them."""
    from clover.model.modeling import CloverForCausalLM

    config = CloverConfig.preset(preset)
    torch.manual_seed(0)
    model = CloverForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.open_gdn_gates(2.0)
    after = model.state_dict()
    assert {k: v.shape for k, v in after.items()} == {k: v.shape for k, v in before.items()}
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    gdn = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    assert changed == sorted(["model.embed_tokens.weight"] + [f"model.layers.{i}.linear_attn.in_proj_z.weight" for i in gdn])

    seen = _gdn_gate_inputs(model, torch.randint(0, config.vocab_size, (8, 128)))
    for i in gdn:
        assert abs(float(seen[i].mean()) - 2.0) < 0.3, (i, float(seen[i].mean()))
    assert float((seen[gdn[0]] > 0).float().mean()) > 0.99

    torch.manual_seed(0)
    plain = CloverForCausalLM(config)
    plain.open_gdn_gates(0.0)   # 0: the constructor's init, untouched
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())


def test_slow_gdn_decay_draws_each_heads_step_in_its_range_and_changes_only_dt_bias():
    """softplus(dt_bias) of every GDN head lands in [dt_min, dt_max] (up to fp32 rounding of the inverse
    softplus, 1e-6 relative), spread over the range (not one value); only the GDN dt_bias weights change.
    from_scratch with gdn_dt_max 0 and gdn_gate_z 0 (its defaults) is the constructor's init, bit for bit."""
    from clover.model.modeling import CloverForCausalLM

    config = CloverConfig.preset("tiny-wide")
    torch.manual_seed(0)
    model = CloverForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.slow_gdn_decay(dt_min=1e-3, dt_max=0.1)
    after = model.state_dict()
    gdn = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
    changed = sorted(k for k in after if not torch.equal(after[k], before[k]))
    assert changed == sorted(f"model.layers.{i}.linear_attn.dt_bias" for i in gdn)
    dt = torch.cat([torch.nn.functional.softplus(after[f"model.layers.{i}.linear_attn.dt_bias"]) for i in gdn])
    assert float(dt.min()) >= 1e-3 * (1 - 1e-6) and float(dt.max()) <= 0.1 * (1 + 1e-6)
    assert float(dt.max() / dt.min()) > 3   # drawn across the range: 12 heads (3 layers x 4) log-uniform over a factor 100

    for plain in (CloverForCausalLM.from_scratch(config, 0, gdn_gate_z=0.0, gdn_dt_max=0.0),
                  CloverForCausalLM.from_scratch(config, 0)):
        assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    for lo, hi in ((1e-3, -1.0), (0.1, 0.01), (1e-3, float("inf"))):
        with pytest.raises(ValueError, match="0 < dt_min <= dt_max"):
            model.slow_gdn_decay(dt_min=lo, dt_max=hi)


def test_from_scratch_opens_every_gdn_gate_of_tiny_wide():
    """The opened-gate init (slow decay, then gates opened: gdn_gate_z 2, gdn_dt_max 0.1), checked on 8 x 128 held-out random tokens: the first
    GDN layer's mean z is the asked 2 within 0.3 (its input holds the shared direction undiluted; measured
    2.0 on seeds 0-3) and every later GDN layer's mean z is positive, above 0.5 (measured 1.4-5.0 on seeds
    0-3: the slowly decaying layers before it make the calibration of deeper layers looser, see
    open_gdn_gates's known limit)."""
    from clover.model.modeling import CloverForCausalLM

    config = CloverConfig.preset("tiny-wide")
    model = CloverForCausalLM.from_scratch(config, 0, gdn_gate_z=2.0, gdn_dt_max=0.1)
    seen = _gdn_gate_inputs(model, torch.randint(0, config.vocab_size, (8, 128),
                                                 generator=torch.Generator().manual_seed(99)))
    z = [float(out.mean()) for _, out in sorted(seen.items())]
    assert abs(z[0] - 2.0) < 0.3 and min(z) > 0.5, z


def test_logits_of_the_rows_a_decoder_reads_equal_the_full_pass_and_the_rest_are_zero(debug_model):
    """`masked_only` (preview, and the fused pass's block) runs the LM head on the mask slots within each
    row's length only; a check's padded rows skip it too, and the experts. The rows computed equal the full
    pass's."""
    mask_id = debug_model.config.mask_token_id
    with torch.no_grad():
        cache = debug_model.new_cache(3)
        debug_model.causal(torch.randint(0, 500, (3, 11)), cache, lengths=torch.tensor([11, 4, 7]))
        block = torch.randint(0, 500, (3, 8))
        block[0, [1, 2, 6]] = mask_id
        block[1] = mask_id
        block[2, [0, 5, 7]] = mask_id                     # slot 7 lies past the row's length
        lengths = torch.tensor([8, 8, 6])
        wanted = (block == mask_id) & (torch.arange(8)[None, :] < lengths[:, None])
        full = debug_model.preview(block, cache, lengths=lengths)
        some = debug_model.preview(block, cache, lengths=lengths, masked_only=True)
        assert_close(some[wanted], full[wanted], atol=ATOL, what="preview at mask slots")
        assert not some[~wanted].any()

        clean, clean_lengths = torch.randint(0, 500, (3, 5)), torch.tensor([5, 2, 0])
        fused = [debug_model.causal_and_preview(clean, block, c, clean_lengths=clean_lengths, block_lengths=lengths,
                                                masked_only=only)
                 for c, only in ((cache.select([0, 1, 2]), False), (cache.select([0, 1, 2]), True))]
        assert_close(fused[1][0], fused[0][0], atol=ATOL, what="fused clean logits")
        assert_close(fused[1][1][wanted], fused[0][1][wanted], atol=ATOL, what="fused block at mask slots")
        assert not fused[1][1][~wanted].any()

        drafts, check_lengths = torch.randint(0, 500, (3, 6)), torch.tensor([6, 2, 4])
        valid = torch.arange(6)[None, :] < check_lengths[:, None]
        seen: list[int] = []   # positions through the experts: the check's padding skips them
        hook = debug_model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
        checked, _ = debug_model.check(drafts, cache, lengths=check_lengths)
        hook.remove()
        plain = debug_model.causal(drafts, cache.select([0, 1, 2]), lengths=check_lengths)
        assert seen == [int(valid.sum())]
        empty = debug_model.causal(drafts[:2], None, lengths=torch.tensor([0, 0]), logits="last")   # nothing valid
        assert empty.shape == (2, debug_model.config.vocab_size) and torch.isfinite(empty).all()
        assert_close(checked[valid], plain[valid], atol=ATOL, what="check rows")
        assert not checked[~valid].any()


def test_bad_input_gets_clear_errors(debug_model):
    cache = debug_model.new_cache(1)
    with pytest.raises(TypeError, match="int64 or int32"):
        debug_model.causal(torch.zeros(1, 4), cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        debug_model.causal(torch.tensor([[1, 2, 512]]), cache)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        debug_model.preview(torch.tensor([[-1, 2]]), cache)
    with pytest.raises(ValueError, match="context limit of 1024"):
        debug_model.causal(torch.zeros(1, 1025, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="cache holds 1 sequences"):
        debug_model.preview(torch.zeros(2, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="lengths must be"):
        debug_model.causal(torch.zeros(1, 4, dtype=torch.long), cache, lengths=torch.tensor([5]))
    with pytest.raises(ValueError, match="shape"):
        debug_model.causal(torch.zeros(4, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="shapes differ"):
        debug_model.training_forward(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long))
    assert cache.lengths.tolist() == [0]  # nothing was written by the rejected calls


def test_bfloat16_model_runs_and_stays_close_to_fp32(debug_model):
    ids = torch.randint(0, 500, (1, 24))
    with torch.no_grad():
        ref = debug_model(ids)
        half = debug_model.to(torch.bfloat16)
        cache = half.new_cache(1)
        got = half.causal(ids, cache)
        assert cache.states[0].dtype == torch.float32  # GDN state stays fp32
        assert got.dtype == torch.bfloat16
    # bf16 has 8 mantissa bits; logits here are O(1)
    assert_close(got.float(), ref, atol=0.15, what="bf16 vs fp32 logits")


def test_sub_batches_over_a_shared_cache_equal_separate_caches(debug_model):
    """`rows` lets an engine run a subset of its sequences over one cache; reset rows are reusable."""
    seqs = [torch.randint(0, 500, (1, n)) for n in (9, 4, 13)]
    with torch.no_grad():
        shared = debug_model.new_cache(3)
        debug_model.causal(torch.cat([seqs[2], torch.zeros(1, 13, dtype=torch.long)]), shared,
                           lengths=torch.tensor([13, 0]), rows=[2, 0], logits="none")
        debug_model.causal(seqs[0], shared, rows=[0], logits="none")
        debug_model.causal(seqs[1], shared, rows=[1], logits="none")
        block = torch.randint(0, 500, (2, 8))
        got = debug_model.preview(block, shared, rows=[1, 2])
        for i, row in enumerate([1, 2]):
            alone = debug_model.new_cache(1)
            debug_model.causal(seqs[row], alone, logits="none")
            assert_close(got[i], debug_model.preview(block[i : i + 1], alone)[0], atol=ATOL, what=f"row {row}")
        assert shared.lengths.tolist() == [9, 4, 13]
        shared.reset_rows([1])
        debug_model.causal(seqs[2], shared, rows=[1], logits="none")
        assert_close(debug_model.preview(block[:1], shared, rows=[1]), debug_model.preview(block[:1], shared, rows=[2]),
                     atol=ATOL, what="reused row")
    with pytest.raises(ValueError, match="distinct"):
        debug_model.preview(block, shared, rows=[1, 1])


@torch.no_grad()
def test_consecutive_rows_as_a_slice_equal_rows_as_a_tensor(debug_model):
    """A slice of consecutive cache rows reads the cache through views (no copies) with the same result."""
    import copy

    ids = torch.randint(0, 500, (4, 30))
    base = debug_model.new_cache(4)
    debug_model.causal(ids[:, :20], base, lengths=torch.tensor([20, 13, 17, 9]), logits="none")
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    out_a = debug_model.causal(ids[1:3, 20:24], a, rows=torch.tensor([1, 2]), logits="all")
    out_b = debug_model.causal(ids[1:3, 20:24], b, rows=slice(1, 3), logits="all")
    assert_close(out_b, out_a, atol=1e-6)
    assert a.lengths.tolist() == b.lengths.tolist() == [20, 17, 21, 9]
    for x, y in zip(a.states, b.states, strict=True):
        if x is not None:
            assert_close(y, x, atol=1e-6)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):   # committed positions (the rest is scratch)
        if x is not None:
            for r, n in enumerate(a.lengths.tolist()):
                assert_close(y[r, :, :n], x[r, :, :n], atol=1e-6)
    block = torch.full((2, 8), debug_model.config.mask_token_id)
    assert_close(debug_model.preview(block, b, rows=slice(2, 4)), debug_model.preview(block, a, rows=[2, 3]),
                 atol=1e-6)
    with pytest.raises(ValueError, match="consecutive cache rows"):
        debug_model.causal(ids[:2, 24:26], b, rows=slice(0, 3))


def test_kv_capacity_grows_geometrically_up_to_the_context():
    """A sequence growing a block at a time copies its K/V a logarithmic number of times, and the buffer
    never grows past the model's context for positions within it."""
    from clover.model.cache import PrefixCache

    cache = PrefixCache.empty(CloverConfig.preset("debug"), 2)
    sizes = []
    for n in range(1, 4097, 32):
        cache.reserve(n, 4096)
        sizes.append(cache.capacity)
    assert sorted(set(sizes)) == [256, 512, 1024, 2048, 4096]


def _compare_compiled_with_eager(config: CloverConfig, passes: tuple[str, ...]) -> None:
    """`compile_decode` against the eager model on copies of one cache: one-token cache-writing steps
    (all rows, then a slice of two, across a growth of the K/V buffer), previews with padded blocks,
    `verify`'s check with a keep (both compiled), and a commit fused with a preview give the eager logits and leave the
    same cache. `passes`: which of "step", "check", "preview", "fused" to run (each compiles its graphs)."""
    import copy

    model = perturbed_model(config)
    eager_model = copy.deepcopy(model)
    mask_id = config.mask_token_id
    ids = torch.randint(0, 500, (3, 255))
    with torch.inference_mode():
        eager = model.new_cache(3)
        model.causal(ids, eager, lengths=torch.tensor([250, 100, 255]), logits="none")
        fast = copy.deepcopy(eager)
        model.compile_decode()

        def both(call):
            got, want = call(model, fast), call(eager_model, eager)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                            strict=True):
                assert (g is None) == (w is None)
                if g is not None:
                    assert_close(g, w, atol=ATOL, what="logits")

        if "step" in passes:
            for _ in range(4):
                tok = torch.randint(0, 500, (3, 1))
                both(lambda m, c, tok=tok: m.causal(tok, c, logits="last"))
            for _ in range(3):
                tok = torch.randint(0, 500, (2, 1))
                both(lambda m, c, tok=tok: m.causal(tok, c, rows=slice(1, 3), logits="last"))
            # a step asked for the GDN trace runs eagerly on the compiled model (its graph fills none: it returned
            # an empty trace, found by a review; the engine never asks one of a one-token step)
            traces = (GDNTrace(chunks=[0]), GDNTrace(chunks=[0]))
            tok = torch.randint(0, 500, (3, 1))
            both(lambda m, c: m.causal(tok, c, logits="last", gdn_trace=traces[m is eager_model]))
            assert traces[0].states and traces[0].states.keys() == traces[1].states.keys()
        block = torch.randint(0, 500, (3, 8))
        block[:, ::2] = mask_id
        lengths = torch.tensor([8, 5, 8])
        if "preview" in passes:
            both(lambda m, c: m.preview(block, c, lengths=lengths))
            both(lambda m, c: m.preview(block[1:], c, lengths=lengths[1:], rows=slice(1, 3)))
        if "check" in passes:
            drafts = torch.randint(0, 500, (3, 6))

            def check_and_keep(m, c):
                logits, trail = m.check(drafts, c, lengths=torch.tensor([6, 2, 4]))
                m.keep(c, trail, [3, 2, 1])
                return logits * (torch.arange(6)[None, :] < torch.tensor([6, 2, 4])[:, None])[..., None]  # rows read

            both(check_and_keep)
        if "fused" in passes:
            done = torch.randint(0, 500, (3, 8))
            both(lambda m, c: m.causal_and_preview(done, block, c, clean_lengths=torch.tensor([8, 3, 8]),
                                                   block_lengths=lengths, clean_logits="last"))
        ran = set(passes) | ({"keep"} if "check" in passes else set())
        assert ran <= model._compiled_ran   # it ran compiled, not after a fallback
    assert torch.equal(fast.lengths, eager.lengths) and ("step" not in passes or fast.capacity > 256)
    for r, n in enumerate(eager.lengths.tolist()):
        for a, b in zip(fast.keys + fast.values, eager.keys + eager.values, strict=True):
            if a is not None:
                assert_close(a[r, :, :n], b[r, :, :n], atol=ATOL, what="committed K/V")
    for a, b in zip(fast.states + fast.rings, eager.states + eager.rings, strict=True):
        if a is not None:
            assert_close(a, b, atol=ATOL, what="GDN state and ring")


def test_compiled_one_token_step_equals_the_eager_step(debug_config):
    _compare_compiled_with_eager(debug_config, ("step",))   # one graph: about 30 s on 2 cores


def test_a_compiled_check_of_many_tokens_runs_the_grouped_experts_inside_its_graph(debug_config, monkeypatch):
    """Beyond the dense mix's bound a compiled pass without gradients calls the grouped dispatch as an operator
    (`clover::experts_grouped`): no graph break. The break made dynamo give up the layer loop ("graph break in
    loop"), so a batch-8 `verify` check or block preview of clover-tiny ran eagerly, each layer's code after
    the break compiled on its own up to the recompile limit (session 53). Results equal the eager pass's."""
    import sys

    from torch._dynamo.utils import counters

    from clover.model import moe

    monkeypatch.setattr(moe, "_COMPILED_DENSE_WASTE", 0)   # (debug experts are tiny: every pass would be dense)
    torch._dynamo.reset()
    counters.clear()
    through_operator = []
    grouped = moe.experts_grouped

    def counted(*args: torch.Tensor) -> torch.Tensor:
        through_operator.append(sys._getframe(1).f_code.co_name == "grouped")   # (the operator's body calls it)
        return grouped(*args)

    monkeypatch.setattr(moe, "experts_grouped", counted)
    # 3 rows x 6 tokens: more than E / K = 4, so grouped (the dense bound is 0): the operator, or a break
    _compare_compiled_with_eager(debug_config, ("check",))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert any(through_operator) and not all(through_operator)   # the compiled check's, and the eager model's
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_preview_check_and_fused_passes_equal_the_eager_ones(debug_config):
    _compare_compiled_with_eager(debug_config, ("step", "check", "preview", "fused"))   # several minutes on 2 cores


def _compile_error() -> Exception:
    from torch._inductor.exc import CppCompileError

    return CppCompileError(["c++", "pass.cpp"], "c++: command not found")


def test_a_compiled_step_that_cannot_be_built_falls_back_to_eager(debug_model, caplog):
    """The pass fails to compile after its first piece has already updated the GDN rows (a graph broken
    in pieces): the fallback puts the rows back, so the eager rerun gives exactly the eager step."""
    ids = torch.randint(0, 500, (1, 9))
    with torch.inference_mode():
        cache = debug_model.new_cache(1)
        debug_model.causal(ids[:, :8], cache, logits="none")
        want = debug_model.causal(ids[:, 8:], cache.select([0]), logits="last")

        def half_built(*args):
            debug_model._steps(*args)         # writes the GDN state and conv ring in place
            raise _compile_error()

        debug_model._compiled = {"step": half_built, "check": half_built, "preview": half_built, "fused": half_built}
        got = debug_model.causal(ids[:, 8:], cache, logits="last")
    assert debug_model._compiled == {} and "decoding eagerly" in caplog.text
    assert torch.equal(got, want) and int(cache.lengths[0]) == 9


def test_a_training_forward_that_cannot_be_compiled_trains_eagerly(debug_model, caplog, monkeypatch):
    """`compile_training` whose compiled forward fails to compile (at any call: a forward writes no state, so
    the eager rerun is the same step): the pass runs eagerly (the same hidden states), with a warning, and
    later passes stay eager; an error that is not a compile failure is raised. torch.compile itself refusing
    (an unsupported Python) leaves training eager too."""
    ids = torch.randint(0, 500, (2, 12))
    want, _ = debug_model.causal(ids, logits="train")

    def broken(*args):
        raise _compile_error()

    debug_model._train_run = broken
    got, _ = debug_model.causal(ids, logits="train")
    assert torch.equal(got, want) and debug_model._train_run is None and "training eagerly" in caplog.text

    def failing(*args):
        raise ValueError("a bug in the pass")

    debug_model._train_run = failing
    with pytest.raises(ValueError, match="a bug in the pass"):
        debug_model.causal(ids, logits="train")

    def unsupported(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported on this Python")

    monkeypatch.setattr(torch, "compile", unsupported)
    debug_model.compile_training()
    assert debug_model._train_run is None and "not supported on this Python" in caplog.text
    debug_model.compile_decode()
    assert debug_model._compiled == {}


def test_a_compiled_pass_raises_errors_that_are_not_compile_failures(debug_model):
    """A computation error, or a compile error once the pass has run, is the caller's to see: rerunning a
    pass that ran on a live cache would apply its step twice."""
    ids = torch.randint(0, 500, (1, 2))
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("a bug in the pass")
        if len(calls) == 2:
            return debug_model._steps(*args)
        raise _compile_error()

    debug_model._compiled = {"step": flaky}
    try:
        with torch.inference_mode():
            cache = debug_model.new_cache(1)
            debug_model.causal(ids[:, :1], cache, logits="none")
            with pytest.raises(ValueError, match="a bug in the pass"):
                debug_model.causal(ids[:, 1:], cache, logits="last")
            debug_model.causal(ids[:, 1:], cache, logits="last")          # the second call runs
            with pytest.raises(type(_compile_error()), match="command not found"):
                debug_model.causal(ids[:, 1:], cache, logits="last")
        assert "step" in debug_model._compiled
    finally:
        debug_model.compile_decode(False)


def test_prepacked_lm_head_equals_f_linear_and_follows_its_weight(monkeypatch, caplog):
    """The inference head (`LMHead`: oneDNN's prepacked weight on CPU float32) gives `F.linear`'s logits to
    float32 rounding at decoding's row counts, repacks after an in-place change of its weight (a training
    run's evaluations), leaves autograd and autocast to `F.linear`, survives a deep copy and a save once
    packed, and falls back to `F.linear` where packing fails."""
    head = LMHead(384, 1000)
    torch.nn.init.normal_(head.weight, std=0.02)
    xs = [torch.randn(1, 384), torch.randn(8, 1, 384), torch.randn(72, 384), torch.randn(2, 5, 384)]
    tol = 1e-5   # |logits| ~ 0.4, a 384-term float32 sum in another order: errors ~2e-6
    with torch.inference_mode():
        for x in xs:
            assert_close(head(x), F.linear(x, head.weight), atol=tol, what=f"head of {tuple(x.shape)}")
    first = head._packed_weight
    assert (first is not None) == LMHead._packing
    with torch.no_grad():
        head.weight.mul_(-2)
    with torch.inference_mode():
        assert_close(head(xs[2]), F.linear(xs[2], head.weight), atol=tol, what="head after a weight update")
    assert LMHead._packing is False or head._packed_weight is not first          # packed again
    twin = copy.deepcopy(head)                                                   # with a packed copy in place
    torch.save(head, io.BytesIO())
    with torch.inference_mode():
        assert_close(twin(xs[1]), F.linear(xs[1], head.weight), atol=tol, what="head of a deep copy")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = head(xs[1])
            assert got.dtype == torch.bfloat16 and torch.equal(got, F.linear(xs[1], head.weight))
    x = xs[1].clone().requires_grad_()
    head(x).sum().backward()
    assert_close(x.grad, head.weight.sum(0).expand_as(x), atol=1e-5, what="gradient through the head")

    def fail(w):
        raise RuntimeError("no oneDNN here")

    monkeypatch.setattr(LMHead, "_packing", True)
    monkeypatch.setattr(LMHead, "_reorder", staticmethod(fail))
    other = LMHead(384, 1000)
    with torch.inference_mode():
        got = other(xs[0])
    assert torch.equal(got, F.linear(xs[0], other.weight))
    assert "prepacked lm_head unavailable" in caplog.text and not LMHead._packing
