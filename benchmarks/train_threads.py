"""Training step time on a quiet and on a loaded machine, by worker count, thread count and
OpenMP wait policy (issue 23: choose the training workers' default by measurement).

`benchmarks/threads.py` measures decode, where a step is a few milliseconds of small
parallel regions and libgomp's spin-waiting collapses 2-thread runs when another process
wants the cores. A training step is mostly large GEMMs, so the same spin costs less per step;
this measures how much. Each setting is a fresh `llmsplit train` (the built-in tiny model,
the Quickstart's data) in its own process, first alone, then while the same neighbour as
`benchmarks/threads.py` runs (a 2-thread decode job with libgomp's defaults); rounds
alternate the order of the settings. The figure is the median step time of each run's steps
after the first five (start-up, first-touch allocation and the warm-up schedule excluded).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .threads import _OMP_KEYS, _source, quiet_and_loaded, summary, table

TITLE = "Training under CPU contention: workers, threads and OpenMP wait policy (tiny model)"
# (name, environment, --nproc). The first is llmsplit's default on a 2-core CPU (a worker per
# core, one thread each), the baseline of the ratios.
SETTINGS = [
    ("llmsplit default: 2 workers x 1 thread", {}, 2),
    ("1 worker x 2 threads, llmsplit default (tuned as it trains)", {}, 1),
    ("1 worker x 2 threads fixed, libgomp default (spin 300k)", {"OMP_NUM_THREADS": "2"}, 1),
    ("1 worker x 2 threads fixed, OMP_WAIT_POLICY=PASSIVE", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, 1),
    ("1 worker x 1 thread", {"OMP_NUM_THREADS": "1"}, 1),
]
SKIP_STEPS = 5


def _train_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _OMP_KEYS and k not in ("LLMSPLIT_THREADS", "LLMSPLIT_TUNE_THREADS")}
    return {**env, **extra}


def _step_time(env: dict, nproc: int, steps: int, run_dir: Path, skip: int = SKIP_STEPS) -> float:
    """Median step time (s) of one `llmsplit train` run of `steps` steps, the first `skip` left out."""
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", "checkpoint.every=0"]
    out = subprocess.run(cmd, env=_train_env(env), capture_output=True, text=True, timeout=1200,
                         cwd=Path(__file__).parent.parent)
    if out.returncode:
        raise RuntimeError(f"train failed: {out.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r][skip:]
    return statistics.median(times)


def main(quick: bool = False, rounds: int = 3, steps: int = 40, only: tuple[int, ...] | None = None) -> dict:
    """`only`: indices into SETTINGS to run (default all; the first is the ratios' baseline)."""
    # Quick (the test suite's smoke run): 3 steps, the first left out; under the neighbour's load
    # every step of a full run's warm-up costs seconds, and the suite only checks the report is made.
    rounds, steps, skip = (1, 3, 1) if quick else (rounds, steps, SKIP_STEPS)
    settings = SETTINGS[:1] if quick else [SETTINGS[i] for i in (only or range(len(SETTINGS)))]
    with tempfile.TemporaryDirectory() as tmp:
        source, _ = _source(Path(tmp), quick)
        times, loads = quiet_and_loaded(
            settings, rounds, source, 2 if quick else 8, "s/step",
            lambda setting, tag: _step_time(setting[1], setting[2], steps, Path(tmp) / f"run-{tag}", skip))
    return {"rounds": rounds, "steps": steps, "skip": skip,
            **summary(settings, times, loads, speed=lambda step_s: 1 / step_s)}


def to_markdown(r: dict) -> list[str]:
    rows = [f"`llmsplit train` on the built-in tiny model, {r['steps']} steps per run, median step time after "
            f"the first {r.get('skip', SKIP_STEPS)}; median of {r['rounds']} alternating rounds, each setting a fresh run. Loaded: "
            f"a 2-thread decode job (libgomp defaults) runs beside it. Speeds are 1 / step time. Median load "
            f"average: quiet {r['load_average']['quiet']:.1f}, loaded {r['load_average']['loaded']:.1f}.", "",
            *table(r, "ms/step", "quiet speed vs default", lambda step_s: f"{step_s * 1e3:.0f}")]
    return rows
