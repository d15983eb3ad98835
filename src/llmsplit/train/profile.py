"""`llmsplit train --profile N`: a torch.profiler trace of N steps per rank, and where
each rank's time went (compute, communication, idle), with warnings for a straggler and
for unbalanced pipeline stages.

Time is split over the profiled steps' wall clock, per rank:
- compute: time covered by compute work: on a GPU its kernels, on a CPU the innermost
  operators (their parents would also cover the time spent blocked inside them);
- communication: time covered by collectives (`c10d::`, `gloo`, `nccl` events, on any
  thread: gloo runs them on its own threads) and not by compute, i.e. what is exposed;
- idle: the rest (Python, data loading, waiting that no operator records).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..io.run_dir import PROFILE_DIR

COMM = re.compile(r"c10d::|gloo|nccl|record_param_comms", re.IGNORECASE)
STEP_MARK = "llmsplit::step "
STRAGGLER = 0.20   # a rank this much slower than the median of the others, in every step
IMBALANCE = 0.20   # pipeline stages whose busy fractions differ by this much


def profiled_steps(n: int, start_step: int, last_step: int) -> range:
    """Up to n steps, skipping the run's first step (warm-up: allocations, kernel choice)
    when there are enough steps left for that."""
    if n <= 0:
        return range(0)
    first = start_step + 2 if last_step - start_step > n else start_step + 1
    return range(first, min(first + n, last_step + 1))


class StepProfiler:
    """Called by the training loop at the start and end of every step; does nothing
    outside the profiled steps or when profiling is off."""

    def __init__(self, n: int, start_step: int, last_step: int, run_dir: Path, rank: int):
        self.enabled = n > 0
        self.window = profiled_steps(n, start_step, last_step)
        self.out = Path(run_dir) / PROFILE_DIR
        self.rank = rank
        self.prof = None
        self.mark = None

    def begin(self, step: int) -> None:
        if step not in self.window:
            return
        if step == self.window.start:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities)
            self.prof.start()
        self.mark = torch.profiler.record_function(f"{STEP_MARK}{step}")
        self.mark.__enter__()

    def end(self, step: int) -> None:
        if step not in self.window:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the step's kernels belong inside its window
        self.mark.__exit__(None, None, None)
        if step == self.window[-1]:
            self.prof.stop()

    def finish(self) -> list[dict] | None:
        """Every rank: write its trace; rank 0 gets every rank's time split (a collective)."""
        if not self.enabled:
            return None
        row = None
        if self.prof is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            # *.pt.trace.json: the name TensorBoard's profiler plugin looks for.
            self.prof.export_chrome_trace(str(self.out / f"rank{self.rank}.pt.trace.json"))
            row = {"rank": self.rank, "steps": split_events(self.prof.events())}
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        return rows if dist.get_rank() == 0 else None


# ---------------------------------------------------------------- analysis

def split_events(events) -> list[dict]:
    """Per profiled step: {"step", "wall_s", "compute_s", "comm_s", "idle_s"} from the
    profiler's events."""
    marks = [e for e in events if e.name.startswith(STEP_MARK)]
    device = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    if device:  # a GPU: its kernels are the work
        pool = device
    else:  # innermost CPU operators, and every collective (gloo's threads included)
        pool = [e for e in events if not e.name.startswith(STEP_MARK) and (not e.cpu_children or COMM.search(e.name))]
    compute = [(e.time_range.start, e.time_range.end) for e in pool if not COMM.search(e.name)]
    comm = [(e.time_range.start, e.time_range.end) for e in pool if COMM.search(e.name)]
    out = []
    for mark in sorted(marks, key=lambda e: e.time_range.start):
        window = (mark.time_range.start, mark.time_range.end)
        split = split_time(compute, comm, window)
        out.append({"step": int(mark.name[len(STEP_MARK):]), **{k: v / 1e6 for k, v in split.items()}})
    return out


