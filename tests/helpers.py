"""Shared helpers: run the real command line in a subprocess and read what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Small enough for a 2-core CI machine, big enough to exercise every code path.
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=2"]


# ~23M parameters, short sequences: model state (16 bytes a parameter under DDP) dominates
# the peak, which is what the planner and OOM tests need to see.
MEDIUM_TOML = """
[model]
preset = "tiny"
dim = 512
n_layers = 8
n_heads = 8
n_kv_heads = 4
ffn_dim = 1376
max_seq_len = 128
[data]
seq_len = 64
[train]
steps = 2
global_batch = 8
micro_batch = 2
warmup_steps = 1
"""


def run_cli(*args: str, check: bool = True, timeout: float = 300, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "llmsplit", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"llmsplit {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def train(run_dir: Path, *sets: str, nproc: int = 1, extra: tuple[str, ...] = (), **kw) -> subprocess.CompletedProcess:
    args = ["train", "--nproc", str(nproc), "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return run_cli(*args, *extra, **kw)


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_close_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: {a} vs {b} (rel {abs(a - b) / abs(b):.2e})"
