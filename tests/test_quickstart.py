"""The README's main job: `llmsplit train` with no arguments, then `generate` from it."""

import json
import subprocess
import sys
import time

import pytest


@pytest.mark.slow
def test_default_training_finishes_in_minutes_with_a_falling_loss(tmp_path):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llmsplit", "train"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 120
    assert rows[-1]["loss"] <= 0.8 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert elapsed < 300, f"the main job took {elapsed:.0f} s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    out = subprocess.run([sys.executable, "-m", "llmsplit", "generate", "--model", str(run_dir), "The def statement"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.strip()) > 0, out.stderr
