"""`python -m benchmarks.cp_speed [--rounds N] [--seq S]`: context parallel against data
parallel on 2 CPU workers at a sequence both fit: `parallel.cp=2` (ring, and all-to-all) splits
each sequence, dp 2 gives each worker whole sequences. The same global batch and tokens per step,
so tokens/s compares the cost of the split: the ring's sends and merges over gloo. Medians over
rounds that alternate the order; every run's losses are checked equal first. Not part of the
suite."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SKIP = 2  # first steps left out of the median (warm-up)


def run(tmp: Path, name: str, seq: int, sets: list[str]) -> tuple[float, list[float]]:
    """(median tokens/s after the warm-up, losses) of one 2-worker run."""
    folder = tmp / name
    base = [f"data.seq_len={seq}", f"model.max_seq_len={seq}", "train.global_batch=2", "train.micro_batch=1",
            "train.steps=8"]
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "2", "--run-dir", str(folder), "--overwrite"]
    for s in base + sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in rows[SKIP:]), [r["loss"] for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args(argv)
    layouts = {"dp 2": [], "cp 2 ring": ["parallel.cp=2"],
               "cp 2 alltoall": ["parallel.cp=2", "parallel.cp_mode=alltoall"]}
    speeds: dict[str, list[float]] = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(layouts) if r % 2 == 0 else list(layouts)[::-1]
            for name in order:
                tps, losses = run(Path(tmp), f"{name.replace(' ', '-')}-{r}", args.seq, layouts[name])
                speeds[name].append(tps)
                print(f"round {r + 1} {name}: {tps:.0f} tokens/s (losses {losses[0]:.4f} .. {losses[-1]:.4f}), "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
    base = statistics.median(speeds["dp 2"])
    for name, values in speeds.items():
        med = statistics.median(values)
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"{name}: median {med:.0f} tokens/s ({med / base:.2f}x dp 2); rounds {rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
