"""The README's main job: `llmsplit train` with no arguments, then `generate` from it.

The default job is 120 steps (about a minute on 2 cores, README). The suite runs its first
20 steps, everything else as in the README, in a fresh interpreter; the whole job's time is
this run's time plus 100 more of its median steps. README's Quickstart shows a full run."""

import json
import statistics
import subprocess
import sys
import time

import pytest

from llmsplit.config import load_config

STEPS = 20


@pytest.mark.slow
def test_default_training_finishes_in_minutes_with_a_falling_loss(tmp_path):
    default_steps = load_config(None, []).train.steps
    assert default_steps == 120
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llmsplit", "train", "--set", f"train.steps={STEPS}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    assert rows[-1]["loss"] <= 0.8 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    whole_job = elapsed + (default_steps - STEPS) * statistics.median(r["step_time_s"] for r in rows)
    assert whole_job < 300, f"the main job would take {whole_job:.0f} s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    out = subprocess.run([sys.executable, "-m", "llmsplit", "generate", "--model", str(run_dir), "The def statement"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.strip()) > 0, out.stderr
