"""The README's main job: `llmsplit train` with no arguments, then `generate` from it.

The default job is 120 steps. The suite runs its first 20 steps, everything else as in the
README, in a fresh interpreter, and checks what the job does (the loss falls, a run folder
that `generate` reads); how long it takes is a benchmark's question, not this test's.
README's Quickstart shows a full run."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmsplit.config import load_config

STEPS = 20


@pytest.mark.slow
def test_default_training_has_a_falling_loss_and_generates(tmp_path):
    default_steps = load_config(None, []).train.steps
    assert default_steps == 120
    proc = subprocess.run([sys.executable, "-m", "llmsplit", "train", "--set", f"train.steps={STEPS}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    assert rows[-1]["loss"] <= 0.8 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2
    out = subprocess.run([sys.executable, "-m", "llmsplit", "generate", "--model", str(run_dir), "The def statement"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and len(out.stdout.strip()) > 0, out.stderr


def test_each_quickstart_line_sets_up_the_same_venv_on_its_own():
    """Issue 22: line 2 used whatever Python the new terminal had (a dry run would have pulled
    torch 2.14 with CUDA wheels into it). Both lines now start by creating or reusing .venv,
    activating it and pinning torch; .ci/run reads line 2 from the README, so CI runs it as written."""
    root = Path(__file__).parent.parent
    block = re.search(r"## Quickstart\s+```bash\n(.*?)```", (root / "README.md").read_text(), re.S).group(1)
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2
    setup = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 "
    assert all(line.startswith(setup) for line in lines), lines
    assert lines[0].endswith('llmsplit generate --model runs/quickstart "The def statement"')
    assert lines[1].endswith("python -m pytest -q -rs")  # skips listed with their reasons
    assert "README.md" in (root / ".ci" / "run").read_text()
