"""The single function that turns a plain model into the parallel model the config asks for.

Order (the one torchtitan uses): PP split → TP → activation checkpointing → compile →
FSDP/DDP. The model is built on the meta device, so no rank ever allocates the whole
model before it is split; weights are then materialised on the device and initialised
from (seed, parameter name), which gives every layout the weights of a single process.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import Config
from ..models.llama import LlamaConfig, Transformer
from .data_parallel import apply_ddp
from .mesh import Mesh


def build_parallel_model(model_cfg: LlamaConfig, cfg: Config, mesh: Mesh, device: torch.device) -> tuple[nn.Module, Transformer]:
    """Returns (the module to train, the plain model underneath it)."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names stay those of the plain model
    model.to_empty(device=device)
    model.init_weights(cfg.train.seed, buffer_device=device)
    # DDP must wrap materialised parameters (it broadcasts rank 0's at construction).
    return apply_ddp(model, mesh, device), model
