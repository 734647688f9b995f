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
    args = argparse.Namespace(turns_gain=2.0, bpb_code_better=0.98, bpb_code=1.01, bpb_english=1.03, tpf=0.9,
                              match_drop=0.05)
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
    monkeypatch.setattr(scores, "turn_accuracy", lambda m, t, **s: calls.append("turns") or {"exact": 0.25, "turns": 8})
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
    for kind in ("code", "english"):
        (data / "tokens" / f"val_{kind}.bin").write_bytes(bytes(range(10)))
    first = compare.measure(str(model), str(data), out, 2, 4)
    assert sorted(calls) == ["bpb", "bpb", "match", "turns", "turns"]
    assert first["turns_train"] == 0.25 and first["lc_tpf"] == 1.1 and first["verify_tpf"] == 1.4
    calls.clear()
    assert compare.measure(str(model), str(data), out, 2, 4) == first and calls == []   # kept
    (data / "tokens" / "val_code.bin").write_bytes(bytes(range(11)))                    # other shards
    compare.measure(str(model), str(data), out, 2, 4)
    assert sorted(calls) == ["bpb", "bpb", "match"]
    calls.clear()
    (model / "model.safetensors").write_bytes(b"other weights")                         # other weights
    compare.measure(str(model), str(data), out, 2, 4)
    assert len(calls) == 5 and len(list(out.iterdir())) == 2
