"""scripts/model_card.py: the card of released weights can be written again from their training record once
the runs are gone, and what comes from a record rather than from this build's files is marked."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "clover" / "weights" / "clover-tiny"


def _card(runs: Path, model: Path) -> str:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "model_card.py"), str(runs), str(model),
                    str(runs / "no-report"), str(runs / "no-sweep.json")], check=True, capture_output=True)
    return (model / "README.md").read_text()


def _stage_rows(card: str) -> dict[str, str]:
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| stage | steps")) + 2
    table = lines[start: next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))]
    return {line.split("|")[1].strip(): line for line in table}


def _from_the_record(tmp_path: Path) -> tuple[Path, Path]:
    """An empty runs directory and a model directory holding the shipped config and training record only."""
    model, runs = tmp_path / "model", tmp_path / "runs"
    runs.mkdir()
    model.mkdir()
    shutil.copy(SHIPPED / "config.json", model)
    shutil.copy(SHIPPED / "training_record.json", model)
    return model, runs


def test_a_card_from_the_record_alone_marks_every_carried_figure_and_keeps_the_record(tmp_path):
    model, runs = _from_the_record(tmp_path)
    record = json.loads((model / "training_record.json").read_text())
    card = _card(runs, model)
    assert set(_stage_rows(card)) == {f"{name} *" for name in record["stages"]}
    assert "## Training throughput *" in card and "## Shape sweep *" in card and "| AR parent * |" in card
    assert record["source"] in card
    level = record   # and the origins of the records it was built on, down to the first
    while level.get("base"):
        level = level["base"]
        assert level["source"] in card
    assert json.loads((model / "training_record.json").read_text()) == record   # the same, not nested


def test_a_stage_run_here_replaces_the_record_s_and_the_new_record_names_its_base(tmp_path):
    model, runs = tmp_path / "model", tmp_path / "runs"
    (runs / "sft2").mkdir(parents=True)
    model.mkdir()
    shutil.copy(SHIPPED / "config.json", model)
    shutil.copy(SHIPPED / "training_record.json", runs / "base_record.json")
    (runs / "sft2" / "train_config.json").write_text(json.dumps({"steps": 20, "batch_size": 2, "seq_len": 64}))
    (runs / "sft2" / "log.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"kind": "train", "step": 10, "tokens_seen": 1280, "tokens_per_s": 64.0, "loss": 2.5},
        {"kind": "train", "step": 20, "tokens_seen": 2560, "tokens_per_s": 64.0, "loss": 1.25},
        {"kind": "eval", "step": 20, "diffusion_loss": 3.5}]) + "\n")
    rows = _stage_rows(_card(runs, model))
    assert "sft2" in rows and "sft2 *" not in rows and "ar *" in rows
    assert "| 20 | 2 x 64 |" in rows["sft2"] and "| 1.250 | 3.500 |" in rows["sft2"]
    new = json.loads((model / "training_record.json").read_text())
    base = json.loads((runs / "base_record.json").read_text())
    assert new["stages"]["sft2"]["seconds"] == 40 and new["stages"]["ar"] == base["stages"]["ar"]
    assert new["base"]["source"] == base["source"] and "sft2" not in new["base"]["carried"]


def test_notes_and_agent_report_of_other_weights_are_refused(tmp_path):
    """Found by a review: the hand-written notes and the committed agent report are of the shipped weights, and
    a card for rebuilt weights carried both under its own tables (its code figure "met" in one place and the
    old "missed" a few lines down). Each names the weights it reads; a card for others stops and says why."""
    model, runs = tmp_path / "model", tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(SHIPPED, model)
    report = ROOT / "reports" / "agent-clover-tiny"
    card = subprocess.run([sys.executable, str(ROOT / "scripts" / "model_card.py"), str(runs), str(model), str(report),
                           str(runs / "no-sweep.json")], capture_output=True, text=True)
    assert card.returncode == 0, card.stderr
    text = (model / "README.md").read_text()
    assert "## Reading the figures" in text and "<!-- weights" not in text and "| tools | `ar` |" in text
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": config.get("rope_theta", 1e6) * 2}))
    for report_dir, what in ((report, "the agent report"), (runs / "no-report", "model_card_notes.md")):
        card = subprocess.run([sys.executable, str(ROOT / "scripts" / "model_card.py"), str(runs), str(model),
                               str(report_dir), str(runs / "no-sweep.json")], capture_output=True, text=True)
        assert card.returncode != 0 and what in card.stderr and "not these" in card.stderr, card.stderr


def test_the_card_gives_the_code_figure_without_test_documents_copied_from_training(tmp_path):
    model, runs = _from_the_record(tmp_path)
    code = {"kind": "code", "split": "test", "documents": 20, "bytes": 1000, "model_bits_per_byte": 1.45,
            "gzip9_bits_per_byte": 2.0, "xz9_bits_per_byte": 1.709, "near_copies": 4,
            "without_near_copies": {"documents": 16, "bytes": 909, "model_bits_per_byte": 1.574,
                                    "gzip9_bits_per_byte": 2.1, "xz9_bits_per_byte": 1.801}}
    (runs / "eval_bpb_final.json").write_text(json.dumps({"results": [code]}))
    card = _card(runs, model)
    assert ("The release: 15.155% below, met. Without the 4 test documents that are near-copies of a training "
            "document (9.1% of the bytes): 1.574 against xz -9's 1.801, 12.6% below.") in card


def test_validation_seed_results_are_refused(tmp_path):
    """The card gives test seeds: `clover eval tasks --split val` or an agent report run with `--split val` (a
    recipe's development figures) must not be published as the model's (found by a review, session 59)."""
    model, runs = tmp_path / "model", tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(SHIPPED, model)
    report = tmp_path / "report"
    shutil.copytree(ROOT / "reports" / "agent-clover-tiny", report)
    meta = json.loads((report / "metadata.json").read_text())
    cmd = [sys.executable, str(ROOT / "scripts" / "model_card.py"), str(runs), str(model), str(report),
           str(runs / "no-sweep.json")]
    (report / "metadata.json").write_text(json.dumps({**meta, "split": "val"}))
    card = subprocess.run(cmd, capture_output=True, text=True)
    assert card.returncode != 0 and "ran on val seeds" in card.stderr, card.stderr
    (report / "metadata.json").write_text(json.dumps({**meta, "split": "test"}))
    (runs / "eval_tasks.json").write_text(json.dumps({"evaluation": "agent_tasks", "split": "val", "runs": []}))
    card = subprocess.run(cmd, capture_output=True, text=True)
    assert card.returncode != 0 and "holds validation-seed runs" in card.stderr, card.stderr
