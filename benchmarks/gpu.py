"""One CUDA device: MFU of a 1B Llama in bf16 with torch.compile off and on, and the
planner's peak-memory prediction against torch.cuda.max_memory_allocated for a few layouts.

    python benchmarks/gpu.py            # on a GPU machine: appends a section to BENCHMARKS.md
    python benchmarks/gpu.py --dry-run  # the same code on the CPU with the tiny model (seconds)

Every run is llmsplit's real trainer (`train_worker`, one rank, in this process, so no
start-up per layout). MFU = tokens/s × the planner's training FLOPs per token
(6 × matmul parameters + 12·L·d·s attention, plan/cost.py) ÷ the device's bf16 peak from
the planner's catalogue (plan/hardware.py). The memory check is `plan_check` in the run's
summary.json: the planner's predicted peak (less the CUDA context and NCCL buffers, which
max_memory_allocated does not see) against the measured one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3  # the compiled runs compile during the first steps


def layouts(dry: bool) -> list[dict]:
    """(name, --set items): the first two give MFU (compile off/on), all give memory."""
    mb = 1 if dry else 2
    return [{"name": "compile off", "ckpt": "none", "mb": mb, "compile": False},
            {"name": "compile on", "ckpt": "none", "mb": mb, "compile": True},
            {"name": "selective", "ckpt": "selective", "mb": mb, "compile": False},
            {"name": "full", "ckpt": "full", "mb": mb, "compile": False},
            {"name": "full, 2× micro-batch", "ckpt": "full", "mb": 2 * mb, "compile": False}]


def run_one(lay: dict, dry: bool, run_dir: Path) -> dict:
    import torch

    from llmsplit.config import load_config, model_config, record_model_sizes, to_toml, validate
    from llmsplit.diagnose.plan_check import check_run
    from llmsplit.io.tokenizer import load_tokenizer
    from llmsplit.launch import free_port
    from llmsplit.plan.cost import model_flops_per_token
    from llmsplit.diagnose.probe import local_device
    from llmsplit.train.trainer import train_worker

    steps = WARMUP + (2 if dry else 5)
    seq = 64 if dry else 2048
    sets = [f"model.preset={'tiny' if dry else 'llama-3.2-1b'}", f"data.seq_len={seq}", f"model.max_seq_len={seq}",
            f"train.precision={'fp32' if dry else 'bf16'}", f"train.global_batch={2 * lay['mb']}",
            f"train.micro_batch={lay['mb']}", f"train.steps={steps}", "train.warmup_steps=1", "checkpoint.every=0",
            f"train.compile={str(lay['compile']).lower()}", f"memory.activation_checkpoint={lay['ckpt']}",
            "parallel.dp=1"]
    cfg = load_config(None, sets)
    model_cfg = model_config(cfg, load_tokenizer(cfg.data.tokenizer).vocab_size)
    validate(cfg, 1, model_cfg, load_tokenizer(cfg.data.tokenizer).vocab_size)
    record_model_sizes(cfg, model_cfg)
    # A one-rank "torchrun" environment for this process only while the run lasts: left behind,
    # it would make every later llmsplit command started from this process (the test suite's)
    # believe it runs under torchrun.
    launch_env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    saved = {k: os.environ.get(k) for k in launch_env}
    os.environ.update(launch_env)
    try:
        train_worker(to_toml(cfg), str(run_dir))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    device = local_device(1)
    check = check_run(run_dir, cfg, model_cfg, 1, device)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = cfg.train.global_batch * seq / statistics.median(r["step_time_s"] for r in rows[WARMUP:])
    precision = cfg.train.precision
    mfu = tps * model_flops_per_token(model_cfg, seq) / device.flops(precision)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {**lay, "params": model_cfg.num_params(), "seq_len": seq, "device": device.name, "tokens_per_s": tps,
            "mfu": mfu, "precision": precision, "predicted_peak": check["predicted_peak_bytes"],
            "measured_peak": check["measured_peak_bytes"], "loss": rows[-1]["loss"]}


def to_markdown(results: list[dict], machine: str) -> list[str]:
    r0 = results[0]
    lines = [f"### One GPU: MFU and planner memory error ({r0['device']})", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC on {machine}. Command: "
             f"`python benchmarks/gpu.py`. Model: {r0['params'] / 1e9:.2f}B-parameter Llama (llama-3.2-1b preset), "
             f"{r0['precision']}, sequence {r0['seq_len']}, one rank, median over the steps after {WARMUP}.",
             "", "| layout | micro-batch | tokens/s | MFU | predicted peak | measured peak | error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        err = r["predicted_peak"] / r["measured_peak"] - 1
        lines.append(f"| {r['name']} (checkpointing {r['ckpt']}) | {r['mb']} | {r['tokens_per_s']:.0f} | "
                     f"{100 * r['mfu']:.3g}% | {r['predicted_peak'] / 2**30:.2f} GiB | "
                     f"{r['measured_peak'] / 2**30:.2f} GiB | {100 * err:+.1f}% |")
    lines += ["", "MFU counts 6 × matmul parameters + 12·L·d·s attention FLOPs per token against the catalogue's "
                  "dense bf16 peak; error = predicted / measured − 1 (max_memory_allocated).", ""]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU, nothing appended")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="report to append to (default BENCHMARKS.md)")
    args = ap.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; run it on a GPU machine, or pass --dry-run for the CPU "
              "smoke test", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, lay in enumerate(layouts(args.dry_run)):
            if args.dry_run and (lay["compile"] or i > 2):
                continue  # the smoke test: inductor's C++ build alone takes a minute on a CPU
            results.append(run_one(lay, args.dry_run, Path(tmp) / f"run{i}"))
            r = results[-1]
            print(f"{r['name']}: {r['tokens_per_s']:.0f} tokens/s, MFU {100 * r['mfu']:.3g}%, peak predicted "
                  f"{r['predicted_peak'] / 2**20:.0f} MiB, measured {r['measured_peak'] / 2**20:.0f} MiB",
                  file=sys.stderr, flush=True)
    import platform

    where = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    text = "\n".join(to_markdown(results, f"{where}; Python {platform.python_version()}, torch {torch.__version__}"))
    print(text)
    if not args.dry_run:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
