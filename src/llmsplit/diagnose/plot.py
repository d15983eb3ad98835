"""`llmsplit plot RUN_DIR`: PNG charts of a run's loss, tokens/s and memory per rank (and a GRPO
run's reward)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..io.run_dir import PLOTS_DIR


def _read_run(run_dir: Path) -> tuple[list[dict], dict | None]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{str(run_dir)!r} has no metrics.jsonl; pass a folder written by `llmsplit train`")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    if not rows:
        raise ConfigError(f"{str(metrics)!r} is empty; the run has not logged a step yet")
    summary_path = run_dir / "summary.json"
    return rows, json.loads(summary_path.read_text()) if summary_path.is_file() else None


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'llmsplit[plot]'") from None
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows, summary = _read_run(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    written = []
    charts = [("loss", "loss (mean over the global batch)", 1, "loss.png"),
              ("tokens_per_s", "tokens/s", 1, "tokens_per_s.png"),
              ("peak_mem_bytes", "peak memory, max over ranks (MiB)", 2**20, "memory.png")]
    if rows and "reward" in rows[0]:  # GRPO: the step's completions' mean reward
        charts.append(("reward", "mean reward of the step's completions", 1, "reward.png"))
    for key, label, scale, name in charts:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [r[key] / scale for r in rows], lw=1.5, label="training")
        held = {"loss": "eval_loss", "reward": "eval_reward"}.get(key)
        evaluated = [r for r in rows if held in r]
        if evaluated:  # the held-out figure at the steps evaluated (train.eval_every)
            last = f"last perplexity {evaluated[-1]['eval_ppl']:.3g}" if "eval_ppl" in evaluated[-1] else \
                f"last {evaluated[-1][held]:.3g}"
            ax.plot([r["step"] for r in evaluated], [r[held] for r in evaluated], "o-", lw=1.5,
                    label=f"held out ({last})")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_title(f"{run_dir.name}: {label}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    if summary and summary.get("per_rank"):
        ranks = summary["per_rank"]
        fig, ax = plt.subplots(figsize=(7, 4))
        parts = [("param_bytes", "params"), ("grad_bytes", "grads"), ("optim_bytes", "optimizer")]
        bottom = [0.0] * len(ranks)
        for key, label in parts:
            values = [r.get(key, 0) / 2**20 for r in ranks]
            ax.bar([str(r["rank"]) for r in ranks], values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.scatter([str(r["rank"]) for r in ranks], [r["peak_mem_bytes"] / 2**20 for r in ranks], color="black",
                   marker="_", s=400, label="measured peak")
        ax.set_xlabel("rank")
        ax.set_ylabel("MiB")
        ax.set_title(f"{run_dir.name}: memory per rank")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "memory_per_rank.png", dpi=100)
        plt.close(fig)
        written.append(out_dir / "memory_per_rank.png")
    return written
