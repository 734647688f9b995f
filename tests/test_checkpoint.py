"""Config and checkpoint round trips, named errors, atomic writes, conversion from transformers."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import perturbed_model
from safetensors.torch import load_file, save_file

from clover.cli.commands import main as cli_main
from clover.model.checkpoint import (
    CheckpointError,
    convert_transformers_checkpoint,
    load_checkpoint,
    load_for_generation,
    sanitize_transformers,
    save_checkpoint,
)
from clover.model.config import CloverConfig, ConfigError, GenerationConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.testing import assert_close


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


# -- config ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["debug", "tiny", "small", "clover-35b-a3b"])
def test_config_round_trips_through_config_json(tmp_path, preset):
    config = CloverConfig.preset(preset)
    config.save(tmp_path)
    assert CloverConfig.load(tmp_path) == config
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "clover_moe"


def test_real_shape_preset_counts():
    config = CloverConfig.preset("clover-35b-a3b")
    total, active = config.num_parameters()
    assert 34e9 < total < 36e9 and 3e9 < active < 3.7e9  # "35B total / about 3B active"
    assert config.layer_types.count("full_attention") == 10


@pytest.mark.parametrize("change,message", [
    ({"num_attention_heads": 5}, "multiple of num_key_value_heads"),
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ({"num_experts_per_tok": 9}, "cannot exceed num_experts"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_window"]}, "unknown layer type"),
    ({"layer_types": ["linear_attention"]}, "layer_types has 1 entries"),
    ({"mask_token_id": 512}, "mask_token_id 512 is outside"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"block_size": -2}, "block_size must be a positive integer"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type 'yarn'"),
    ({"head_dim": 6}, "even integer"),
    ({"eos_token_id": 511}, "must differ from the end-of-sequence"),
    # shapes a hand-edited config.json or an --override can hold (each was a TypeError or accepted before)
    ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number"),
    ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be in \(0, 1\)"),
    ({"rms_norm_eps": 1e300}, r"rms_norm_eps must be in \(0, 1\)"),   # (loaded; every reply was empty)
    ({"rope_parameters": {"rope_theta": 1e-300}}, r"rope_theta must be in \[1, 1e12\]"),   # (failed at decode)
    ({"layer_types": 3}, "layer_types must be a list"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta must be a finite number"),
    ({"eos_token_id": [1, "2"]}, "eos_token_id must be an integer, a list"),
    ({"attention_bias": "no"}, "attention_bias must be true or false"),
    ({"attention_dropout": 1.5}, "attention_dropout must be in"),
    ({"not_a_field": 1}, r"unknown config field\(s\) \['not_a_field'\]"),
])
def test_config_rejects_inconsistent_values(change, message):
    with pytest.raises(ConfigError, match=message):
        CloverConfig.preset("debug", **change)


def test_config_loads_a_transformers_text_and_multimodal_config():
    transformers = pytest.importorskip("transformers")
    text = transformers.Qwen3_5MoeTextConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
    )
    config = CloverConfig.from_dict(text.to_dict())
    assert config.mask_token_id == 299 and config.layer_types == text.layer_types
    assert config.rotary_dim == 4 and config.rope_theta == text.rope_parameters["rope_theta"]
    assert CloverConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text.to_dict()}) == config
    # a multimodal config keeps its tying at the top level (found by a hostile pass: a tied source was then read
    # untied, and its conversion failed on a missing lm_head.weight); the text config's own, where given, wins
    untied = {k: v for k, v in text.to_dict().items() if k != "tie_word_embeddings"}
    assert CloverConfig.from_dict({"model_type": "qwen3_5_moe", "tie_word_embeddings": True,
                                   "text_config": untied}).tie_word_embeddings is True
    assert CloverConfig.from_dict({"model_type": "qwen3_5_moe", "tie_word_embeddings": True,
                                   "text_config": {**untied, "tie_word_embeddings": False}}).tie_word_embeddings is False
    with pytest.raises(ConfigError, match="neither Clover"):
        CloverConfig.from_dict({"model_type": "llama"})


# -- checkpoints -------------------------------------------------------------------------------------


def test_checkpoint_round_trip_single_and_sharded(tmp_path, debug_model):
    ids = torch.randint(0, 500, (1, 17))
    expected = _logits(debug_model, ids)
    save_checkpoint(debug_model, tmp_path / "one")
    save_checkpoint(debug_model, tmp_path / "many", max_shard_bytes=200_000)
    assert (tmp_path / "one" / "model.safetensors").is_file()
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for name in ("one", "many"):
        loaded = load_checkpoint(tmp_path / name)
        # same weights; BLAS may pick another summation order for differently aligned buffers (~2e-7)
        assert_close(_logits(loaded, ids), expected, atol=1e-6, what=name)
        assert loaded.config == debug_model.config
    gen = json.loads((tmp_path / "one" / "generation_config.json").read_text())
    assert gen["algorithm"] == "low_confidence" and gen["block_size"] == debug_model.config.block_size


def test_a_checkpoints_tokenizer_states_the_models_context(tmp_path, debug_model):
    """tokenizer_config.json's model_max_length is the model's context (found by a hostile pass: 131072 whatever the
    model, so transformers never warned past clover-tiny's 4096); the shipped one says 4096."""
    from clover.model.tokenizer import Tokenizer

    save_checkpoint(debug_model, tmp_path / "ck", extra_files=Tokenizer.load(SHIPPED).files())
    saved = json.loads((tmp_path / "ck" / "tokenizer_config.json").read_text())
    assert saved["model_max_length"] == debug_model.config.max_position_embeddings != 131072
    shipped = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    assert shipped["model_max_length"] == load_checkpoint(SHIPPED).config.max_position_embeddings == 4096


def test_load_with_dtype_choice(tmp_path, debug_model):
    save_checkpoint(debug_model, tmp_path / "ck", dtype="bfloat16")
    assert load_file(str(tmp_path / "ck" / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16
    assert load_checkpoint(tmp_path / "ck").dtype == torch.bfloat16
    model = load_checkpoint(tmp_path / "ck", dtype="float32")
    assert model.dtype == torch.float32 and all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="unknown dtype"):
        load_checkpoint(tmp_path / "ck", dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_checkpoint(tmp_path / "ck", device="cuda")


def test_tied_embeddings_round_trip(tmp_path):
    model = perturbed_model(CloverConfig.preset("debug", tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    save_checkpoint(model, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    loaded = load_checkpoint(tmp_path / "tied")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 500, (1, 9))
    assert_close(_logits(loaded, ids), _logits(model, ids), atol=1e-6, what="tied")


def _edit_weights(directory, edit):
    path = str(directory / "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.1.linear_attn.A_log"), "missing tensors: model.layers.1.linear_attn.A_log"),
    (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), "unexpected tensors: model.layers.0.extra"),
    (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), r"mis-shaped tensors: model.norm.weight \(checkpoint \(3,\)"),
])
def test_mismatched_checkpoint_names_the_tensor(tmp_path, debug_model, edit, message):
    save_checkpoint(debug_model, tmp_path / "ck")
    _edit_weights(tmp_path / "ck", edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "ck")


