"""The planner against every run (summary.json's plan_check, a warning beyond 25%), and
`llmsplit train --auto`, which runs the layout the planner picks for the local devices."""

import json

import pytest
import torch

from helpers import TINY, train
from llmsplit.config import load_config, model_config
from llmsplit.diagnose.plan_check import compare
from llmsplit.plan.api import auto_config
from llmsplit.diagnose.probe import local_cpu, local_device
from llmsplit.plan.hardware import CATALOGUE, cpu_device


# A 2-core machine's measured numbers as diagnose.probe.measure_cpu records them.
MEASURED = {"cores": 2, "mem_total_bytes": 24 << 30, "matmul_flops_per_core": {"fp32": 1.9e11, "bf16": 1.4e12},
            "copy_bytes_per_s": 1.6e10, "loopback_bytes_per_s": 2.6e9, "baseline_process_bytes": 300 << 20}


def _summary(state, peak):
    return {"per_rank": [{"rank": 0, "param_bytes": state // 4, "grad_bytes": state // 4, "optim_bytes": state // 2,
                          "peak_mem_bytes": peak},
                         {"rank": 1, "param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1, "peak_mem_bytes": 1}]}


def _prediction(state, total):
    return {"gpu": "cpu", "model_state_bytes": state, "host_bytes_per_device": 0,
            "memory_per_device": {"total": total}}


def test_compare_takes_the_fullest_rank_and_warns_beyond_25_percent():
    cpu = cpu_device(MEASURED, 2)
    close = compare(_summary(400, 1100), _prediction(400, 1000), cpu, "none")
    assert close["measured_model_state_bytes"] == 400 and close["measured_peak_bytes"] == 1100
    assert close["ratio_peak"] == pytest.approx(1.1) and close["warnings"] == []
    off = compare(_summary(400, 1300), _prediction(400, 1000), cpu, "none")
    assert len(off["warnings"]) == 1 and "peak memory" in off["warnings"][0]


def test_compare_on_a_gpu_leaves_out_what_the_allocator_does_not_see():
    gpu = CATALOGUE["H100-80GB"]
    check = compare(_summary(400, 5000), _prediction(400, 5000 + gpu.runtime_bytes), gpu, "none")
    assert check["predicted_peak_bytes"] == 5000 and check["warnings"] == []


def test_local_device_names_the_catalogue_gpu(monkeypatch):
    class Props:
        name, total_memory = "NVIDIA H100 80GB HBM3", 85_000_000_000

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props)
    assert local_device(8).name == "H100-80GB"
    Props.name, Props.total_memory = "NVIDIA Future GPU", 100 * 2**30
    unknown = local_device(8)
    assert unknown.name == "NVIDIA Future GPU" and unknown.memory_bytes == 100 * 2**30


@pytest.mark.slow
def test_auto_runs_the_planners_layout_and_confirms_the_micro_batch_by_trial(tmp_path):
    """With memory.limit_bytes (as on a GPU) the workers try micro-batches from the
    planner's upward; under a generous limit the largest, the whole per-rank batch, fits."""
    limit = ("--set", f"memory.limit_bytes={4 << 30}")
    proc = train(tmp_path / "run", *TINY, nproc=2, extra=("--auto", *limit), timeout=240)
    cfg = load_config(None, [*TINY, f"memory.limit_bytes={4 << 30}"])
    want, best = auto_config(cfg, model_config(cfg, 258), 2, local_cpu(2))
    assert "--auto chose" in proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("dp", "zero", "tp", "pp"):
        assert summary["layout"][key] == best["layout"][key], key
    per_rank = cfg.train.global_batch // best["layout"]["dp"]
    trials = [line for line in proc.stderr.splitlines() if "--auto trial" in line]
    assert f"micro_batch={best['layout']['micro_batch']}:" in trials[0] and trials[-1].endswith("fits"), trials
    written = load_config(tmp_path / "run" / "config.toml")
    assert written.train.micro_batch == per_rank  # the trial's choice is what ran (and what a resume reads)
    assert written.memory.activation_checkpoint == best["layout"]["activation_checkpoint"]
    check = summary["plan_check"]
    for key in ("predicted_model_state_bytes", "measured_model_state_bytes", "predicted_peak_bytes",
                "measured_peak_bytes", "ratio_model_state", "ratio_peak"):
        assert check[key] > 0, key
    assert check["ratio_model_state"] == pytest.approx(1.0, rel=0.03)


def test_micro_batch_search_goes_up_from_the_prediction_and_down_when_it_does_not_fit():
    from llmsplit.train.batch_trial import candidates, search

    options = candidates(12)
    assert options == [1, 2, 3, 4, 6, 12]
    tried = []

    def fits_up_to(n):
        def fits(mb):
            tried.append(mb)
            return mb <= n
        return fits

    assert search(2, options, fits_up_to(6)) == 6 and tried == [2, 3, 4, 6, 12]
    tried.clear()
    assert search(6, options, fits_up_to(3)) == 3 and tried == [6, 4, 3]
    tried.clear()
    assert search(12, options, fits_up_to(12)) == 12 and tried == [12]
    assert search(4, options, fits_up_to(0)) is None
