"""Tensor and pipeline parallel on CPU workers, next to DDP and zero 3, and the pipeline
bubble each schedule leaves against its theoretical figure.

Every row is one `llmsplit train` run through the command line; tokens/s is the median
over the steps after the first (which pays for warm-up and pipeline shape inference), and
the per-rank peak memory and the bubble are what the run wrote to summary.json (the median
over the steps after the first of each step's bubble, against the schedule's own figure).
The bubble sweep uses the throughput table's ~100M model with longer micro-batches (4 × 256
tokens), so that a stage's forward takes 0.3–0.7 s next to the runtime's fraction of a
millisecond per message.

`python -m benchmarks.model_parallel [--quick]` runs it alone and draws
docs/img/bubble.png; `python -m benchmarks model_parallel` includes it in the report.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TITLE = "Model parallel: tensor and pipeline parallel vs DDP and zero 3, and the pipeline bubble"
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev")

# ~101M parameters (16 × 6.3M per layer); 4 kv heads, so tp 4 needs no replication. A small
# batch (4 × 32 tokens) keeps a step within seconds on 2 shared cores: enough to compare
# layouts, not a throughput-optimal setting.
BIG = ["model.dim=768", "model.n_layers=16", "model.n_heads=12", "model.n_kv_heads=4", "model.ffn_dim=2048",
       "data.seq_len=32", "train.global_batch=4", "train.micro_batch=1"]
# The bubble sweep: the same ~101M model, micro-batches of 4 × 256 tokens. What the
# pipeline runtime costs per action (a gloo send or receive, the schedule's Python) is
# nearly fixed, so it is a smaller share of an action of 1024 tokens than of 256: at 256
# (2 × 128) it was ~0.7% of the step, against bubbles of 3-5% for the V schedules at m=8.
SWEEP_MICRO_BATCH = 4
SWEEP = [*BIG[:5], "data.seq_len=256", f"train.micro_batch={SWEEP_MICRO_BATCH}"]
SWEEP_STEPS = 8  # the first is warm-up; the bubble is the median of the other seven
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "data.seq_len=32", "train.micro_batch=2"]

THROUGHPUT = [  # (label, workers, settings)
    ("DDP", 2, []),
    ("zero 3", 2, ["parallel.zero=3"]),
    ("tp 2", 2, ["parallel.tp=2"]),
    *[(f"pp 2 {s}", 2, ["parallel.pp=2", f"parallel.pp_schedule={s}"]
       + (["parallel.pp_virtual_stages=2"] if s == "interleaved_1f1b" else [])) for s in SCHEDULES],
    ("DDP", 4, []),
    ("zero 3", 4, ["parallel.zero=3"]),
    ("tp 4", 4, ["parallel.tp=4"]),
    ("tp 2 × pp 2 (1f1b)", 4, ["parallel.tp=2", "parallel.pp=2"]),
]


def _schedule_sets(schedule: str) -> list[str]:
    extra = ["parallel.pp_virtual_stages=2"] if schedule == "interleaved_1f1b" else []
    return ["parallel.pp=2", f"parallel.pp_schedule={schedule}", *extra]


def run(run_dir: Path, nproc: int, sets: list[str], steps: int) -> dict:
    """One training run; what summary.json and metrics.jsonl say about it."""
    # One thread per worker: more would oversubscribe the cores and time the contention.
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))
    args = [a for s in (*sets, f"train.steps={steps}", "train.warmup_steps=1", "checkpoint.every=0")
            for a in ("--set", s)]
    proc = subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir",
                           str(run_dir), *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"llmsplit train {' '.join(sets)} failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return {"tokens_per_s": statistics.median(tps[1:] or tps),
            "peak_per_rank_mib": [r["peak_mem_bytes"] / 2**20 for r in summary["per_rank"]],
            "param_per_rank_mib": [r["param_bytes"] / 2**20 for r in summary["per_rank"]],
            "params": summary["params"], "pipeline": summary.get("pipeline")}


def main(quick: bool = False, parts: tuple[str, ...] = ("throughput", "bubble")) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if quick:  # one tiny pipeline run: the code path, not a measurement
            throughput, ms, model = [("pp 2 1f1b", 2, _schedule_sets("1f1b"))], [], TINY
            sweep, steps, mb = [("1f1b", 2)], 2, 2
        else:
            throughput, ms, model, steps, mb = THROUGHPUT, [2, 4, 8], SWEEP, SWEEP_STEPS, SWEEP_MICRO_BATCH
            # DualPipeV runs 2 stages per rank and needs m >= 2p micro-batches (refused below).
            sweep = [(s, m) for m in ms for s in SCHEDULES if not (s == "dualpipev" and m < 4)] \
                if "bubble" in parts else []
            throughput = throughput if "throughput" in parts else []
        table = []
        for i, (label, nproc, sets) in enumerate(throughput if not quick else []):
            r = run(tmp / f"t{i}", nproc, [*BIG, *sets], steps=3)
            table.append({"label": label, "workers": nproc, **r})
            print(f"{label} ({nproc} workers): {r['tokens_per_s']:.0f} tokens/s, peak "
                  f"{max(r['peak_per_rank_mib']):.0f} MiB", file=sys.stderr)
        bubbles = []
        for i, (schedule, m) in enumerate(sweep):
            r = run(tmp / f"b{i}", 2, [*model, *_schedule_sets(schedule), f"train.global_batch={m * mb}"], steps)
            p = r["pipeline"]
            bubbles.append({"schedule": schedule, "m": m, "measured": p["measured_bubble"],
                            "theory": p["theoretical_bubble"], "formula": p["formula_bubble"],
                            "theory_per_step": p["theoretical_bubble_per_step"],
                            "median_cost": p["median_cost_bubble"],
                            "unit": p["unit_cost_bubble"], "action_seconds": p["action_seconds"],
                            "per_step": p["measured_bubble_per_step"], "busy_per_rank": p["busy_fraction_per_rank"],
                            "tokens_per_s": r["tokens_per_s"]})
            print(f"bubble {schedule} m={m}: measured {p['measured_bubble']:.3f} theory "
                  f"{p['theoretical_bubble']:.3f}", file=sys.stderr)
    return {"quick": quick, "throughput": table, "bubbles": bubbles, "bubble_model": model,
            "big_params": table[0]["params"] if table else None}


def to_markdown(r: dict) -> list[str]:
    lines = []
    if r["throughput"]:
        lines += [f"{r['big_params'] / 1e6:.0f}M-parameter model, fp32, batch 4 × 32 tokens, gloo CPU workers "
                  "(one thread each); tokens/s: median of steps 2..3; peak: summary.json's per-rank peak.", "",
                  "| layout | workers | tokens/s | peak per rank (MiB) | weights per rank (MiB) "
                  "| bubble (measured / theory) |",
                  "| --- | ---: | ---: | --- | --- | --- |"]
        for t in r["throughput"]:
            p = t["pipeline"]
            bubble = f"{p['measured_bubble']:.2f} / {p['theoretical_bubble']:.2f}" if p else ""
            lines.append(f"| {t['label']} | {t['workers']} | {t['tokens_per_s']:.0f} | "
                         f"{', '.join(f'{x:.0f}' for x in t['peak_per_rank_mib'])} | "
                         f"{', '.join(f'{x:.0f}' for x in t['param_per_rank_mib'])} | {bubble} |")
        lines.append("")
    lines += ["Pipeline bubble, pp 2. Measured: each step's 1 − busy ÷ the longest rank's step time, averaged "
              "over the ranks; the median over the steps after the first. Theory: the schedule's own order of "
              "compute actions played out with the durations they took in that step and no communication; the "
              "median over the same steps. Median costs: that order with each action's median duration over "
              "the run. Unit costs: with F = I = W = 1, B = 2. Formula: (p−1)/(v·m+p−1). Per step: measured / "
              "theory.", "",
              "| schedule | m | measured | theory | measured ÷ theory | median costs | unit costs | formula "
              "| measured ÷ formula | per step (measured / theory) | busy per rank |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for b in r["bubbles"]:
        steps = ", ".join(f"{x:.3f}/{y:.3f}" for x, y in zip(b["per_step"], b["theory_per_step"]))
        lines.append(f"| {b['schedule']} | {b['m']} | {b['measured']:.3f} | {b['theory']:.3f} | "
                     f"{b['measured'] / b['theory']:.2f} | {b['median_cost']:.3f} | {b['unit']:.3f} | "
                     f"{b['formula']:.3f} | {b['measured'] / b['formula']:.2f} | {steps} | "
                     f"{', '.join(f'{x:.2f}' for x in b['busy_per_rank'])} |")
    return lines


def plot(r: dict, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not r["bubbles"]:
        return []
    os.makedirs(folder, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, s in enumerate(dict.fromkeys(b["schedule"] for b in r["bubbles"])):
        rows = sorted((b for b in r["bubbles"] if b["schedule"] == s), key=lambda b: b["m"])
        color = f"C{i}"
        ax.plot([b["m"] for b in rows], [b["measured"] for b in rows], "o-", color=color, label=f"{s} measured")
        ax.plot([b["m"] for b in rows], [b["theory"] for b in rows], "x--", color=color, alpha=0.6,
                label=f"{s} theory")
    ax.set_xlabel("micro-batches m (pp = 2)")
    ax.set_ylabel("bubble (idle fraction)")
    ax.set_xscale("log", base=2)
    ax.set_title("Pipeline bubble: measured vs theory")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = os.path.join(folder, "bubble.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    # `--only bubble` / `--only throughput`: one half, when the machine's time is short.
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    result = main(quick=quick, parts=(only,) if only else ("throughput", "bubble"))
    out = Path(os.environ.get("MP_BENCH_OUT", "/tmp/model_parallel_bench.json"))
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(to_markdown(result)))
    if not quick and result["bubbles"]:
        print(plot(result, str(Path(__file__).parent.parent / "docs" / "img")))