def test_corrupted_or_incomplete_checkpoint_fails_with_named_error(tmp_path, debug_model):
    save_checkpoint(debug_model, tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_checkpoint(tmp_path / "ck")
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="corrupted or truncated"):
        load_checkpoint(tmp_path / "ck")
    save_checkpoint(debug_model, tmp_path / "sh", max_shard_bytes=200_000)
    shard = sorted((tmp_path / "sh").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing: {shard.name}"):
        load_checkpoint(tmp_path / "sh")
    (tmp_path / "ck" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(tmp_path / "ck")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, debug_model, monkeypatch):
    save_checkpoint(debug_model, tmp_path / "ck")
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()
    import clover.model.checkpoint as ckpt

    def dying_write(*args, **kwargs):
        raise KeyboardInterrupt  # the process is killed while writing weights

    monkeypatch.setattr(ckpt, "_write_weights", dying_write)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(perturbed_model(debug_model.config), tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no half-written directory left behind
    load_checkpoint(tmp_path / "ck")


def test_a_kill_between_the_two_renames_of_a_swap_is_recovered(tmp_path, debug_model, monkeypatch):
    """The old version was moved aside and the process died before the new one moved in: a reader reads
    the old version where it lies (never moving or deleting anything: a writer may be mid-swap); the next
    write moves it back and removes leftover temp directories of killed writers."""
    save_checkpoint(debug_model, tmp_path / "ck")
    before = (tmp_path / "ck" / "model.safetensors").read_bytes()

    real_replace = os.replace

    def dying_replace(src, dst):
        if os.path.basename(src).startswith(".ck.tmp-") and dst == tmp_path / "ck":   # the new version into place
            raise KeyboardInterrupt
        real_replace(src, dst)

    import clover.model.files as files

    monkeypatch.setattr(files.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(perturbed_model(debug_model.config), tmp_path / "ck")
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert not (tmp_path / "ck").exists()            # the crash window: no checkpoint under its name
    (tmp_path / ".ck.tmp-killedwriter").mkdir()       # and a temp directory a killed writer left
    listing = sorted(os.listdir(tmp_path))
    load_checkpoint(tmp_path / "ck")                   # a reader reads the old version and touches nothing
    assert sorted(os.listdir(tmp_path)) == listing
    save_checkpoint(debug_model, tmp_path / "ck")      # the next write completes the recovery and cleans up
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_file_written_atomically_is_the_old_or_the_new_one(tmp_path, monkeypatch):
    """write_text_atomic (run settings, resumable logs, a data build's completion record): a write killed
    after the new text went out but before the rename leaves the previous file whole and no temp file; a
    write that succeeds replaces it, a new file with the mode a plain write gives, an existing one keeping its
    own; a symbolic link is written through."""
    import clover.model.files as files

    path = tmp_path / "train_config.json"
    files.write_text_atomic(path, '{"dtype": "bfloat16"}\n')
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
    written = []

    def killed(fd):
        written.append(os.fstat(fd).st_size)
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        files.write_text_atomic(path, '{"dtype": "float32"}\n')
    monkeypatch.undo()
    assert written == [len('{"dtype": "float32"}\n')]   # the new text was out when the kill came
    assert path.read_text() == '{"dtype": "bfloat16"}\n'
    assert os.listdir(tmp_path) == ["train_config.json"]
    path.chmod(0o600)
    (tmp_path / "link.json").symlink_to(path)
    files.write_text_atomic(tmp_path / "link.json", "new\n")
    assert path.read_text() == "new\n" and (tmp_path / "link.json").is_symlink()
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["link.json", "train_config.json"]


# -- conversion --------------------------------------------------------------------------------------


def _transformers_checkpoint(tmp_path, config):
    pytest.importorskip("transformers")
    from test_parity import reference_model

    ref = reference_model(config)
    ref.save_pretrained(tmp_path / "hf")
    return ref


def test_convert_keeps_causal_logits_and_adds_neutral_extras(tmp_path, debug_config):
    ref = _transformers_checkpoint(tmp_path, debug_config)
    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "clover")]) == 0
    model = load_checkpoint(tmp_path / "clover")
    ids = torch.randint(0, 500, (2, 21))
    with torch.no_grad():
        assert_close(model(ids), ref(ids).logits, atol=1e-4, what="converted logits")
    gdn = model.model.layers[0].linear_attn
    assert torch.equal(gdn.conv_right, torch.zeros_like(gdn.conv_right))
    assert torch.equal(gdn.history_bias, torch.zeros_like(gdn.history_bias))
    assert_close(gdn.preview_log_scale, torch.full_like(gdn.preview_log_scale, 0.5 * torch.log(torch.tensor(16.0))),
                 atol=1e-6, what="preview scale init")
    original = ref.model.embed_tokens.weight
    assert_close(model.model.embed_tokens.weight[model.config.mask_token_id], original.mean(0), atol=1e-6,
                 what="mask row = mean embedding")
    assert torch.equal(model.model.embed_tokens.weight[:-1], original[:-1])


