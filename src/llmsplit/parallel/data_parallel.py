"""Data parallel wrappers. This release: plain DDP (`parallel.zero = 0`)."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .mesh import Mesh


def apply_ddp(model: nn.Module, mesh: Mesh, device: torch.device) -> nn.Module:
    """Replicate the model over the data-parallel group; gradients are averaged in buckets
    that overlap with the backward pass."""
    return DistributedDataParallel(
        model,
        process_group=mesh.group("dp"),
        device_ids=[device.index] if device.type == "cuda" else None,
        # Every parameter is used in every step; saying so skips a graph traversal.
        find_unused_parameters=False,
        **_no_buffer_sync(),
    )


def _no_buffer_sync() -> dict:
    # Buffers (RoPE tables) are computed identically on every rank: no need to broadcast
    # them before each forward. torch 2.13 renamed the flag; older releases know only the old one.
    params = inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
