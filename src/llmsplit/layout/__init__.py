"""The one source of truth for splitting a model: a `Layout` (how the devices share the
work), a `Workload` (what runs on them), `check()` with every rule that any part of the
program needs, the pipeline stage split and the bubble models.

Pure: it imports only `models/` and `errors.py` (an import-linter contract keeps it so).
Training (`config.validate`), inference `--tp/--pp` and the planner all call the same
`check` and `stage_layers`, so they can never disagree on what runs.
"""

from .bubble import ACTION_COSTS, bubble_fraction, idle_per_compute, schedule_bubble, single_stage_order
from .parse import LAYOUT_KEYS, parse_layout
from .rules import check, check_model, resolve_dp
from .spec import (CHECKPOINTING, OFFLOADS, PRECISIONS, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, Layout,
                   Workload, microbatches, stages_per_rank)
from .stages import layer_costs, rank_layer_counts, rank_layers, split_layers, stage_ids_of_rank, stage_layers

__all__ = [
    "ACTION_COSTS", "CHECKPOINTING", "LAYOUT_KEYS", "parse_layout", "OFFLOADS", "PRECISIONS", "SCHEDULES", "SPLIT_BACKWARD_SCHEDULES",
    "V_SCHEDULES", "Layout", "Workload", "bubble_fraction", "check", "check_model", "idle_per_compute",
    "layer_costs", "microbatches", "rank_layer_counts", "rank_layers", "resolve_dp", "schedule_bubble",
    "single_stage_order", "split_layers", "stage_ids_of_rank", "stage_layers", "stages_per_rank",
]
