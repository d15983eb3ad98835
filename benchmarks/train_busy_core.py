"""`python -m benchmarks.train_busy_core [--before SRC] [--rounds N] [--steps N]`: `llmsplit
train` on the built-in tiny model beside one busy core (issue 51, item 3), the whole run timed:
a one-thread busy loop (`while True: pass`) holds a core, as another user's job would, while
the run trains; the same run on the quiet machine beside it. Where `benchmarks/train_threads`
takes the median step after the first five (the tuned state), this sums every step, the slow
ones before a worker finds its thread count included: what a user waits for.

`--before SRC`: a `src` folder of another checkout (e.g. a `git worktree` of the commit
before), run side by side with this one's, the order alternating each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
NPROCS = (2, 1)  # llmsplit's default on 2 cores (a worker per core), and one worker of 2 threads


def _run(src: Path, nproc: int, steps: int, run_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "LLMSPLIT_"))}
    env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", "checkpoint.every=0"]
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    wall = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"train failed: {out.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    said = [line for line in out.stderr.splitlines() if "other processes want" in line]
    return {"wall_s": wall, "steps_s": sum(r["step_time_s"] for r in records),
            "threads": [r.get("threads") for r in records], "said": said[0] if said else ""}


def main(before: Path | None, rounds: int, steps: int) -> dict:
    sources = {"this checkout": ROOT / "src", **({"before": before} if before else {})}
    runs = [(name, src, nproc) for nproc in NPROCS for name, src in sources.items()]
    results: dict[str, list] = {}
    loads: dict[str, list] = {"quiet": [], "loaded": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for cond in ("quiet", "loaded"):
                busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if cond == "loaded" else None
                time.sleep(2 if busy else 0)
                try:
                    for i, (name, src, nproc) in enumerate(runs if r % 2 == 0 else runs[::-1]):
                        loads[cond].append(os.getloadavg()[0])
                        got = _run(src, nproc, steps, Path(tmp) / f"{r}-{cond}-{i}")
                        results.setdefault(f"{name}|{nproc}|{cond}", []).append(got)
                        print(f"round {r + 1} {cond}: {name} --nproc {nproc}: {got['wall_s']:.1f} s whole, "
                              f"{got['steps_s']:.1f} s of steps, threads {got['threads']} (load {loads[cond][-1]:.2f})",
                              file=sys.stderr, flush=True)
                finally:
                    if busy:
                        busy.kill()
                        busy.wait()
    median = {k: {m: statistics.median(g[m] for g in v) for m in ("wall_s", "steps_s")} for k, v in results.items()}
    return {"rounds": rounds, "steps": steps, "runs": results, "median": median,
            "load_average": {c: statistics.median(v) for c, v in loads.items()}}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train_busy_core")
    ap.add_argument("--before", type=Path, help="the src folder of another checkout, run side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    result = main(args.before, args.rounds, args.steps)
    print(json.dumps(result["median"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
