"""The one plotting helper of the benchmark suite: bar panels side by side, one PNG.

A benchmark that plots defines `plot(result, out_dir) -> list[Path]` and draws with
`bars`; `python -m benchmarks --out FILE` calls it and links the images from the report.
matplotlib is the `[plot]` extra: without it no plot is drawn and the report says so.
"""

from __future__ import annotations

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
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.bar_label(drawn, labels=[f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}" for v in values], fontsize=8)
        ax.set_ylim(0, max(values) * 1.18 if values and max(values) > 0 else 1)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