def test_converting_a_clover_checkpoint_says_the_mask_row_is_reset_or_keeps_it(tmp_path, debug_config, capsys):
    """Found by a hostile pass: `clover convert` of the shipped model silently reset its trained mask row (its
    block diffusion then wrote nonsense). The recipe converts its AR parent, a Clover checkpoint whose row no
    training touched, so the reset stays the default; it is said, and --keep-mask-row keeps the row."""
    torch.manual_seed(0)
    save_checkpoint(CloverForCausalLM(debug_config), tmp_path / "c")
    row = load_checkpoint(tmp_path / "c").model.embed_tokens.weight[debug_config.mask_token_id].clone()
    assert cli_main(["convert", str(tmp_path / "c"), str(tmp_path / "reset")]) == 0
    assert "is a Clover checkpoint; its mask token's row" in capsys.readouterr().err
    assert not torch.equal(load_checkpoint(tmp_path / "reset").model.embed_tokens.weight[debug_config.mask_token_id],
                           row)
    assert cli_main(["convert", str(tmp_path / "c"), str(tmp_path / "kept"), "--keep-mask-row"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert torch.equal(load_checkpoint(tmp_path / "kept").model.embed_tokens.weight[debug_config.mask_token_id], row)


def test_convert_refuses_a_mask_token_other_than_its_tokenizers(tmp_path, debug_config, capsys):
    """A source with Clover's tokenizer has a mask token: `--mask-token-id` naming another token would make
    diffusion mask with ordinary text (found by a hostile pass: training took it, generation refused it)."""
    from clover.model.tokenizer import Tokenizer

    tok = Tokenizer.load(SHIPPED)
    config = CloverConfig.preset("debug", mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids,
                                 vocab_size=tok.vocab_size)
    save_checkpoint(CloverForCausalLM(config), tmp_path / "c", extra_files=tok.files())
    assert cli_main(["convert", str(tmp_path / "c"), str(tmp_path / "bad"), "--mask-token-id", "100"]) == 1
    assert f"its own mask token ({tok.mask_token_id})" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert cli_main(["convert", str(tmp_path / "c"), str(tmp_path / "ok"), "--mask-token-id",
                     str(tok.mask_token_id)]) == 0
    assert load_checkpoint(tmp_path / "ok").config.mask_token_id == tok.mask_token_id


def test_converting_again_with_another_block_size_decodes_at_it(tmp_path, debug_config):
    """The generation config of a directory written again is kept (someone's decoding defaults) except where it
    only stated the model: a block size that was the model's follows the new one (it stayed 8 over a model
    converted to block 4 before), one chosen apart from it stays."""
    save_checkpoint(CloverForCausalLM(debug_config), tmp_path / "c")
    target = tmp_path / "t"
    gen = target / "generation_config.json"
    assert cli_main(["convert", str(tmp_path / "c"), str(target)]) == 0
    assert json.loads(gen.read_text())["block_size"] == debug_config.block_size
    mine = {**json.loads(gen.read_text()), "threshold": 0.8}
    gen.write_text(json.dumps(mine))
    assert cli_main(["convert", str(tmp_path / "c"), str(target), "--block-size", "4", "--overwrite"]) == 0
    assert json.loads(gen.read_text()) == {**mine, "block_size": 4}
    assert load_checkpoint(target).config.block_size == 4
    gen.write_text(json.dumps({**mine, "block_size": 2}))   # chosen apart from the model's 4
    assert cli_main(["convert", str(tmp_path / "c"), str(target), "--block-size", "8", "--overwrite"]) == 0
    assert json.loads(gen.read_text())["block_size"] == 2


def test_sanitize_packs_per_expert_tensors_and_drops_extras():
    gate, up, down = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 3)
    tensors = {f"model.language_model.layers.0.mlp.experts.{e}.{n}.weight": t * (e + 1)
               for e in range(2) for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))}
    tensors["mtp.fc.weight"] = torch.zeros(1)
    tensors["model.visual.patch.weight"] = torch.zeros(1)
    out = sanitize_transformers(tensors)
    assert sorted(out) == ["model.layers.0.mlp.experts.down_proj", "model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(out["model.layers.0.mlp.experts.gate_up_proj"][1], torch.cat([gate, up]) * 2)
    assert torch.equal(out["model.layers.0.mlp.experts.down_proj"][0], down)


def test_cli_errors_are_one_line_and_exit_non_zero(tmp_path, capsys):
    assert cli_main(["info", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "does not exist" in err
    assert cli_main(["init", str(tmp_path / "x"), "--override", '{"num_experts_per_tok": 99}']) == 1
    assert "cannot exceed num_experts" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path), str(tmp_path / "y")]) == 1
    assert "no config.json" in capsys.readouterr().err


