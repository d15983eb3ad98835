"""The measured CPU (diagnose/probe.py) and the pure planner that takes it as input."""

import json

import pytest

import llmsplit
from llmsplit.errors import ConfigError
from llmsplit.diagnose import probe
from llmsplit.plan.hardware import get_device

# What measure_cpu records, for a 4-core machine with 16 GiB.
MEASURED = {"cores": 4, "mem_total_bytes": 16 << 30, "matmul_flops_per_core": {"fp32": 1e11, "bf16": 4e11},
            "copy_bytes_per_s": 1e10, "loopback_bytes_per_s": 2e9, "baseline_process_bytes": 300 << 20}


def test_measurements_are_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "llmsplit" / f"cpu-{probe._machine_key()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MEASURED))
    assert probe.measure_cpu() == MEASURED
    # Two workers on this machine: each gets half the RAM and half the cores' matmul rate.
    cpu = probe.local_cpu(2)
    assert cpu.memory_bytes == 8 << 30 and cpu.flops("fp32") == 2e11 and cpu.runtime_bytes == 300 << 20


def test_the_compile_cost_is_measured_once_and_only_for_a_run_that_compiles(tmp_path, monkeypatch):
    """A cached machine without `compile_extra_bytes`: measure_cpu() leaves it as it is, and
    measure_cpu(compile=True) measures a compiled worker once (the probe's baseline with its
    layer compiled, less the baseline) and writes it to the cache for later runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "llmsplit" / f"cpu-{probe._machine_key()}.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MEASURED))
    runs = []
    monkeypatch.setattr(probe, "_baseline_process_bytes", lambda compile=False: runs.append(compile) or 400 << 20)
    assert probe.measure_cpu() == MEASURED and runs == []
    assert probe.measure_cpu(compile=True)["compile_extra_bytes"] == 100 << 20 and runs == [True]
    assert probe.measure_cpu(compile=True)["compile_extra_bytes"] == 100 << 20 and runs == [True]  # cached
    assert probe.local_cpu(2, compile=True).compile_bytes == 100 << 20
    assert json.loads(path.read_text())["compile_extra_bytes"] == 100 << 20


def test_another_python_environment_is_measured_again(monkeypatch):
    """The baseline process size depends on what `import torch` pulls in (triton when it is
    installed), so a cache written from one virtual environment is not read from another."""
    key = probe._machine_key()
    monkeypatch.setattr(probe.sys, "prefix", "/elsewhere/.venv")
    assert probe._machine_key() != key


def test_the_planner_takes_the_cpu_as_input_and_never_measures_it():
    with pytest.raises(ConfigError, match="measure_cpu"):
        get_device("cpu", 2)
    assert get_device("cpu", 4, cpu_measured=MEASURED).memory_bytes == 4 << 30


def test_llmsplit_plan_hands_the_measured_cpu_to_the_planner(monkeypatch):
    monkeypatch.setattr(probe, "measure_cpu", lambda compile=False: MEASURED)
    report = llmsplit.plan(model="tiny", gpus=2, gpu="cpu", seq_len=64, top=1)
    assert report["hardware"]["memory_bytes"] == 8 << 30
    assert report["hardware"]["runtime_bytes"] == 300 << 20