def _union(intervals, window) -> list[tuple[float, float]]:
    lo, hi = window
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    merged: list[list[float]] = []
    for a, b in clipped:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def split_time(compute, comm, window) -> dict:
    """Split `window` into compute, exposed communication and idle (same units as the input)."""
    c = _union(compute, window)
    both = _union([*compute, *comm], window)
    wall = window[1] - window[0]
    busy_c, busy = _length(c), _length(both)
    return {"wall_s": wall, "compute_s": busy_c, "comm_s": busy - busy_c, "idle_s": wall - busy}


def rank_totals(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        total = {k: sum(s[k] for s in row["steps"]) for k in ("wall_s", "compute_s", "comm_s", "idle_s")}
        wall = total["wall_s"] or 1.0
        out.append({"rank": row["rank"], **total, **{k.replace("_s", "_fraction"): total[k] / wall
                                                     for k in ("compute_s", "comm_s", "idle_s")}})
    return out


def stragglers(rows: list[dict]) -> list[int]:
    """Ranks that, in every profiled step, worked (compute + idle: the time not spent
    waiting in a collective) more than STRAGGLER longer than the median of the others."""
    if len(rows) < 2:
        return []
    out = []
    steps = min(len(r["steps"]) for r in rows)
    for i, row in enumerate(rows):
        slow = steps > 0
        for k in range(steps):
            own = _work(row["steps"][k])
            others = sorted(_work(r["steps"][k]) for j, r in enumerate(rows) if j != i)
            median = others[len(others) // 2] if len(others) % 2 else (others[len(others) // 2 - 1] +
                                                                       others[len(others) // 2]) / 2
            slow = slow and own > (1 + STRAGGLER) * median
        if slow:
            out.append(row["rank"])
    return out


def _work(step: dict) -> float:
    return step["wall_s"] - step["comm_s"]


def pipeline_imbalance(busy: list[float] | None) -> float | None:
    """How much busier the busiest pipeline rank is than the least busy one (0.25 = 25%)."""
    busy = [b for b in busy or [] if b]
    if len(busy) < 2:
        return None
    return max(busy) / min(busy) - 1


def report(rows: list[dict], summary: dict, run_dir: Path) -> dict:
    """Rank 0: write RUN_DIR/profile/summary.json and print the table and warnings."""
    totals = rank_totals(rows)
    slow = stragglers(rows)
    busy = (summary.get("pipeline") or {}).get("busy_fraction_per_rank")
    imbalance = pipeline_imbalance(busy)
    warnings = []
    if slow:
        warnings.append(f"rank(s) {', '.join(map(str, slow))} took more than {STRAGGLER:.0%} longer than the others "
                        f"in every profiled step (a straggler: the others wait for it in communication); check that "
                        f"rank's device, its share of the work and what else runs on its machine")
    if imbalance is not None and imbalance > IMBALANCE:
        warnings.append(f"pipeline stages are unbalanced: the busiest rank is {imbalance:.0%} busier than the least "
                        f"busy one (busy fractions {', '.join(f'{b:.2f}' for b in busy)}); move layers between "
                        f"stages or use more micro-batches")
    out = {"steps": [s["step"] for s in rows[0]["steps"]] if rows else [], "per_rank": totals,
           "per_rank_steps": rows, "stragglers": slow, "pipeline_imbalance": imbalance, "warnings": warnings,
           "traces": sorted(p.name for p in (Path(run_dir) / PROFILE_DIR).glob("*.pt.trace.json"))}
    path = Path(run_dir) / PROFILE_DIR / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(format_table(totals), flush=True)
    for w in warnings:
        print(f"llmsplit: warning: {w}", file=sys.stderr, flush=True)
    print(f"profile: traces and summary in {path.parent}", flush=True)
    return out


def format_table(totals: list[dict]) -> str:
    lines = [f"{'rank':>4}  {'wall s':>7}  {'compute':>15}  {'communication':>15}  {'idle':>15}"]
    for t in totals:
        cells = [f"{t[k + '_s']:7.3f} {t[k + '_fraction']:6.1%}" for k in ("compute", "comm", "idle")]
        lines.append(f"{t['rank']:>4}  {t['wall_s']:7.3f}  " + "  ".join(f"{c:>15}" for c in cells))
    return "\n".join(lines)