def test_commands_never_replace_what_is_not_theirs(tmp_path, capsys):
    """init, convert, export and data build/distill write by replacing their target: over a user's files, a
    file, their own source or the corpus they read, they refuse instead (found by a hostile CLI pass)."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "data.txt").write_text("keep me")
    assert cli_main(["init", str(mine), "--preset", "debug", "--no-tokenizer"]) == 1
    assert "not a checkpoint" in capsys.readouterr().err and (mine / "data.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("keep me too")
    assert cli_main(["init", str(tmp_path / "afile"), "--preset", "debug", "--no-tokenizer"]) == 1
    assert (tmp_path / "afile").read_text() == "keep me too"
    model = tmp_path / "m"
    assert cli_main(["init", str(model), "--preset", "debug", "--no-tokenizer"]) == 0
    assert cli_main(["init", str(model), "--preset", "debug", "--no-tokenizer", "--seed", "1"]) == 1  # a checkpoint:
    assert "pass --overwrite" in capsys.readouterr().err   # replaced only when asked
    assert cli_main(["init", str(model), "--preset", "debug", "--no-tokenizer", "--seed", "1", "--overwrite"]) == 0
    assert cli_main(["export", str(model), str(model), "--causal"]) == 1
    assert "is the source" in capsys.readouterr().err
    assert cli_main(["convert", str(model), str(mine)]) == 1 and (mine / "data.txt").is_file()
    (mine / "config.json").write_text("{}")   # a config.json alone does not make the user's files a checkpoint
    (mine / "src").mkdir()
    assert cli_main(["export", str(model), str(mine), "--causal"]) == 1
    assert "data.txt, src, which are not part of a checkpoint" in capsys.readouterr().err
    assert (mine / "data.txt").read_text() == "keep me" and (mine / "src").is_dir()
    (mine / "config.json").unlink()
    (mine / "src").rmdir()
    assert cli_main(["data", "build", "--out", str(mine)]) == 1 and (mine / "data.txt").read_text() == "keep me"
    assert cli_main(["data", "distill", "--model", str(model), "--data", str(tmp_path), "--out", str(tmp_path)]) == 1
    assert "would replace --data" in capsys.readouterr().err


NEW_MANIFEST = '{"sources": {}, "split_rule": "new"}'   # (what `data build` refuses to replace is not one)


def test_a_killed_data_build_leaves_the_directory_as_it_was(tmp_path, monkeypatch, capsys):
    """`data build` writes a temp dir beside --out and swaps it in whole (found by a hostile pass: a build killed
    part way left a directory that the next build refused, and over an earlier build it had already replaced
    part of that corpus)."""
    import clover.cli.train as train_cli

    data = tmp_path / "d"
    (data / "tokens").mkdir(parents=True)
    earlier = '{"sources": {}, "split_rule": "earlier"}'   # (an earlier build's manifest: `data build` replaces it)
    (data / "manifest.json").write_text(earlier)
    (data / "tokens" / "train_code.bin").write_bytes(b"earlier tokens")

    def killed(out, *args, **kwargs):
        (Path(out) / "raw").mkdir()
        raise OSError("killed")

    monkeypatch.setattr(train_cli, "build_corpus", killed)
    assert cli_main(["data", "build", "--out", str(data), "--tokenizer", str(SHIPPED)]) == 1
    assert "killed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp dir left
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json", "tokens"]
    assert (data / "manifest.json").read_text() == earlier
    assert (data / "tokens" / "train_code.bin").read_bytes() == b"earlier tokens"

    leftover = tmp_path / ".d.tmp-killed9"  # what a SIGKILL leaves: no cleanup ran
    (leftover / "raw").mkdir(parents=True)

    def corpus(out, *args, **kwargs):
        (Path(out) / "raw").mkdir()
        (Path(out) / "manifest.json").write_text(NEW_MANIFEST)
        return {"sources": {}}

    monkeypatch.setattr(train_cli, "build_corpus", corpus)
    monkeypatch.setattr(train_cli, "encode_corpus", lambda out, tok: {"train_code": 0})
    assert cli_main(["data", "build", "--out", str(data), "--tokenizer", str(SHIPPED)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert sorted(p.name for p in data.iterdir()) == ["manifest.json", "raw", "tokenizer"]
    assert (data / "manifest.json").read_text() == NEW_MANIFEST
    umask = os.umask(0)
    os.umask(umask)
    assert (data / "raw").stat().st_mode & 0o777 == 0o777 & ~umask   # a directory keeps its x bits
    assert (data / "tokenizer" / "tokenizer.json").stat().st_mode & 0o777 == 0o666 & ~umask

    # what is not part of a data directory is never swapped away with it (found by a review: a distillation
    # written inside the data directory was deleted by the next build)
    (data / "distill").mkdir()
    (data / "notes.txt").write_text("mine")
    assert cli_main(["data", "build", "--out", str(data), "--tokenizer", str(SHIPPED)]) == 1
    assert "distill, notes.txt, which are not part of a data directory" in capsys.readouterr().err
    (data / "distill").rmdir()
    (data / "notes.txt").unlink()

    # a link is followed: the directory it names is rebuilt, beside itself; `.` as well
    real = tmp_path / "elsewhere" / "data"
    real.parent.mkdir()
    (tmp_path / "d").rename(real)
    (tmp_path / "d").symlink_to(real)
    (real / "manifest.json").write_text('{"sources": {}, "split_rule": "older"}')
    assert cli_main(["data", "build", "--out", str(tmp_path / "d"), "--tokenizer", str(SHIPPED)]) == 0
    assert (tmp_path / "d").is_symlink() and (real / "manifest.json").read_text() == NEW_MANIFEST
    assert sorted(p.name for p in real.parent.iterdir()) == ["data"]
    monkeypatch.chdir(real)
    (real / "manifest.json").write_text('{"sources": {}, "split_rule": "older"}')
    assert cli_main(["data", "build", "--out", ".", "--tokenizer", str(SHIPPED)]) == 0
    assert (real / "manifest.json").read_text() == NEW_MANIFEST and sorted(p.name for p in real.parent.iterdir()) == ["data"]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc")
def test_a_saved_checkpoint_is_on_the_disk_before_it_is_renamed_into_place(tmp_path, debug_model, monkeypatch):
    """Every file of the temp directory, and the directory, is fsynced before the rename (the module said so, and
    nothing was: after a power cut the rename could survive with empty files, the run's only checkpoint)."""
    import clover.model.files as files

    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                         real_fsync(fd))[1])
    monkeypatch.setattr(files.os, "replace", lambda a, b: (renamed.append((str(a), len(synced))), real_replace(a, b))[1])
    save_checkpoint(debug_model, tmp_path / "ck")
    tmp, count = renamed[-1]
    done = synced[:count]
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names and set(names) <= {Path(p).name for p in done if Path(p).parent == Path(tmp)}
    assert tmp in done   # the directory that lists them


