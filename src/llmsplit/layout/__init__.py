"""The one source of truth for splitting a model: a `Layout` (how the devices share the
work), a `Workload` (what runs on them), `check()` with every rule that any part of the
program needs, the pipeline stage split, the bubble models and the tensor-parallel plan
(`tp_plan`: which weights split by column, by row, or stay whole).

Pure: it imports only `models/` and `errors.py` (an import-linter contract keeps it so).
Training (`config.validate`), inference `--tp/--pp` and the planner all call the same
`check` and `stage_layers`, so they can never disagree on what runs.
"""

from .bubble import ACTION_COSTS, bubble_fraction, idle_per_compute, schedule_bubble, single_stage_order
from .parse import LAYOUT_KEYS, parse_layout
from .rules import INT4_GROUP, check, check_model, packed_split_problem, resolve_dp, sequence_multiple
from .spec import (CHECKPOINTING, OFFLOADS, PRECISIONS, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SCHEDULES, Layout,
                   Workload, microbatches, stages_per_rank)
from .stages import layer_costs, rank_layer_counts, rank_layers, split_layers, stage_ids_of_rank, stage_layers
from .tp_plan import (BUFFERS, COLWISE, HEAD_NORMS, INFER_EXPERT_DIMS, KV_PROJECTIONS, LAYER_PLAN, REPLICATE, ROWWISE,
                      TOP_PLAN, VOCAB, layer_plan, rank_layer_shapes, split_dim, tp_shard)

__all__ = [
    "ACTION_COSTS", "CHECKPOINTING", "LAYOUT_KEYS", "parse_layout", "OFFLOADS", "PRECISIONS", "SCHEDULES", "SPLIT_BACKWARD_SCHEDULES",
    "V_SCHEDULES", "Layout", "Workload", "bubble_fraction", "check", "check_model", "idle_per_compute",
    "layer_costs", "microbatches", "rank_layer_counts", "rank_layers", "resolve_dp", "schedule_bubble",
    "sequence_multiple",
    "single_stage_order", "split_layers", "stage_ids_of_rank", "stage_layers", "stages_per_rank",
    "BUFFERS", "COLWISE", "HEAD_NORMS", "INFER_EXPERT_DIMS", "INT4_GROUP", "KV_PROJECTIONS", "LAYER_PLAN", "REPLICATE",
    "ROWWISE", "TOP_PLAN", "VOCAB", "layer_plan", "packed_split_problem", "rank_layer_shapes", "split_dim", "tp_shard",
]
