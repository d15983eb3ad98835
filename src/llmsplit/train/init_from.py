"""Start training from pretrained weights (`model.hf`) instead of a random init.

Each rank reads only the block of each tensor that it holds: for a sharded (DTensor)
parameter the block is the shard's global offset and local shape, read straight from the
memory-mapped safetensors file; no rank ever holds the whole model.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..adapters.lora import is_adapter
from ..errors import ConfigError
from ..models.llama import plain_name


@torch.no_grad()
def load_pretrained(model: torch.nn.Module, source, only=None) -> int:
    """Copy `source`'s weights (an `io.weights` reader) into `model`'s parameters (those whose
    name `only` accepts), shard by shard. Returns the bytes read."""
    read = 0
    for name, p in model.named_parameters():
        name = plain_name(name)  # wrappers add prefixes that the weights do not have
        if is_adapter(name) or (only is not None and not only(name)):
            continue  # LoRA's adapters start from their own initialisation
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            local = p.to_local()
            if local.numel() == 0:
                continue
            if not _is_block(local, shape):
                raise ConfigError(f"cannot map the shard of {name} to one block of the pretrained tensor; "
                                  f"use a layout without strided sharding for model.hf")
            block = source.read_region(name, tuple(offset), tuple(shape))
            local.copy_(block.to(local.dtype))
        else:
            block = source.read(name)
            if tuple(block.shape) != tuple(p.shape):
                raise ConfigError(f"pretrained {name} has shape {tuple(block.shape)}, the model {tuple(p.shape)}")
            p.copy_(block.to(device=p.device, dtype=p.dtype))
        read += block.numel() * block.element_size()
    return read


def _is_block(local: torch.Tensor, shape) -> bool:
    return tuple(local.shape) == tuple(shape)


@torch.no_grad()
def load_adapters(model: torch.nn.Module, init: str, lora, model_cfg) -> None:
    """Start the LoRA adapters from `lora.init` (each rank keeps its shard of each)."""
    from ..io.peft_adapter import initial_adapters
    from ..models.llama import assign_full_tensor

    params = {plain_name(n): p for n, p in model.named_parameters() if is_adapter(n)}
    found = initial_adapters(init, lora, model_cfg, sorted(params))
    for name, p in params.items():
        if tuple(found[name].shape) != tuple(p.shape):
            raise ConfigError(f"lora.init={init!r}: {name} is {list(found[name].shape)}, the model's {list(p.shape)}")
        assign_full_tensor(p, found[name])
