"""llmsplit DDP against a plain torchrun + DDP loop: same model (tiny), batch, optimizer.

Alternates the two in A B B A order, so that drifting machine load hits both alike, and
compares the median tokens/s over the steps after the first few (warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmsplit.launch import free_port

from .procs import run_logged

WARMUP = 3
TITLE = "Training: llmsplit DDP vs a plain torchrun + DDP loop"


def _median_tps(times: list[float], tokens: int) -> float:
    return tokens / statistics.median(times[WARMUP:])


def run_plain(nproc: int, steps: int, out: Path, port: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           str(Path(__file__).with_name("plain_ddp.py")), "--steps", str(steps), "--out", str(out)]
    run_logged(cmd, out, env=env, log_path=out.with_suffix(".log"))
    data = json.loads(out.read_text())
    return _median_tps(data["step_time_s"], data["tokens_per_step"])


def run_llmsplit(nproc: int, steps: int, run_dir: Path) -> float:
    subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                    "--set", f"train.steps={steps}", "--set", "checkpoint.every=0"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return _median_tps([r["step_time_s"] for r in rows], 16 * 256)


def main(quick: bool = False, rounds: int = 4, steps: int = 25, nproc: int = 2) -> dict:
    if quick:
        rounds, steps = 1, WARMUP + 2
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(rounds):
            order = ("plain", "ours") if r % 2 == 0 else ("ours", "plain")
            for who in order:
                if who == "plain":
                    plain.append(run_plain(nproc, steps, tmp / f"plain{r}.json", free_port()))
                else:
                    ours.append(run_llmsplit(nproc, steps, tmp / f"run{r}"))
            print(f"round {r + 1}: plain DDP {plain[-1]:.0f} tokens/s, llmsplit {ours[-1]:.0f} tokens/s",
                  file=sys.stderr)
    result = {"nproc": nproc, "model": "tiny", "global_batch": 16, "seq_len": 256, "steps": steps,
              "rounds": rounds, "plain": plain, "llmsplit": ours,
              "plain_ddp_tokens_per_s": statistics.median(plain), "llmsplit_tokens_per_s": statistics.median(ours)}
    result["ratio"] = result["llmsplit_tokens_per_s"] / result["plain_ddp_tokens_per_s"]
    return result


def to_markdown(r: dict) -> list[str]:
    return [
        f"{r['model']} model, {r['nproc']} CPU workers (gloo), global batch {r['global_batch']} × {r['seq_len']} "
        f"tokens, fp32; median tokens/s over steps {WARMUP + 1}..{r['steps']}, median of {r['rounds']} rounds.",
        "",
        "| | tokens/s (median) | per round |",
        "| --- | ---: | --- |",
        f"| llmsplit train (DDP) | {r['llmsplit_tokens_per_s']:.0f} | {', '.join(f'{x:.0f}' for x in r['llmsplit'])} |",
        f"| plain torchrun + DDP | {r['plain_ddp_tokens_per_s']:.0f} | {', '.join(f'{x:.0f}' for x in r['plain'])} |",
        f"| **ratio** | **{r['ratio']:.3f}** | |",
    ]
