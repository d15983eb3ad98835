"""llmsplit DDP against a plain torchrun + DDP loop: same model (tiny), batch, optimizer.

Alternates the two (A B A B ...) so that machine noise hits both alike, and compares the
median tokens/s over steps after the first few (warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP = 3


def _median_tps(times: list[float], tokens: int) -> float:
    return tokens / statistics.median(times[WARMUP:])


def run_plain(nproc: int, steps: int, out: Path, port: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                    "--master-port", str(port), str(Path(__file__).with_name("plain_ddp.py")),
                    "--steps", str(steps), "--out", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    return _median_tps(data["step_time_s"], data["tokens_per_step"])


def run_llmsplit(nproc: int, steps: int, run_dir: Path) -> float:
    subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                    "--set", f"train.steps={steps}", "--set", "checkpoint.every=0"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return _median_tps([r["step_time_s"] for r in rows], 16 * 256)


def main(rounds: int = 3, steps: int = 25, nproc: int = 2) -> dict:
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(rounds):
            plain.append(run_plain(nproc, steps, tmp / f"plain{r}.json", 29650 + r))
            ours.append(run_llmsplit(nproc, steps, tmp / f"run{r}"))
            print(f"round {r + 1}: plain DDP {plain[-1]:.0f} tokens/s, llmsplit {ours[-1]:.0f} tokens/s",
                  file=sys.stderr)
    result = {"nproc": nproc, "model": "tiny", "global_batch": 16, "seq_len": 256, "steps": steps,
              "plain_ddp_tokens_per_s": statistics.median(plain), "llmsplit_tokens_per_s": statistics.median(ours),
              "rounds": rounds}
    result["ratio"] = result["llmsplit_tokens_per_s"] / result["plain_ddp_tokens_per_s"]
    return result


def to_markdown(r: dict) -> str:
    return (f"| llmsplit DDP vs plain torchrun + DDP ({r['model']}, {r['nproc']} CPU workers, batch "
            f"{r['global_batch']}×{r['seq_len']}) | {r['llmsplit_tokens_per_s']:.0f} | "
            f"{r['plain_ddp_tokens_per_s']:.0f} | {r['ratio']:.3f} |")
