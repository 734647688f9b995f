"""scripts/recipe_walltime.py: a build's wall time less the intervals it was held stopped."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("recipe_walltime", ROOT / "scripts" / "recipe_walltime.py")
walltime = importlib.util.module_from_spec(spec)
spec.loader.exec_module(walltime)


def test_pauses_come_off_the_steps_they_fall_in_and_killed_sittings_count():
    t = walltime._time
    records = [{"step": "a", "seconds": 600, "finished": "2026-12-07T10:10:00+00:00"},
               {"step": "b", "seconds": 300, "finished": "2026-12-07T10:20:00+00:00"}]
    pauses = [(t("2026-12-07T10:05:00+00:00"), t("2026-12-07T10:06:00+00:00")),    # 60 s inside a
              (t("2026-12-07T10:09:30+00:00"), t("2026-12-07T10:16:00+00:00"))]    # 30 s of a, 60 s of b, 300 between
    killed = [(t("2026-12-07T09:00:00+00:00"), t("2026-12-07T09:30:00+00:00"))]
    assert walltime.walltime(records, pauses, killed) == [("a", 510.0), ("b", 240.0), ("killed sitting", 1800.0)]


def test_the_command_reads_times_and_pauses(tmp_path):
    (tmp_path / "times.jsonl").write_text(
        json.dumps({"step": "data build", "seconds": 120, "finished": "2026-12-07T10:02:00+00:00"}) + "\n")
    (tmp_path / "pauses.log").write_text("2026-12-07T10:01:00.500+00:00 2026-12-07T10:01:30.500+00:00\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "recipe_walltime.py"), str(tmp_path), "--pauses",
                          str(tmp_path / "pauses.log")], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1])["total_minutes"] == 1.5
