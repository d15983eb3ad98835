"""Pipeline bubble models: the textbook fractions, the schedule's own time line run with
given action costs (`schedule_bubble`), and the idle time per unit of compute the planner
adds to a step. Pure arithmetic on action orders; parallel/pipeline.py reads the orders
out of torch's schedule objects."""

from __future__ import annotations

from .spec import V_SCHEDULES, stages_per_rank


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> float:
    """The textbook idle fraction: (p−1)/(m+p−1) for GPipe and 1F1B, (p−1)/(v·m+p−1)
    interleaved; for the V schedules, which fill most of it with weight-gradient passes,
    this is only an upper bound (`schedule_bubble` gives their own figure)."""
    if pp == 1:
        return 0.0
    v = stages_per_rank(schedule, virtual_stages)
    return (pp - 1) / (v * n_microbatches + pp - 1)


# Ideal cost of each compute action, in forward passes of one stage: a full backward is two
# forwards' worth of matmuls, split by the zero-bubble schedules into an input-gradient (I)
# and a weight-gradient (W) pass of one each.
ACTION_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def schedule_bubble(order: dict[int, list], stage_rank: dict[int, int], costs: dict = ACTION_COSTS) -> float:
    """A schedule's own idle fraction: its per-rank action lists run with the given costs and
    no communication time, each action starting once its rank is free and its inputs exist
    (F of a stage needs the previous stage's F of that micro-batch; I/B the next stage's
    I/B; W its own I). Returns 1 − mean busy ÷ makespan. With equal stages this is
    (p−1)/(m+p−1) for GPipe and 1F1B and (p−1)/(v·m+p−1) for torch's interleaved 1F1B.

    `order[rank]` lists (stage, kind, micro-batch) with kind F, B, I or W, or a list of
    such actions run back to back whose results leave the rank together at the end (torch
    runs DualPipeV's overlapped F+B pairs so, sending after the pair); `costs` maps a kind,
    a (stage, kind) pair where stages differ, or a (stage, kind, micro-batch) action where
    single actions do, to its duration (the most specific key wins)."""
    done: dict[tuple[int, str, int], tuple[float, float]] = {}  # action -> (ready on its rank, sent)
    last = max(stage_rank)
    free = dict.fromkeys(order, 0.0)
    nxt = dict.fromkeys(order, 0)
    busy = dict.fromkeys(order, 0.0)

    def ready(rank: int, stage: int, kind: str, mb: int, group: dict) -> float | None:
        """When the inputs of an action on `rank` exist (None: not yet); `group` holds the
        end times of the actions run so far in the same group."""
        have = lambda d: d in done or d in group  # noqa: E731
        if kind == "F":
            deps = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind in ("I", "B"):
            deps = [(stage, "F", mb)]
            if stage < last:
                deps.append((stage + 1, "I", mb) if have((stage + 1, "I", mb)) else (stage + 1, "B", mb))
        else:  # W
            deps = [(stage, "I", mb)]
        if not all(have(d) for d in deps):
            return None
        return max((group[d] if d in group else done[d][0 if stage_rank[d[0]] == rank else 1] for d in deps),
                   default=0.0)

    def run(rank: int, members: list) -> tuple[dict, float, float] | None:
        """(end of each action, end of the group, busy time), or None while an input is missing."""
        t, ends, spent = free[rank], {}, 0.0
        for stage, kind, mb in members:
            start = ready(rank, stage, kind, mb, ends)
            if start is None:
                return None
            cost = costs.get((stage, kind, mb), costs.get((stage, kind), costs[kind]))
            t = max(t, start) + cost
            ends[(stage, kind, mb)] = t
            spent += cost
        return ends, t, spent

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while nxt[rank] < len(actions):
                item = actions[nxt[rank]]
                result = run(rank, item if isinstance(item, list) else [item])
                if result is None:
                    break
                ends, t, spent = result
                for key, end in ends.items():
                    done[key] = (end, t)  # usable on this rank at once, by the others after the group
                free[rank] = t
                busy[rank] += spent
                nxt[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("the schedule's actions wait on each other (deadlock)")
    makespan = max(free.values())
    return 1.0 - sum(busy.values()) / (len(busy) * makespan)


def single_stage_order(schedule: str, pp: int, m: int) -> dict[int, list[tuple[int, str, int]]]:
    """The compute order GPipe (all forwards, then all backwards) and 1F1B (p − rank − 1
    warm-up forwards, then one forward and one backward in turn) run on each rank."""
    order = {}
    for rank in range(pp):
        if schedule == "gpipe":
            order[rank] = [(rank, "F", i) for i in range(m)] + [(rank, "B", i) for i in range(m)]
            continue
        warm = min(pp - rank - 1, m)
        actions, f = [(rank, "F", i) for i in range(warm)], warm
        for b in range(m):
            if f < m:
                actions.append((rank, "F", f))
                f += 1
            actions.append((rank, "B", b))
        order[rank] = actions
    return order


def idle_per_compute(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> float:
    """Bubble time as a multiple of a rank's compute time in one step, as the planner adds it:
    (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved (the textbook fraction f gives
    f / (1 − f)); the zero-bubble V schedules fill it with weight-gradient passes: a third of
    1F1B's at m = p, gone once m ≥ 2p."""
    p, m = pp, n_microbatches
    if p == 1:
        return 0.0
    if schedule not in V_SCHEDULES:
        v = stages_per_rank(schedule, virtual_stages)
        return (p - 1) / (v * m)
    return (p - 1) / (3 * m) * max(0.0, 1 - (m - p) / p) if m < 2 * p else 0.0
