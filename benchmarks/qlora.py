"""`python -m benchmarks.qlora [--quick] [--model PRESET|HF_FOLDER|FILE.gguf] [--nproc N] [--zero Z]`: per-rank
peak memory of LoRA over an fp32 base against QLoRA (`lora.base=nf4`, and int8) for the same model,
layout, data and adapters, every arm `llmsplit train`. Alternating rounds; the peak is each rank's
resident peak from the start of training (VmHWM, reset right before step 1 in every arm: the
summary's per-rank `peak_mem_bytes`), which includes the ~0.3 GB every torch process holds before
any model exists and the base as held for training, but not the load (nor an fp32 copy made while
quantizing)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TITLE = "QLoRA: peak memory of LoRA over an fp32 base vs an nf4 base (both llmsplit)"
BASES = ("none", "nf4", "int8")


def run(model: str, base: str, nproc: int, zero: int, run_dir: Path, steps: int, seq_len: int) -> dict:
    source = (f"model.hf={model}" if Path(model).is_dir() else f"model.gguf={model}" if model.endswith(".gguf")
              else f"model.preset={model}")
    sets = [source, "lora.rank=16", "lora.alpha=16", f"lora.base={base}", f"train.steps={steps}",
            f"train.global_batch={nproc}", "train.micro_batch=1", f"data.seq_len={seq_len}", "train.log_every=1",
            "checkpoint.every=0", f"parallel.zero={zero}", "train.lr=1e-4"]
    subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                    *[x for s in sets for x in ("--set", s)]], check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    per_rank = summary["per_rank"]
    return {"peak": max(r["peak_mem_bytes"] for r in per_rank), "params": max(r["param_bytes"] for r in per_rank),
            "loss1": rows[0]["loss"], "step_s": statistics.median(r["step_time_s"] for r in rows),
            "n_params": summary.get("model", {}).get("params")}


def main(quick: bool = False, model: str = "llama-3.2-1b", nproc: int = 1, zero: int = 0, rounds: int = 2,
         steps: int = 2, seq_len: int = 64, bases: tuple[str, ...] = ("none", "nf4")) -> dict:
    if quick:  # the `tiny` preset: the same code paths (nf4 included) in seconds
        model, rounds = "tiny", 1
    results: dict[str, list[dict]] = {b: [] for b in bases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for base in (bases if r % 2 == 0 else bases[::-1]):
                res = run(model, base, nproc, zero, Path(tmp) / f"{base}{r}", steps, seq_len)
                results[base].append(res)
                print(f"round {r + 1} {base}: peak {res['peak'] / 2**20:.0f} MiB", file=sys.stderr)
    return {"model": model, "nproc": nproc, "zero": zero, "seq_len": seq_len, "bases": list(bases),
            "results": results, "load": Path("/proc/loadavg").read_text().split()[:3]}


def to_markdown(r: dict) -> list[str]:
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    results, bases = r["results"], r["bases"]
    lines = [f"LoRA rank 16 on every linear layer of {r['model']}, {r['nproc']} worker(s), zero {r['zero']}, "
             f"{r['nproc']} x {r['seq_len']} tokens a step, fp32 compute; load average {' '.join(r['load'])}. Every "
             "arm is llmsplit; the peak is measured from the same point in each (VmHWM reset right before step 1, "
             "after the base is loaded and quantized).", "",
             "| lora.base | peak per rank (MiB, median) | per round | parameters held (MiB) | step-1 loss | step s |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for base, rows in results.items():
        per_round = ", ".join(f"{x['peak'] / 2**20:.0f}" for x in rows)
        lines.append(f"| {base} | {med(rows, 'peak') / 2**20:.0f} | {per_round} | "
                     f"{med(rows, 'params') / 2**20:.0f} | {rows[0]['loss1']:.5f} | {med(rows, 'step_s'):.2f} |")
    lines.append("")
    lines += [f"- {base}: {med(results[base], 'peak') / med(results[bases[0]], 'peak'):.2f}x the peak of "
              f"lora.base={bases[0]}" for base in bases[1:]]
    return lines


def cli(argv) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.qlora")
    ap.add_argument("--quick", action="store_true", help="the tiny preset, one round")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--bases", default="none,nf4")
    a = ap.parse_args(argv)
    print("\n".join(to_markdown(main(a.quick, a.model, a.nproc, a.zero, a.rounds, a.steps, a.seq_len,
                                      tuple(a.bases.split(","))))))


if __name__ == "__main__":
    cli(sys.argv[1:])