def test_saved_checkpoints_follow_the_umask_not_the_temp_dir_mode(tmp_path, debug_model):
    save_checkpoint(debug_model, tmp_path / "ck")
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "ck").stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "ck" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


# -- transformers loads Clover checkpoints -----------------------------------------------------------------------

SHIPPED = Path(__file__).resolve().parents[1] / "clover" / "weights" / "clover-tiny"


def _hf_logits(directory, ids, **kw):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return hf(ids).logits


def test_the_shipped_checkpoint_carries_the_remote_code_of_this_source():
    """Every checkpoint carries copies of clover/model/remote_code (transformers loads them from the checkpoint's
    own directory); the shipped one's are today's, not an older copy."""
    from clover.model.checkpoint import REMOTE_CODE

    for src in REMOTE_CODE:
        assert (SHIPPED / src.name).read_text() == src.read_text(), src.name


def test_transformers_loads_the_shipped_checkpoint_with_its_remote_code():
    """config.json's architectures and auto_map name the two remote-code files shipped with the weights;
    transformers' causal logits equal Clover's causal mode on the same (bf16-stored) weights."""
    model = load_checkpoint(SHIPPED, dtype="float32")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    assert_close(_hf_logits(SHIPPED, ids, trust_remote_code=True), expected, atol=1e-4, what="shipped via transformers")
    assert expected.abs().max() > 1.0
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(SHIPPED), trust_remote_code=True)
    assert (config.model_type, config.block_size, config.mask_token_id) == ("clover_moe", 32, model.config.mask_token_id)


def test_transformers_samples_and_decodes_greedily_with_a_checkpoints_generation_config(tmp_path, debug_model):
    """generation_config.json is spelled as transformers reads it too (found by a hostile pass: its `temperature: 0.0`
    made transformers' generate(do_sample=True) and a sampling pipeline raise on every Clover checkpoint): greedy by
    default there as in Clover, sampling when asked; Clover reads the file back to the same defaults, and reads
    transformers' `do_sample` as transformers does."""
    transformers = pytest.importorskip("transformers")
    save_checkpoint(debug_model, tmp_path / "ck")
    gen = json.loads((tmp_path / "ck" / "generation_config.json").read_text())
    assert gen["do_sample"] is False and "temperature" not in gen and "top_k" not in gen
    assert GenerationConfig.from_dict(gen) == GenerationConfig(block_size=debug_model.config.block_size)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(SHIPPED), trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([[40, 41, 42, 43]])
    torch.manual_seed(0)
    sampled = hf.generate(ids, max_new_tokens=4, do_sample=True)
    greedy = hf.generate(ids, max_new_tokens=4)
    assert sampled.shape == greedy.shape == (1, 8) and hf.generation_config.do_sample is False
    assert GenerationConfig.from_dict({"do_sample": False, "temperature": 0.7}).temperature == 0.0
    assert GenerationConfig.from_dict({"do_sample": True}).temperature == 1.0
    sampling = GenerationConfig(temperature=0.7).to_file()   # (top_k 0 stays: transformers would sample at 50)
    assert sampling["do_sample"] is True and sampling["temperature"] == 0.7 and sampling["top_k"] == 0
    assert GenerationConfig.from_dict({"do_sample": True, "temperature": 0.3}).temperature == 0.3
    assert GenerationConfig.from_dict({"temperature": 0.3}).temperature == 0.3   # (a file from before: as written)
    with pytest.raises(ConfigError, match="do_sample must be true or false"):
        GenerationConfig.from_dict({"do_sample": "no"})


def test_a_generation_config_from_before_do_sample_is_respelled_when_saved_again(tmp_path, debug_model):
    """A kept generation_config.json written before `do_sample` (temperature 0.0 and top_k 0, which transformers'
    sampling refused) is spelled anew on the next save: the same defaults, its own choices and other keys kept."""
    save_checkpoint(debug_model, tmp_path / "ck")
    gen = tmp_path / "ck" / "generation_config.json"
    old = {"algorithm": "verify", "block_size": 8, "threshold": 0.8, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
           "eos_token_id": debug_model.config.eos_token_ids, "mine": 1}
    gen.write_text(json.dumps(old))
    save_checkpoint(debug_model, tmp_path / "ck")
    new = json.loads(gen.read_text())
    assert new["do_sample"] is False and "temperature" not in new and "top_k" not in new and new["mine"] == 1
    assert GenerationConfig.from_dict(new) == GenerationConfig.from_dict(old)
    assert GenerationConfig.from_dict(new).algorithm == "verify" and new["threshold"] == 0.8


