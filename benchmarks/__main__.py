"""`python -m benchmarks [--quick] [--out FILE] [NAME ...]`: run the side-by-side benchmarks
and write a markdown report (machine, versions, medians over alternating rounds, ratios).

`--quick` (tiny sizes, one round) is what the test suite runs so the suite cannot rot;
the full mode is run by hand and its report committed as BENCHMARKS.md.
"""

import argparse
import os
import platform
import sys
from datetime import datetime, timezone

import torch

from . import (checkpointing, ddp, finetune, infer, lora_ddp, model_parallel, offload, packing, peers_train, qlora,
               serve, threads, train_threads)
from .plots import available as can_plot

BENCHMARKS = {"ddp": ddp, "peers": peers_train, "finetune": finetune, "model_parallel": model_parallel,
              "checkpointing": checkpointing, "infer": infer, "offload": offload, "serve": serve,
              "threads": threads, "train_threads": train_threads, "lora_ddp": lora_ddp, "packing": packing,
              "qlora": qlora}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}"


def main(argv):
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("names", nargs="*", help=f"benchmarks to run (default all: {', '.join(BENCHMARKS)})")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round (used by the tests)")
    ap.add_argument("--out", default=None, help="markdown report to write (default: print only)")
    ap.add_argument("--plots", default=None, help="folder for the PNG plots (default: FILE-plots/ next to --out)")
    args = ap.parse_args(argv)
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark {unknown[0]!r}; known: {', '.join(BENCHMARKS)}")
    lines = [f"Run {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC on {machine()}"
             + (" (quick mode: not for quoting)" if args.quick else ""), ""]
    for name in names:
        mod = BENCHMARKS[name]
        result = mod.main(quick=args.quick)
        lines += [f"### {mod.TITLE}", "", f"Command: `python -m benchmarks {name}`", "", *mod.to_markdown(result), ""]
        if args.out and hasattr(mod, "plot"):  # benchmarks that plot draw next to the report
            plots = args.plots or os.path.splitext(args.out)[0] + "-plots"
            if can_plot():
                rel = lambda p: os.path.relpath(p, os.path.dirname(os.path.abspath(args.out)))  # noqa: E731
                lines += [f"![{name}]({rel(p)})" for p in mod.plot(result, plots)] + [""]
            else:
                lines += ["(plot skipped: matplotlib is missing; pip install 'llmsplit[plot]')", ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


raise SystemExit(main(sys.argv[1:]))
