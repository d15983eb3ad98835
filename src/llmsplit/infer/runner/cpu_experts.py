"""Routed experts kept in CPU memory while the rest of their layer runs on an accelerator
(llama.cpp's `--n-cpu-moe N`: the experts of the first N layers). The experts are most of a
MoE model's bytes and each token reads only k of them, so the CPU's memory holds them and its
cores run them on the few rows routed there; attention, the router and the KV cache stay on
the accelerator. Placement charges the CPU for these experts (plan/placement.py: usage_by_device);
the runner loads them there and sets `experts_on_cpu` as the layer's `MoE.dispatch`, the hook
the plain model leaves for running its experts elsewhere (expert parallel uses it too).
"""

from __future__ import annotations

import torch

from ...models.moe import MoE, grouped_swiglu


def experts_on_cpu(moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """MoE.dispatch: the routed rows (sorted by expert) to the experts' memory, through them as
    one grouped matmul there, and the outputs back to the layer's device."""
    w1 = moe.w1
    out = grouped_swiglu(rows.to(w1.device), counts.to(w1.device), w1, moe.w3, moe.w2)
    return out.to(rows.device)
