"""The pipeline bubble, measured: how long each compute action of every step took on this
rank, and, on rank 0, every rank's busy time against the step's wall clock next to the
schedule's own time line (the theory, from `layout.bubble`) replayed with those times."""

from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager

from ..config import ParallelSection
from ..layout import ACTION_COSTS, bubble_fraction, schedule_bubble
from ..parallel.pipeline import schedule_order

# What torch's PipelineStage calls for each compute action, timed by wrapping it.
_STAGE_ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class PipelineTimes:
    """Wraps the compute actions of a schedule's stages in timers. Each step after the first
    (which pays for shape inference and warm-up) leaves (step seconds, {(stage, kind,
    micro-batch): seconds of that action}) in `per_step`; the rank's busy time is their sum.
    The latest ones only: they feed the bubble's medians."""

    def __init__(self, schedule):
        self.schedule = schedule
        self.per_step: deque[tuple[float, dict]] = deque(maxlen=200)
        self.steps = 0
        self._actions: dict[tuple[int, str, int], float] = {}
        for stage in list(getattr(schedule, "_stages", None) or [schedule._stage]):
            for name in _STAGE_ACTIONS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(name, stage.stage_index, getattr(stage, name)))

    def _timed(self, name: str, stage: int, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                kind = ("F" if name == "forward_one_chunk" else "W" if name == "backward_weight_one_chunk"
                        else "B" if kwargs.get("full_backward", True) else "I")
                # torch passes the micro-batch (chunk) index first, positionally or by name
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                self._actions[(stage, kind, mb)] = elapsed
        return wrapper

    @contextmanager
    def step(self):
        """Around one schedule step."""
        self._actions = {}
        t0 = time.perf_counter()
        yield
        elapsed = time.perf_counter() - t0
        self.steps += 1
        if self.steps > 1:
            self.per_step.append((elapsed, self._actions))


def bubble_report(schedule, per_rank: list[dict], par: ParallelSection, n_stages: int, n_microbatches: int) -> dict:
    """The bubble of each step: every rank's busy time against the longest rank's step
    time, then the median over the steps. `per_rank` holds each rank's `per_step` under
    "pipeline_steps". A rank's own schedule.step() returns as soon as its last chunk is
    done, before the others' (the first stage runs the last backward); its wait for them
    happens in the next collective, outside its timer, and is idle time all the same.
    Measured on its own timer, gpipe at m=2 showed a bubble of 0.25 against the 1/3 that
    the time line of its chunks gives. The median, not the total, because one stall of a
    shared machine on one rank (seen: a 1 s forward among 0.22 s ones) idles every other
    rank for that step and is not the schedule's doing.

    The theory is the schedule's own time line (`schedule_bubble`): the order of compute
    actions the schedule runs, with no communication, each action taking the time it took
    in that step; its median over the steps, like the measurement. What the measurement
    adds over it is the pipeline runtime's own cost: sends and receives, the Python
    between actions, stalls between them. Replaying each step's own durations, and not
    one typical duration per action, matters where the theory is small: an action that
    runs long on one rank idles the ranks waiting for it, and that idle time is the
    schedule's (its dependencies), not the runtime's. On the 101M benchmark model, zbv at
    m=8 gave 0.030 this way against 0.028 from median durations (BENCHMARKS.md).

    `median_cost_bubble` is the same time line with each action's median duration over
    the run (`action_seconds`). The schedule's bubble depends on what its actions cost:
    the zero-bubble schedules hide weight-gradient (W) passes in it, so how long those
    take against a forward decides what is left (the ZB paper computes its bubbles from
    profiled T_F, T_B, T_W too), and the first stage's input-gradient pass is empty (its
    input is token ids), which moves all its backward work into W. The textbook formula
    (p−1)/(v·m+p−1), which assumes equal stages and costs, and the order's figure with
    unit costs (F = I = W = 1, B = 2) sit next to it."""
    order = schedule_order(schedule)
    unit = schedule_bubble(*order)
    rows = [r["pipeline_steps"] for r in per_rank if r.get("pipeline_steps")]
    per_rank_busy, measured, theory = [], [], []
    times: dict[tuple[int, str], list[float]] = {}
    for steps in zip(*rows):  # one (step seconds, action seconds) per rank
        longest = max(step for step, _ in steps)
        if longest <= 0:
            continue
        per_rank_busy.append([sum(rank_actions.values()) / longest for _, rank_actions in steps])
        measured.append(1.0 - sum(per_rank_busy[-1]) / len(steps))
        actions = _replica_means([rank_actions for _, rank_actions in steps])
        theory.append(schedule_bubble(*order, costs={**ACTION_COSTS, **actions}))
        for (stage, kind, _), seconds in actions.items():
            times.setdefault((stage, kind), []).append(seconds)
    costs = {key: statistics.median(v) for key, v in times.items()}
    typical = schedule_bubble(*order, costs={**ACTION_COSTS, **costs}) if costs else unit
    return {"schedule": par.pp_schedule, "stages": n_stages, "microbatches": n_microbatches,
            "theoretical_bubble": statistics.median(theory) if theory else typical,
            "theoretical_bubble_per_step": theory, "median_cost_bubble": typical,
            "unit_cost_bubble": unit,
            "formula_bubble": bubble_fraction(par.pp_schedule, par.pp, n_microbatches, par.pp_virtual_stages),
            "action_seconds": {f"{stage}:{kind}": v for (stage, kind), v in sorted(costs.items())},
            "measured_bubble": statistics.median(measured) if measured else None,
            "measured_bubble_per_step": measured,
            "busy_fraction_per_rank": [statistics.median(col) for col in zip(*per_rank_busy)]}


def _replica_means(ranks_actions: list[dict]) -> dict:
    """With data parallel, each pipeline replica ran the same actions: their mean."""
    replicas: dict[tuple[int, str, int], list[float]] = {}
    for rank_actions in ranks_actions:
        for key, seconds in rank_actions.items():
            replicas.setdefault(key, []).append(seconds)
    return {key: statistics.fmean(v) for key, v in replicas.items()}
