"""The `clover` command: init, info, check (conversion is tested with the checkpoints)."""

import json
import subprocess
import sys

import torch

from clover.cli import main as cli_main
from clover.model import CloverForCausalLM


def test_init_info_check(tmp_path, capsys):
    d = str(tmp_path / "m")
    assert cli_main(["init", d, "--preset", "debug", "--override", '{"block_size": 4}']) == 0
    capsys.readouterr()
    assert cli_main(["info", d]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["block_size"] == 4 and info["layers"] == {"full_attention": 1, "linear_attention": 3}
    assert info["parameters_total"] == 359488 and "parameters_from_config" not in info  # formula == real count
    assert cli_main(["check", d, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["errors"]["noisy_stream_vs_preview"] < 1e-5


def test_check_fails_when_preview_breaks_the_invariant(tmp_path, capsys, monkeypatch):
    d = str(tmp_path / "m")
    cli_main(["init", d, "--preset", "debug"])
    real = CloverForCausalLM.preview
    monkeypatch.setattr(CloverForCausalLM, "preview", lambda self, *a, **k: real(self, *a, **k) + 1e-2)
    assert cli_main(["check", d]) == 2
    assert "INVARIANT VIOLATED" in capsys.readouterr().out


def test_console_script_help_and_bad_preset():
    out = subprocess.run([sys.executable, "-m", "clover.cli", "convert", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "example: clover convert" in out.stdout
    out = subprocess.run([sys.executable, "-m", "clover.cli", "init", "/tmp/x", "--preset", "huge"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "invalid choice: 'huge'" in out.stderr


def test_init_refuses_the_35b_preset_without_force(tmp_path, capsys):
    assert cli_main(["init", str(tmp_path / "big"), "--preset", "clover-35b-a3b"]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert not (tmp_path / "big").exists()
    assert torch.get_default_dtype() == torch.float32
