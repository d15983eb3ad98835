"""The one plotting helper of the benchmark suite: bar panels side by side, or lines of a
value against a swept size, one PNG.

A benchmark that plots defines `plot(result, out_dir) -> list[Path]` and draws with
`bars` (or `lines`); `python -m benchmarks --out FILE` calls it and links the images from the report.
matplotlib is the `[plot]` extra: without it no plot is drawn and the report says so.
"""

from __future__ import annotations

import textwrap
from pathlib import Path


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def bars(path: Path, title: str, labels: list[str], panels: list[tuple[str, list[float]]]) -> Path:
    """One figure: for each (y label, one value per label) panel a bar chart of the labels,
    each bar annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    colors = [f"C{i}" for i in range(len(labels))]
    for ax, (ylabel, values) in zip(axes[0], panels):
        drawn = ax.bar(range(len(labels)), values, color=colors)
        # Wrapped at spaces: long names ("llmsplit --kv-dtype bfloat16") ran into their neighbours.
        ax.set_xticks(range(len(labels)), [textwrap.fill(label, 16, break_on_hyphens=False) for label in labels], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.bar_label(drawn, labels=[f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_ylim(0, max(values) * 1.18 if values and max(values) > 0 else 1)
    # Wrapped to the figure's width: a long title (the serve benchmark's model line) ran off both edges.
    fig.suptitle(textwrap.fill(title, int(48 * len(panels))), fontsize=10)
    return _save(fig, path)


def lines(path: Path, title: str, xlabel: str, ylabel: str, xs: list[float], series: dict[str, list[float]]) -> Path:
    """One figure: each series' values against `xs` (log2 x axis, the sizes as ticks), each point
    annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, ys in series.items():
        ax.plot(xs, ys, marker="o", label=name)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, max(max(ys) for ys in series.values()) * 1.15)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def _save(fig, path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
