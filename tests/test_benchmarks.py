import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_benchmark_suite_runs_end_to_end_in_quick_mode(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "quick mode" in text and "| **ratio** |" in text


def _gpu_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmarks_gpu", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_script_refuses_a_machine_without_cuda_and_dry_runs_on_the_cpu(capsys, tmp_path):
    """benchmarks/gpu.py: exit 2 with one sentence without CUDA; --dry-run trains the tiny
    model in this process through the same code (the trainer, plan_check, MFU)."""
    import torch

    gpu = _gpu_script()
    if not torch.cuda.is_available():
        assert gpu.main(["--out", str(tmp_path / "b.md")]) == 2
        assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "b.md").exists()
    assert gpu.main(["--dry-run", "--out", str(tmp_path / "b.md")]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| compile off") or line.startswith("| selective")]
    assert len(rows) == 2, out
    for row in rows:
        tokens_per_s, mfu = float(row.split("|")[3]), float(row.split("|")[4].strip(" %"))
        assert tokens_per_s > 0 and 0 < mfu < 100
    assert not (tmp_path / "b.md").exists()  # a dry run appends nothing
    assert "RANK" not in os.environ  # the in-process run leaves no torchrun environment behind