def test_a_checkpoint_saved_by_transformers_loads_whole_in_clover(tmp_path):
    """The remote code holds the block-diffusion extension tensors as parameters its forward does not use, so a
    `save_pretrained` (after a fine-tune, say) writes them back (found by a hostile pass: they were dropped, and
    Clover refused the result); the tensors come back bit for bit, and the saved model's logits are the same."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(SHIPPED), trust_remote_code=True).eval()
    hf.save_pretrained(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(SHIPPED / name, tmp_path / "hf" / name)
    back, shipped = load_checkpoint(tmp_path / "hf"), load_checkpoint(SHIPPED)
    theirs, ours = back.state_dict(), shipped.state_dict()
    assert theirs.keys() == ours.keys() and any("conv_right" in k for k in ours)
    for key, value in ours.items():
        assert torch.equal(theirs[key], value), key
    assert (shipped.model.layers[0].linear_attn.history_bias != 0).any()   # (trained, not the neutral values)
    extension = [n for n, _ in hf.named_buffers() if n.rsplit(".", 1)[-1] in ("conv_right", "preview_log_scale",
                                                                            "history_bias")]
    assert len(extension) == 9 and not any(n in extension for n, _ in hf.named_parameters())   # (no fine-tune moves them)


def test_transformers_loads_a_converted_checkpoint_and_an_exported_causal_one(tmp_path, debug_config):
    """transformers -> `clover convert` -> transformers (remote code) keeps the logits; `clover export --causal`
    writes a plain Qwen3_5MoeForCausalLM checkpoint (no remote code, no extension tensors) with the same logits."""
    ref = _transformers_checkpoint(tmp_path, debug_config)
    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "converted")]) == 0
    ids = torch.randint(0, 500, (2, 21))
    clover_logits = _logits(load_checkpoint(tmp_path / "converted"), ids)
    with torch.no_grad():
        assert_close(clover_logits, ref(ids).logits, atol=1e-4, what="converted")
    assert_close(_hf_logits(tmp_path / "converted", ids, trust_remote_code=True), clover_logits, atol=1e-4,
                 what="converted via transformers")
    assert cli_main(["export", str(tmp_path / "converted"), str(tmp_path / "plain"), "--causal"]) == 0
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text" and "auto_map" not in config and "block_size" not in config
    assert not list((tmp_path / "plain").glob("*.py"))
    names = load_file(tmp_path / "plain" / "model.safetensors").keys()
    assert not [n for n in names if n.rsplit(".", 1)[-1] in ("conv_right", "preview_log_scale", "history_bias")]
    assert_close(_hf_logits(tmp_path / "plain", ids), clover_logits, atol=1e-4, what="exported causal")


def test_a_checkpoint_with_corrupt_files_is_one_error_naming_them(tmp_path, debug_model):
    """Found by a hostile pass on files: each was a traceback (or, for the special ids, a model that decodes
    with an ordinary token as its mask)."""
    from clover.model.checkpoint import load_for_generation
    from clover.model.tokenizer import Tokenizer, TokenizerError, stdlib_texts

    good = tmp_path / "good"
    tok = Tokenizer.train(list(stdlib_texts())[:20], vocab_size=debug_model.config.vocab_size)
    model = CloverForCausalLM.from_scratch(CloverConfig.preset(
        "debug", mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids), seed=0)
    save_checkpoint(model, good, extra_files=tok.files())
    load_for_generation(str(good))

    def broken(name, edit):
        d = tmp_path / name
        shutil.copytree(good, d)
        edit(d)
        return str(d)

    def int_tensor(d):
        t = load_file(d / "model.safetensors")
        t["model.norm.weight"] = t["model.norm.weight"].long()
        save_file(t, d / "model.safetensors")

    cases = [
        (broken("int", int_tensor), CheckpointError, r"not floating point: model.norm.weight \(int64\)"),
        (broken("cfg", lambda d: (d / "config.json").write_text("[1, 2]")), CheckpointError, "must be a JSON object"),
        (broken("gen", lambda d: (d / "generation_config.json").write_text('{"threshold": "0.5"}')), CheckpointError,
         r"generation_config.json: threshold must be a finite number, got '0.5'"),
        (broken("gen2", lambda d: (d / "generation_config.json").write_text('{"block_size": true}')), CheckpointError,
         "block_size must be an integer or null"),
        (broken("tokcfg", lambda d: ((d / "chat_template.jinja").unlink(), (d / "tokenizer_config.json").write_text("[]"))),
         TokenizerError, "must hold a JSON object"),
        (broken("mask", lambda d: (d / "config.json").write_text(
            (d / "config.json").read_text().replace(f'"mask_token_id": {tok.mask_token_id}', '"mask_token_id": 300'))),
         CheckpointError, "mask_token_id 300 is not the tokenizer's mask token"),
        (broken("tie", lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace(
            '"tie_word_embeddings": false', '"tie_word_embeddings": true'))), CheckpointError,
         "an lm_head.weight of its own, which would be dropped"),
    ]
    for directory, error, message in cases:
        with pytest.raises(error, match=message):
            load_for_generation(directory)
    with pytest.raises(CheckpointError, match="model.safetensors is a file, not a checkpoint directory"):
        load_checkpoint(good / "model.safetensors")
    index = broken("index", lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'))
    with pytest.raises(CheckpointError, match="weight_map must map tensor names"):
        load_checkpoint(index)
    template = broken("tpl", lambda d: (d / "chat_template.jinja").write_text("{{ 1 // 0 }}"))
    with pytest.raises(ValueError, match="chat template failed: ZeroDivisionError"):
        Tokenizer.load(template).apply_chat_template([{"role": "user", "content": "hi"}])
    # export then convert: the mask is the tokenizer's mask token again (it was the last vocabulary row)
    assert cli_main(["export", str(good), str(tmp_path / "plain"), "--causal"]) == 0
    assert cli_main(["convert", str(tmp_path / "plain"), str(tmp_path / "again")]) == 0
    assert load_checkpoint(tmp_path / "again").config.mask_token_id == tok.mask_token_id
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 8}))
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight is \(512, 64\), config.json says \(520, 64\)"):
        convert_transformers_checkpoint(tmp_path / "plain", tmp_path / "bad")


@pytest.mark.parametrize("data,message", [
    ([1, 2], "must be a JSON object"), ({"text_config": 3}, "text_config must be an object"),
    ({"rope_parameters": [1]}, "rope_parameters must be an object"),
    ({"full_attention_interval": "x"}, "full_attention_interval must be a positive integer"),
    ({"num_hidden_layers": "x", "full_attention_interval": 4}, "num_hidden_layers must be a positive integer"),
])
def test_config_json_of_the_wrong_shape_is_a_config_error(data, message):
    with pytest.raises(ConfigError, match=message):
        CloverConfig.from_dict(data)


def test_uneven_per_expert_tensors_and_ordinary_eos_ids_are_refused(tmp_path):
    experts = {f"model.layers.0.mlp.experts.{e}.{k}.weight": torch.zeros(4 + e, 8)
               for e in range(2) for k in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(CheckpointError, match="per-expert tensors differ in shape"):
        sanitize_transformers(experts)
    from clover.model.checkpoint import load_for_generation
    from clover.model.tokenizer import Tokenizer, stdlib_texts

    tok = Tokenizer.train(list(stdlib_texts())[:20], vocab_size=512)
    plain = tok.encode("def")[0]   # an ordinary token as end-of-sequence: decoding would stop at it
    model = CloverForCausalLM.from_scratch(CloverConfig.preset(
        "debug", mask_token_id=tok.mask_token_id, eos_token_id=[plain]), seed=0)
    save_checkpoint(model, tmp_path / "m", extra_files=tok.files())
    with pytest.raises(CheckpointError, match=rf"eos_token_id holds \[{plain}\], not special tokens"):
        load_for_generation(str(tmp_path / "m"))


def test_hostile_checkpoint_files_are_one_error_naming_them_and_read_nothing_large(tmp_path, debug_model, monkeypatch):
    """Found by a hostile pass on checkpoints (session 54): JSON nested 200,000 deep was a RecursionError traceback
    (config, generation config, index, tokenizer config); a settings file of gigabytes (sparse on disk) was read
    whole (MemoryError); a stray tensor of gigabytes was read and cast before its name was refused; a float8 head
    loaded (and a mixed checkpoint took the dtype of its first tensor); a tensor in two shards came silently from
    the last; a config with no end-of-sequence id decoded past <|im_end|>; 1,020 missing layers' names made an
    888 KB message; a `*` in a missing directory's name globbed another model's leftover copy."""
    from clover.model import checkpoint as ck
    from clover.model.checkpoint import load_for_generation
    from clover.model.tokenizer import Tokenizer, TokenizerError, stdlib_texts

    tok = Tokenizer.train(list(stdlib_texts())[:20], vocab_size=debug_model.config.vocab_size)
    model = CloverForCausalLM.from_scratch(CloverConfig.preset(
        "debug", mask_token_id=tok.mask_token_id, eos_token_id=tok.eos_token_ids), seed=0)
    good = tmp_path / "good"
    save_checkpoint(model, good, extra_files=tok.files())

    def copy(name):
        d = tmp_path / name
        shutil.copytree(good, d)
        return d

    deep = "[" * 200_000 + "]" * 200_000
    for name, error in (("config.json", CheckpointError), ("generation_config.json", CheckpointError)):
        d = copy("deep-" + name)
        (d / name).write_text(deep)
        with pytest.raises(error, match=f"{name} is not valid JSON: nested too deeply"):
            load_for_generation(str(d))
    d = copy("deep-tokcfg")
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(deep)
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON: nested too deeply"):
        Tokenizer.load(d)
    d = copy("huge")
    with open(d / "config.json", "r+b") as f:   # 100 MiB, sparse: nothing is written to the disk
        f.truncate(100 * 2**20)
    with pytest.raises(CheckpointError, match=r"config.json is 100 MiB; a file of this kind is at most 64 MiB"):
        load_checkpoint(d)

    # tensors: checked by name, shape and dtype from the headers before any is read
    tensors = load_file(str(good / "model.safetensors"))
    d = copy("stray")
    save_file({**tensors, "zz.junk": torch.zeros(2**20)}, str(d / "model.safetensors"))
    monkeypatch.setattr(ck, "iter_tensors", lambda *a: pytest.fail("tensor data read before the names were checked"))
    with pytest.raises(CheckpointError, match="unexpected tensors: zz.junk"):
        load_checkpoint(d)
    d = copy("f8")
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"].to(torch.float8_e4m3fn)},
              str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"floating dtype Clover does not run .*: lm_head.weight \(F8_E4M3\)"):
        load_checkpoint(d)
    d = copy("layers")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 64, "layer_types": None}))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(d)
    assert "missing tensors:" in str(info.value) and "in all)" in str(info.value) and len(str(info.value)) < 2000
    monkeypatch.undo()
    d = copy("mixed")
    save_file({**tensors, "lm_head.weight": tensors["lm_head.weight"].half()}, str(d / "model.safetensors"))
    assert load_checkpoint(d).dtype == torch.float32   # (the dtype of most of the parameters, not of the first)
    d = copy("shards")
    save_checkpoint(model, d, max_shard_bytes=200_000, extra_files=tok.files())
    holder = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    other = next(p for p in sorted(d.glob("model-*.safetensors")) if p.name != holder)   # a zero head there too
    save_file({**load_file(str(other)), "lm_head.weight": torch.zeros_like(tensors["lm_head.weight"])}, str(other))
    with pytest.raises(CheckpointError, match=r"tensor lm_head.weight is in both model-"):
        load_checkpoint(d)
    d = copy("noeos")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": []}))
    with pytest.raises(CheckpointError, match="config.json has no eos_token_id"):
        load_for_generation(str(d))
    shutil.copytree(good, tmp_path / ".other.old-1")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "*")


def test_a_chat_template_is_held_to_a_budget():
    """Found by a hostile pass on checkpoints (session 54): two nested loops over range(100000) hung `clover chat`,
    and `'x' * 10**10` or a loop printing 10 GB ended it with MemoryError; a template that rendered nothing was
    reported as an empty prompt the user gave. Each is now a ChatFormatError naming the template."""
    from clover.model.chat import ChatFormatError, render_chat

    hi = [{"role": "user", "content": "hi"}]
    for template, message in [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop steps"),
        ("{{ 'x' * 10**10 }}", "repetition"), ("{{ 2 ** 100000 }}", "power"),
        ("{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}", "characters of output"),
        ("{% if false %}x{% endif %}", "rendered nothing"),
    ]:
        with pytest.raises(ChatFormatError, match=f"chat template failed: .*{message}"):
            render_chat(template, hi)
    assert render_chat("{{ range(5)|length }}{{ range(9)[3] }}{% for i in range(2) %}{{ loop.length }}{% endfor %}",
                       hi) == "5322"


def test_named_chat_templates_and_disagreeing_special_ids_in_the_settings(tmp_path, caplog):
    """Found by a hostile pass on checkpoints (session 54): a `chat_template` given as transformers' list of named
    templates fell back to Clover's own without a word; generation_config.json's eos / mask ids that differ from
    config.json's were ignored silently (config.json's are used: now a warning says so)."""
    from clover.model.checkpoint import load_for_generation
    from clover.model.tokenizer import Tokenizer, TokenizerError

    shipped = Path(load_for_generation(None).directory)
    d = tmp_path / "m"
    shutil.copytree(shipped, d)
    (d / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ messages[0].content }}!"}]
    (d / "tokenizer_config.json").write_text(json.dumps({**json.loads((d / "tokenizer_config.json").read_text()),
                                                         "chat_template": named}))
    assert Tokenizer.load(d).chat_template == "{{ messages[0].content }}!"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(TokenizerError, match="none of them named 'default'"):
        Tokenizer.load(d)
    shutil.rmtree(d)
    shutil.copytree(shipped, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [5], "mask_token_id": 9}))
    with caplog.at_level("WARNING", logger="clover.model.checkpoint"):
        load_for_generation(str(d))
    assert "generation_config.json's eos_token_id [5] differs from config.json's [0, 2]" in caplog.text
    assert "mask_token_id" not in caplog.text


def test_convert_gives_a_tokenizer_without_a_mask_token_one_at_an_unused_row(tmp_path, capsys):
    """A source tokenizer without `<|mask|>` (Qwen's) gets it at the mask token id (found by a hostile pass: the
    conversion succeeded, then every command refused the checkpoint); an id that is one of its tokens is refused
    (an ordinary token, or its end of turn, would be the mask), as is a tokenizer lacking the chat format's tokens."""
    tok_json = json.loads((SHIPPED / "tokenizer.json").read_text())
    tok_json["added_tokens"] = [t for t in tok_json["added_tokens"] if t["content"] != "<|mask|>"]
    del tok_json["model"]["vocab"]["<|mask|>"]                 # row 9 is now no token's: a foreign tokenizer
    _transformers_checkpoint(tmp_path, CloverConfig.preset("debug", vocab_size=8192, mask_token_id=9, eos_token_id=[0, 2]))
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tok_json))
    cfg = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**cfg, "added_tokens_decoder": {}}))
    from clover.model.tokenizer import Tokenizer, TokenizerError

    with pytest.raises(TokenizerError, match=r"lacks the special token\(s\) \['<\|mask\|>'\]"):
        Tokenizer.load(tmp_path / "hf")
    # the source's config (a transformers one) has no mask id: the last row, here a token of the tokenizer
    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "last")]) == 1
    assert "the mask token id 8191 is its token" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "ok"), "--mask-token-id", "9"]) == 0
    loaded = load_for_generation(str(tmp_path / "ok"))
    assert loaded.tokenizer.mask_token_id == 9 and loaded.tokenizer.encode("a<|mask|>")[-1] == 9
    assert json.loads((tmp_path / "ok" / "tokenizer_config.json").read_text())["added_tokens_decoder"]["9"]["special"]
    for bad, what in (("100", "its token"), ("3", "'<think>'")):
        assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / f"bad{bad}"), "--mask-token-id", bad]) == 1
        err = capsys.readouterr().err
        assert "has no <|mask|> token, and the mask token id" in err and what in err, err
        assert not (tmp_path / f"bad{bad}").exists()
    tok_json["added_tokens"] = [t for t in tok_json["added_tokens"] if t["content"] != "<think>"]
    del tok_json["model"]["vocab"]["<think>"]
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(tok_json))
    assert cli_main(["convert", str(tmp_path / "hf"), str(tmp_path / "nothink"), "--mask-token-id", "9"]) == 1
    assert "lacks ['<think>'] of Clover's chat format" in capsys.readouterr().err
