"""Training side by side: llmsplit DDP / zero 1 / zero 2 / zero 3 against DeepSpeed ZeRO-2
and ZeRO-3 and Hugging Face Accelerate (DDP), on 2 and 4 CPU workers (gloo, fp32).

Every framework trains the same model (llmsplit's Llama, ~100M parameters, weights from
the same (seed, name) init), on the same batches (llmsplit's sampler), with the same
AdamW, clipping and learning-rate schedule: their logged losses agree step for step,
which the table shows. Measured per run: tokens/s (median step time over the steps after
the warm-up) and peak memory per rank (the process's VmHWM, reset after setup and read
after the last step: the measure `llmsplit train` records; the largest rank is shown).
The runs alternate in order from round to round, and each cell is the median of the rounds.

Peers that are not installed (CI has neither DeepSpeed nor Accelerate) get a skip line;
`--quick` (the test suite) runs only llmsplit on a tiny model, one round.

Stand-alone: `python -m benchmarks.peers_train [--nproc 2 4] [--rounds R] [--only KEY ...]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmsplit.launch import free_port

from .procs import run_logged

TITLE = "Training: llmsplit DDP / ZeRO-1/2/3 vs DeepSpeed ZeRO-2/3 and Accelerate"
HERE = Path(__file__).parent

# ~101M parameters; the byte tokenizer keeps the embedding small, so nearly all of them
# are in the 16 transformer blocks (as in a real LLM).
MODEL = ["model.dim=768", "model.n_layers=16", "model.n_heads=12", "model.n_kv_heads=4", "model.ffn_dim=2048"]
QUICK_MODEL = ["model.preset=tiny"]

# key: (label, framework, stage)
RUNS = {  # in this order, each llmsplit mode next to the peer it is compared with
    "llmsplit-z2": ("llmsplit zero 2", "llmsplit", 2),
    "ds-z2": ("DeepSpeed ZeRO-2", "deepspeed", 2),
    "llmsplit-z3": ("llmsplit zero 3", "llmsplit", 3),
    "ds-z3": ("DeepSpeed ZeRO-3", "deepspeed", 3),
    "llmsplit-ddp": ("llmsplit DDP (zero 0)", "llmsplit", 0),
    "accel-ddp": ("Accelerate (DDP)", "accelerate", 0),
    "llmsplit-z1": ("llmsplit zero 1", "llmsplit", 1),
}
# The test suite's quick mode: one llmsplit mode DeepSpeed is compared with (the code path,
# not a measurement) and the peers as skip lines (CI installs neither); one tiny run.
QUICK_RUNS = ["llmsplit-z3", "ds-z2", "ds-z3", "accel-ddp"]
PAIRS = [("llmsplit-z2", "ds-z2"), ("llmsplit-z3", "ds-z3"), ("llmsplit-ddp", "accel-ddp")]
# Checked on accelerate 1.15: FSDP is enabled only for GPU-like devices; on a CPU,
# `--use_fsdp` silently trains with DDP (MULTI_CPU), so there is nothing FSDP to measure.
ACCEL_FSDP_NOTE = ("Accelerate FSDP: not run; Accelerate enables FSDP only on GPU-like devices "
                   "(on a CPU `accelerate launch --use_fsdp` trains plain DDP).")


def _settings(quick: bool, nproc: int, steps: int, global_batch: int, seq_len: int) -> list[str]:
    return [*(QUICK_MODEL if quick else MODEL), f"data.seq_len={seq_len}", f"train.global_batch={global_batch}",
            f"train.micro_batch={global_batch // nproc}", f"train.steps={steps}"]


def _env() -> dict:
    # One thread per worker: 2 and 4 workers share this machine's cores.
    threads = str(max(1, (os.cpu_count() or 1) // 4))
    return dict(os.environ, OMP_NUM_THREADS=threads, LLMSPLIT_THREADS=threads, DS_ACCELERATOR="cpu",
                PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def _run(cmd: list[str], log: Path, out: Path | None = None) -> None:
    """`out`: the results file of a peer's launcher, which may hang in teardown after
    writing it (procs.run_until_results)."""
    run_logged(cmd, out, env=_env(), log_path=log)


def run_one(key: str, nproc: int, settings: list[str], tmp: Path) -> dict:
    """One run; returns step times, losses, peak per rank (max), tokens per step."""
    _, framework, stage = RUNS[key]
    tag = f"{key}-{nproc}"
    out, log = tmp / f"{tag}.json", tmp / f"{tag}.log"
    sets = [a for s in settings for a in ("--set", s)]
    if framework == "llmsplit":
        run_dir = tmp / tag
        shutil.rmtree(run_dir, ignore_errors=True)
        _run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
              *sets, "--set", f"parallel.zero={stage}", "--set", "checkpoint.every=0"], log)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: ~1.2 GB at 100M
        # VmHWM is monotone from the reset before step 1: the last step's value (the max
        # over ranks) is the training peak, before the final checkpoint is written.
        return {"step_time_s": [r["step_time_s"] for r in rows], "loss": [r["loss"] for r in rows],
                "peak": rows[-1]["peak_mem_bytes"], "params": summary["params"],
                "tokens_per_step": _tokens(settings)}
    port = str(free_port())
    if framework == "deepspeed":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", port,
               str(HERE / "ds_train.py"), "--stage", str(stage)]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(nproc),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", port, str(HERE / "accel_train.py")]
    _run([*cmd, "--out", str(out), *sets], log, out)
    data = json.loads(out.read_text())
    return {"step_time_s": data["step_time_s"], "loss": data["loss"], "peak": max(data["peak_mem_bytes_per_rank"]),
            "tokens_per_step": data["tokens_per_step"]}


def _tokens(settings: list[str]) -> int:
    vals = dict(s.split("=", 1) for s in settings)
    return int(vals["train.global_batch"]) * int(vals["data.seq_len"])


def available(framework: str) -> bool:
    return framework == "llmsplit" or importlib.util.find_spec(framework) is not None


def main(quick: bool = False, rounds: int = 2, warmup: int = 1, steps: int = 4, nprocs=(2, 4),
         global_batch: int = 4, seq_len: int = 128, only: list[str] | None = None,
         json_path: str | None = None) -> dict:
    if quick:
        rounds, warmup, steps, nprocs, global_batch, seq_len = 1, 1, 3, (2,), 4, 64
    keys = only or (QUICK_RUNS if quick else list(RUNS))
    skipped = {}
    for key in keys:
        framework = RUNS[key][1]
        if not available(framework):
            skipped[key] = f"not installed (`pip install {framework}`)"
        elif quick and framework != "llmsplit":
            skipped[key] = "not run in quick mode"
    keys = [k for k in keys if k not in skipped]
    cells: dict[str, dict] = {}
    failed: dict[str, str] = {}
    params = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(rounds):
            for nproc in nprocs:
                settings = _settings(quick, nproc, steps, global_batch, seq_len)
                order = keys if r % 2 == 0 else keys[::-1]
                for key in order:
                    try:
                        res = run_one(key, nproc, settings, tmp)
                    except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                        # One peer failing must not lose the rest of a long table.
                        failed.setdefault(f"{key}@{nproc}", str(e).strip().splitlines()[-1][:300])
                        print(f"round {r + 1}, {nproc} workers, {RUNS[key][0]}: FAILED {e}", file=sys.stderr)
                        continue
                    params = res.get("params", params)
                    tps = res["tokens_per_step"] / statistics.median(res["step_time_s"][warmup:])
                    cell = cells.setdefault(f"{key}@{nproc}", {"tps": [], "peak": [], "loss": None})
                    cell["tps"].append(tps)
                    cell["peak"].append(res["peak"])
                    cell["loss"] = res["loss"]
                    cell.setdefault("step_time_s", []).append(res["step_time_s"])
                    if json_path:  # a long table can be read before it ends
                        Path(json_path).write_text(json.dumps({"cells": cells, "failed": failed}, indent=1))
                    print(f"round {r + 1}, {nproc} workers, {RUNS[key][0]}: {tps:.1f} tokens/s, "
                          f"peak/rank {res['peak'] / 2**20:.0f} MiB, loss {res['loss'][-1]:.5f}",
                          file=sys.stderr, flush=True)
    for cell in cells.values():
        cell["tps_median"] = statistics.median(cell["tps"])
        cell["peak_median"] = statistics.median(cell["peak"])
    if params is None:
        from llmsplit.config import load_config, model_config
        params = model_config(load_config(None, _settings(quick, 2, steps, global_batch, seq_len)), 258).num_params()
    return {"quick": quick, "rounds": rounds, "warmup": warmup, "steps": steps, "nprocs": list(nprocs),
            "global_batch": global_batch, "seq_len": seq_len, "params": params, "keys": keys,
            "skipped": skipped, "failed": failed, "cells": cells, "versions": _versions()}


def _versions() -> dict:
    out = {}
    for name in ("deepspeed", "accelerate"):
        try:
            out[name] = __import__("importlib.metadata").metadata.version(name)
        except Exception:
            pass
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def to_markdown(r: dict) -> list[str]:
    cells, nprocs = r["cells"], r["nprocs"]
    model = "tiny" if r["quick"] else "Llama (dim 768, 16 layers, 12 heads, 4 KV heads, FFN 2048, byte vocab)"
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items())
    lines = [
        f"{model}, {r['params'] / 1e6:.1f}M parameters; global batch {r['global_batch']} × {r['seq_len']} tokens "
        f"(no accumulation), fp32, AdamW, gloo, one thread per worker; tokens/s = median over steps "
        f"{r['warmup'] + 1}..{r['steps']}, peak = the largest rank's VmHWM over the training steps; "
        f"median of {r['rounds']} alternating round(s)" + (f"; {versions}." if versions else "."),
        "",
        "| | " + " | ".join(f"{n} workers: tokens/s | peak/rank MiB | final loss" for n in nprocs) + " |",
        "| --- |" + " ---: | ---: | ---: |" * len(nprocs),
    ]
    for key in r["keys"]:
        row = [RUNS[key][0]]
        for n in nprocs:
            c = cells.get(f"{key}@{n}")
            row += [f"{c['tps_median']:.1f}", _mib(c["peak_median"]), f"{c['loss'][-1]:.5f}"] if c else ["–"] * 3
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    ratios = [(a, b) for a, b in PAIRS if a in r["keys"] and b in r["keys"]]
    if ratios:
        lines += ["| llmsplit / peer | " + " | ".join(f"{n} workers: tokens/s | peak/rank" for n in nprocs) + " |",
                  "| --- |" + " ---: | ---: |" * len(nprocs)]
        for a, b in ratios:
            row = [f"{RUNS[a][0]} / {RUNS[b][0]}"]
            for n in nprocs:
                ca, cb = cells.get(f"{a}@{n}"), cells.get(f"{b}@{n}")
                row += ([f"**{ca['tps_median'] / cb['tps_median']:.3f}**", f"**{ca['peak_median'] / cb['peak_median']:.3f}**"]
                        if ca and cb else ["–", "–"])
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    for where, why in r.get("failed", {}).items():
        key, n = where.split("@")
        lines.append(f"- {RUNS[key][0]} on {n} workers: failed ({why}).")
    for key, why in r["skipped"].items():
        lines.append(f"- {RUNS[key][0]}: skipped, {why}.")
    if not r["quick"]:
        lines.append(f"- {ACCEL_FSDP_NOTE}")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peers_train")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--only", nargs="+", choices=list(RUNS))
    ap.add_argument("--json", help="also write the raw result here")
    a = ap.parse_args()
    res = main(quick=a.quick, rounds=a.rounds, warmup=a.warmup, steps=a.steps, nprocs=tuple(a.nproc), only=a.only,
               json_path=a.json and a.json + ".partial")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print("\n".join(to_markdown(res)))
