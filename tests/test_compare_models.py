"""scripts/compare_models.py: the release rule applied to two models' validation figures."""

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("compare_models", ROOT / "scripts" / "compare_models.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)

BASE = {"turns_train": 0.20, "turns_heldout": 0.10, "bpb_code": 1.50, "bpb_english": 2.30,
        "lc_tpf": 1.00, "lc_match": 0.10}


def rule(**overrides: float) -> bool:
    args = compare.parser().parse_args(["candidate"])      # the defaults: the rule written for the candidate
    return compare.verdict({**BASE, **overrides}, BASE, args)[0]


@pytest.mark.parametrize(("overrides", "replace"), [
    ({}, False),                                                  # the same figures: no gain
    ({"turns_train": 0.22, "turns_heldout": 0.12}, True),         # +2 points on both pools
    ({"turns_train": 0.25, "turns_heldout": 0.119}, False),       # +1.9 on one pool
    ({"bpb_code": 1.47}, True),                                   # turns held, code bpb 0.98x
    ({"bpb_code": 1.4701, "turns_train": 0.21}, False),           # turns held, code bpb just above 0.98x
    ({"bpb_code": 1.47, "turns_heldout": 0.099}, False),          # better code, one pool lost a turn's share
    ({"turns_train": 0.3, "turns_heldout": 0.2, "bpb_code": 1.52}, False),      # code bpb 1.013x
    ({"turns_train": 0.3, "turns_heldout": 0.2, "bpb_english": 2.37}, False),   # English bpb 1.030x + a hair
    ({"turns_train": 0.3, "turns_heldout": 0.2, "lc_tpf": 0.89}, False),        # TPF below 0.9x
    ({"turns_train": 0.3, "turns_heldout": 0.2, "lc_match": 0.049}, False),     # match down more than 0.05
    ({"turns_train": 0.3, "turns_heldout": 0.2, "lc_tpf": 0.9, "lc_match": 0.05}, True),   # both at their bounds
])
def test_the_rule_replaces_only_when_every_condition_holds(overrides: dict, replace: bool) -> None:
    assert rule(**overrides) is replace


def test_figures_are_kept_per_weights_and_measured_again_when_their_inputs_change(tmp_path, monkeypatch):
    from clover.model import checkpoint
    from clover.training import scores

    calls: list[str] = []
    monkeypatch.setattr(checkpoint, "load_for_generation", lambda *a: argparse.Namespace(model=None, tokenizer=None))
    def turns(m, t, decoder=None, **s):
        calls.append("turns" if decoder is None else "turns block32")
        assert decoder is None or (decoder.algorithm, decoder.block_size, decoder.threshold) == ("low_confidence", 32, 0.95)
        return {"exact": 0.25 if decoder is None else 0.125, "turns": 8, "by_family": {"calc": {"exact": 0.5, "turns": 4}},
                "conversations": s["count"], "split": "val", "pool": s["pool"], "tpf": 1.0 if decoder is None else 2.5,
                "replies": ["a"] * 8 if decoder is None else ["a"] * 6 + ["b"] * 2}

    monkeypatch.setattr(scores, "turn_accuracy", turns)
    monkeypatch.setattr(scores, "copy_accuracy", lambda m, t, **s: calls.append("copy") or {"results": {
        "number_copied": {"accuracy": 0.9}, "other_copied": {"accuracy": 0.8}}})
    monkeypatch.setattr(scores, "bits_per_byte", lambda m, t, d, kind, split: calls.append("bpb") or {
        "kind": kind, "model_bits_per_byte": 1.5})
    monkeypatch.setattr(scores, "continuation_match", lambda *a, **k: calls.append("match") or {"results": [
        {"algorithm": "ar", "threshold": None, "match": 0.1, "tpf": 1.0},
        {"algorithm": "low_confidence", "threshold": 0.95, "match": 0.1, "tpf": 1.1},
        {"algorithm": "verify", "threshold": None, "match": 0.1, "tpf": 1.4}]})
    model, data, out = tmp_path / "model", tmp_path / "data", tmp_path / "out"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    (data / "tokens").mkdir(parents=True)
    (data / "raw" / "val").mkdir(parents=True)
    for kind in ("code", "english"):
        (data / "tokens" / f"val_{kind}.bin").write_bytes(bytes(range(10)))
        (data / "raw" / "val" / f"{kind}.jsonl").write_text('{"text": "x"}\n')
    first = compare.measure(str(model), str(data), out, 2, 4)
    assert sorted(calls) == ["bpb", "bpb", "copy", "match", "turns", "turns", "turns block32"]
    assert first["turns_train"] == 0.25 and first["lc_tpf"] == 1.1 and first["verify_tpf"] == 1.4
    assert (first["block32_turns"], first["block32_tpf"], first["block32_same_as_ar"]) \
        == (0.125, 2.5, 0.75)
    assert first["turns_heldout_by_family"] == {"calc": 0.5} and first["copy_numbers"] == 0.9

    def again() -> list[str]:
        calls.clear()
        compare.measure(str(model), str(data), out, 2, 4)
        return sorted(calls)

    assert again() == []                                                      # all kept
    (data / "tokens" / "val_english.bin").write_bytes(b"")                    # read by no figure
    assert again() == []
    (data / "tokens" / "val_code.bin").write_bytes(bytes(range(11)))          # read by no figure: prompts are
    assert again() == []                                                      # cut from the documents
    (data / "raw" / "val" / "code.jsonl").write_text('{"text": "z"}\n')      # the continuations' prompts, and
    assert again() == ["bpb", "bpb", "match"]                                 # bits per byte's documents
    (data / "raw" / "val" / "english.jsonl").write_text('{"text": "y"}\n')   # bits per byte's documents
    assert again() == ["bpb", "bpb"]
    (model / "tokenizer.json").write_text("{}")                               # the model's tokenizer
    assert len(again()) == 7
    assert again() == [] and compare.measure(str(model), str(data), out, 3, 4)["turns_train"] == 0.25
    assert sorted(calls) == ["copy", "turns", "turns", "turns block32"]       # other conversations
    (model / "model.safetensors").write_bytes(b"other weights")               # other weights: a folder of their own
    assert len(again()) == 7 and len(list(out.iterdir())) == 2


def test_missing_inputs_are_named_before_anything_is_measured(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        compare.main([str(model), "--data", str(tmp_path)])
    assert "holds no model.safetensors" in capsys.readouterr().err
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit):
        compare.main([str(model), "--data", str(tmp_path)])
    assert "code.jsonl" in capsys.readouterr().err
