"""`python -m benchmarks.checkpoint_async [--rounds N]`: how long training stands still for a
checkpoint, written synchronously against `checkpoint.async = true` (DCP's async save: the state
staged to host memory, written by a thread while training goes on), side by side on an ~85M
parameter model, rounds alternating the order. The stall is what summary.json's
`checkpoints.stall_s` counts: the seconds the step loop spent in saves (and, async, in
completing them), the end's checkpoint apart. Not part of the suite."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODEL = ["model.dim=768", "model.n_layers=12", "model.n_heads=12", "model.ffn_dim=2048", "data.seq_len=128",
         "train.global_batch=2", "train.micro_batch=2", "train.steps=7", "checkpoint.every=2", "checkpoint.keep=2"]


def stall(run: Path, asynchronous: bool) -> tuple[float, int, float]:
    """(stall seconds per checkpoint, checkpoints, median step seconds) of one run."""
    sets = MODEL + [f"checkpoint.async={str(asynchronous).lower()}"]
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--run-dir", str(run), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = json.loads((run / "summary.json").read_text())
    steps = [json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    ck = summary["checkpoints"]
    return ck["stall_s"] / ck["saved"], ck["saved"], statistics.median(steps)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    figures = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                per, n, step = stall(Path(tmp) / f"{name}{r}", name == "async")
                figures[name].append(per)
                print(f"round {r + 1} {name}: {per:.3f} s stall per checkpoint ({n} saved), median step {step:.2f} s, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    med = {k: statistics.median(v) for k, v in figures.items()}
    print(f"median stall per checkpoint: sync {med['sync']:.3f} s, async {med['async']:.3f} s, "
          f"ratio {med['async'] / med['sync']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
