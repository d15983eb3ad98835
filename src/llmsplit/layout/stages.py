"""How the decoder's layers are cut into pipeline stages and which stages each pipeline
rank holds. One cost-balanced split, used by training (parallel/pipeline.py), inference
`--pp` (infer/runner/split.py) and the planner alike."""

from __future__ import annotations

from functools import lru_cache

from ..models.llama import LlamaConfig
from .spec import V_SCHEDULES, Layout, stages_per_rank


def layer_costs(cfg: LlamaConfig) -> tuple[list[float], float, float]:
    """Relative forward cost of each layer, of the embedding and of norm + output head,
    in units of one layer's matmul FLOPs per token."""
    head = cfg.vocab_size * cfg.dim / cfg.layer_matmul_params()
    embed = 0.05 * head  # a lookup, not a matmul; still memory traffic
    return [1.0] * cfg.n_layers, embed, head


def split_layers(cfg: LlamaConfig, n_stages: int) -> list[list[int]]:
    """Contiguous layers per stage, minimising the cost of the most expensive stage
    (embedding counted on the first stage, the head on the last). Every stage gets a layer."""
    costs, embed, head = layer_costs(cfg)
    return [list(s) for s in _balanced(tuple(costs), embed, head, n_stages)]


@lru_cache(maxsize=256)
def _balanced(costs: tuple[float, ...], embed: float, head: float, n_stages: int) -> tuple[tuple[int, ...], ...]:
    # A dynamic programme over layers × stages; the planner asks for the same split once per
    # candidate layout, hence the cache.
    n = len(costs)
    assert 1 <= n_stages <= n, (n_stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (embed if stage == 0 else 0.0) + (head if stage == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: minimal max-cost of placing layers [0, i) into stages [0, s).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        bounds.append(tuple(range(j, i)))
        i = j
    return tuple(bounds[::-1])


def stage_layers(cfg: LlamaConfig, layout: Layout) -> list[list[int]]:
    """The layer indices of each of the layout's pipeline stages (pp × stages per rank)."""
    return split_layers(cfg, layout.n_stages)


def stage_ids_of_rank(schedule: str, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Looped schedules give rank r stages r, r+p, r+2p…; V schedules give r and 2p−1−r."""
    if pp == 1:
        return [0]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule, virtual_stages))]


def rank_layers(cfg: LlamaConfig, layout: Layout, pp_rank: int) -> list[list[int]]:
    """The layers of each stage pipeline rank `pp_rank` holds, in the order of its stage ids."""
    per_stage = stage_layers(cfg, layout)
    return [per_stage[s] for s in stage_ids_of_rank(layout.pp_schedule, pp_rank, layout.pp, layout.pp_virtual_stages)]


def rank_layer_counts(cfg: LlamaConfig, layout: Layout) -> tuple[int, ...]:
    """How many decoder layers each pipeline rank holds."""
    costs, embed, head = layer_costs(cfg)
    return _rank_layer_counts(tuple(costs), embed, head, layout.n_stages, layout.pp_schedule, layout.pp,
                              layout.pp_virtual_stages)


@lru_cache(maxsize=1024)
def _rank_layer_counts(costs: tuple[float, ...], embed: float, head: float, n_stages: int, schedule: str, pp: int,
                       virtual_stages: int) -> tuple[int, ...]:
    # The planner asks this of every candidate layout, for each of its stages' memory (a 64-GPU
    # plan: 124k times, 34 of its 42 s before the cache).
    per_stage = _balanced(costs, embed, head, n_stages)
    return tuple(sum(len(per_stage[s]) for s in stage_ids_of_rank(schedule, r, pp, virtual_stages)) for r in range(pp))
