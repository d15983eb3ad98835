"""Activation checkpointing, the memory/time trade: `memory.activation_checkpoint` none /
selective / full on one model with long sequences, where activations dominate the peak.

Each mode is a real `llmsplit train` run; the peak is each rank's (summary.json: the
process's resident high-water mark on a CPU, the allocator's peak on a GPU) and the speed
the median step time after WARMUP steps. Modes run in a rotated order each round, and
the report gives medians over rounds and ratios to "none".
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WARMUP = 2
MODES = ("none", "selective", "full")
TITLE = "Activation checkpointing: peak memory vs tokens/s (none / selective / full)"
FULL = dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1376, seq_len=512, global_batch=4, micro_batch=2)
QUICK = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, seq_len=64, global_batch=4, micro_batch=2)


def run(mode: str, shape: dict, nproc: int, steps: int, run_dir: Path) -> dict:
    sets = [f"model.{k}={shape[k]}" for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim")] + [
        f"model.max_seq_len={shape['seq_len']}", f"data.seq_len={shape['seq_len']}",
        f"train.global_batch={shape['global_batch']}", f"train.micro_batch={shape['micro_batch']}",
        f"train.steps={steps}", "train.warmup_steps=1", "train.log_every=1", "checkpoint.every=0",
        f"memory.activation_checkpoint={mode}"]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir",
                           str(run_dir), *[x for s in sets for x in ("--set", s)]], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode:  # say why (a worker killed for memory shows as a signal here)
        raise RuntimeError(f"activation_checkpoint={mode} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"tps": shape["global_batch"] * shape["seq_len"] / statistics.median(r["step_time_s"] for r in rows[WARMUP:]),
            "peak": max(r["peak_mem_bytes"] for r in summary["per_rank"]), "loss": [r["loss"] for r in rows]}


def main(quick: bool = False, rounds: int = 3, steps: int = 6, nproc: int = 2) -> dict:
    shape, modes = (QUICK, ("none", "full")) if quick else (FULL, MODES)
    if quick:  # two one-worker runs: the suite runs this on every CI job
        rounds, steps, nproc = 1, WARMUP + 1, 1
    got = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                got[mode].append(run(mode, shape, nproc, steps, Path(tmp) / f"{mode}{r}"))
            print(f"round {r + 1}: " + ", ".join(f"{m} {got[m][-1]['tps']:.0f} tokens/s, "
                                                 f"{got[m][-1]['peak'] / 2**20:.0f} MiB" for m in modes),
                  file=sys.stderr)
    out = {"shape": shape, "nproc": nproc, "steps": steps, "rounds": rounds, "modes": {}}
    for m in modes:
        out["modes"][m] = {"tokens_per_s": statistics.median(x["tps"] for x in got[m]),
                           "peak_bytes": statistics.median(x["peak"] for x in got[m]),
                           "per_round_tps": [x["tps"] for x in got[m]]}
    # Checkpointing recomputes, it does not change the math: the losses must agree.
    out["max_loss_diff"] = max(abs(a - b) for m in modes for a, b in zip(got[m][0]["loss"], got["none"][0]["loss"]))
    return out


def to_markdown(r: dict) -> list[str]:
    s, none = r["shape"], r["modes"]["none"]
    lines = [f"{s['n_layers']} layers, dim {s['dim']}, sequence {s['seq_len']}, global batch {s['global_batch']} "
             f"(micro-batch {s['micro_batch']}), {r['nproc']} CPU workers, fp32. Peak: the highest rank's resident "
             f"high-water mark (includes the ~0.3 GiB process baseline). Median of {r['rounds']} rounds, steps "
             f"{WARMUP + 1}..{r['steps']}. Largest loss difference to \"none\": {r['max_loss_diff']:.2e}.",
             "", "| activation_checkpoint | peak MiB / rank | × none | tokens/s | × none |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for m, v in r["modes"].items():
        lines.append(f"| {m} | {v['peak_bytes'] / 2**20:.0f} | {v['peak_bytes'] / none['peak_bytes']:.2f} | "
                     f"{v['tokens_per_s']:.0f} | {v['tokens_per_s'] / none['tokens_per_s']:.2f} |")
    return lines


def plot(r: dict, out_dir: Path) -> list[Path]:
    from .plots import bars

    modes = list(r["modes"])
    return [bars(Path(out_dir) / "checkpointing.png", "Activation checkpointing: memory vs speed "
                 f"({r['shape']['n_layers']} layers, dim {r['shape']['dim']}, seq {r['shape']['seq_len']})", modes,
                 [("peak MiB per rank", [r["modes"][m]["peak_bytes"] / 2**20 for m in modes]),
                  ("tokens/s", [r["modes"][m]["tokens_per_s"] for m in modes])])]
