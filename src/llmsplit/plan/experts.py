"""What expert parallel (`parallel.ep`, parallel/expert_parallel.py) adds to a plan.

- Expert weights per rank: each ep rank holds n_experts / ep of every MoE layer's routed experts
  (the router, attention and shared experts stay whole), and so 1/ep of their gradients and
  Adam moments.
- All-to-all volume: every MoE layer's forward sends each routed copy of a token (k per token)
  to its expert's rank and the output back, and the backward sends the two gradients the same
  ways; a full activation-checkpointed layer repeats the forward's two. With routing balanced,
  (ep - 1) / ep of the copies leave the rank.
- Dispatch buffers: the copies sent, those received, their reordering by expert and the outputs
  on their way back, at most four such [tokens·k, dim] buffers of a layer at a time.
"""

from __future__ import annotations

from ..layout import Layout, Workload, microbatches, rank_layer_counts
from ..models.llama import LlamaConfig


def expert_params_per_rank(cfg: LlamaConfig, ep: int) -> int:
    """One layer's routed expert parameters held by one ep rank."""
    return cfg.routed_expert_params() // ep


def _routed_rows(cfg: LlamaConfig, layout: Layout, work: Workload) -> int:
    """Copies of tokens a rank routes per MoE layer and micro-batch (k per token)."""
    return layout.micro_batch * work.rows_per_sample * work.seq_len * cfg.experts_per_token


def _row_exchanges(cfg: LlamaConfig, layout: Layout, work: Workload) -> tuple[int, int]:
    """(all-to-alls of rows, forwards of MoE layers) of one rank in a training step."""
    if layout.ep == 1 or not cfg.n_experts:
        return 0, 0
    forwards = max(rank_layer_counts(cfg, layout)) * microbatches(layout, work)
    forwards *= 2 if layout.activation_checkpoint == "full" else 1
    return 2 * forwards + 2 * forwards // (2 if layout.activation_checkpoint == "full" else 1), forwards


def all_to_all_calls_per_step(cfg: LlamaConfig, layout: Layout, work: Workload) -> int:
    """All-to-alls one rank joins in a training step: rows, and one of the counts per forward."""
    rows, forwards = _row_exchanges(cfg, layout, work)
    return rows + forwards


def all_to_all_bytes_per_step(cfg: LlamaConfig, layout: Layout, work: Workload) -> int:
    """Bytes one rank sends by all-to-all in a training step (balanced routing)."""
    per_call = _routed_rows(cfg, layout, work) * cfg.dim * work.compute_bytes
    return int(_row_exchanges(cfg, layout, work)[0] * per_call * (layout.ep - 1) / layout.ep)


def dispatch_buffer_bytes(cfg: LlamaConfig, layout: Layout, work: Workload) -> int:
    """The dispatch buffers of one MoE layer at a time (transient, balanced routing)."""
    if layout.ep == 1 or not cfg.n_experts:
        return 0
    return 4 * _routed_rows(cfg, layout, work) * cfg.dim * work.compute_bytes
