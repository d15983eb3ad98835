import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


# Not in the suite's quick run (`python -m benchmarks --quick NAME` runs each alone):
# train_threads trains under a spinning neighbour (30 s of the suite's 15 minutes even in quick
# mode; its measuring loop is threads.quiet_and_loaded, which `threads` runs here),
# checkpointing (13 s: llmsplit runs alone, no peer, at activation_checkpoint none and full, which
# tests/test_zero.py runs and compares), lora_ddp (~30 s: two 2-worker launches; its helpers are
# finetune's, which runs here) and packing (~70 s on a loaded 2-core machine: three arms of
# single-process training on two length distributions).
SKIPPED = ["train_threads", "checkpointing", "lora_ddp", "packing"]
QUICK_RUN = ["ddp", "peers", "finetune", "model_parallel", "infer", "offload", "serve", "threads", "qlora"]


@pytest.mark.slow
def test_benchmark_suite_runs_end_to_end_in_quick_mode(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out), *QUICK_RUN], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "quick mode" in text and "| **ratio** |" in text


def test_the_quick_run_names_every_benchmark_but_the_skipped():
    table = (ROOT / "benchmarks" / "__main__.py").read_text().split("BENCHMARKS = {")[1].split("}")[0]
    assert sorted(QUICK_RUN + SKIPPED) == sorted(re.findall(r'"(\w+)":', table))


def test_a_baseline_that_crashes_after_writing_its_results_keeps_them_and_one_before_fails(tmp_path, capsys,
                                                                                            monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.procs import run_until_results

    out = tmp_path / "out.json"
    after = [sys.executable, "-c", f"open({str(out)!r}, 'w').write('{{}}'); import os; os.abort()"]
    with open(tmp_path / "log", "w") as log:
        assert run_until_results(after, out, env=dict(os.environ), log=log) == 0
    assert "results written, then the launcher exited" in capsys.readouterr().err
    out.unlink()
    before = [sys.executable, "-c", "raise SystemExit(1)"]
    assert run_until_results(before, out, env=dict(os.environ)) == 1


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
    # MFU is tokens/s times one constant for one model and sequence length (FLOPs per token ÷
    # the device's peak), whatever the layout: both rows give the same ratio, up to the
    # printed rounding: 3 significant digits of MFU (up to 0.5% each) and whole tokens/s, which
    # is coarse when a loaded machine trains at a few dozen tokens/s.
    (tps_a, mfu_a), (tps_b, mfu_b) = [(float(row.split("|")[3]), float(row.split("|")[4].strip(" %")))
                                      for row in rows]
    assert tps_a > 0 and tps_b > 0
    rounding = 0.011 + 0.5 / tps_a + 0.5 / tps_b
    assert mfu_a / tps_a == pytest.approx(mfu_b / tps_b, rel=rounding)
    assert not (tmp_path / "b.md").exists()  # a dry run appends nothing
    assert "RANK" not in os.environ  # the in-process run leaves no torchrun environment behind
