"""QLoRA (Dettmers et al. 2023): LoRA over a frozen base kept 4-bit (NF4) or 8-bit, dequantized
per use, from outside the plain model like LoRA itself.

The quantized weights are torchao's tensor subclasses, not a format of our own: `NF4Tensor`
(NF4 blocks of 64 with double-quantized scales, the format of the QLoRA paper and of torchtune)
and `Int8QuantizedTrainingLinearWeight` (int8, one absmax scale per output row). Both answer
`F.linear` with a backward that gives the input its gradient (the weight gets none), and both
know how FSDP2 all-gathers them (`fsdp_pre_all_gather`), so ZeRO-2/3 shard and gather the
packed bytes, never a float copy. `quant.PackedWeight` (inference's packed weights) has no
backward and refuses every other op by design, so it is not reused here.

What is quantized: every linear weight of every decoder layer (q, k, v, o, gate, up, down),
whether or not it carries an adapter, as QLoRA does; the embedding, the norms and the output
head stay float. The weights are quantized once, after they are loaded whole on the rank and
before FSDP/DDP wrap them (apply.py): every layout then holds the same quantized numbers.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from .lora import TARGETS

BASES = ("nf4", "int8")
NF4_BLOCK = 64  # values per NF4 scale: the QLoRA paper's and torchao's default
NF4_SCALER_BLOCK = 256  # NF4 scales per double-quantization factor, at most (see _scaler_block)
# FSDP2 splits a weight's rows over the shard ranks, and NF4 splits its scale factors with them;
# a factor count divisible by 8 lets every shard degree up to 8 that divides the rows split it.
SPLIT_FACTOR = 8


@contextmanager
def _quiet_torchao():
    """torchao warns at import about every C++ extension built for another torch, and torch about
    the way torchao registers its enums; NF4 and int8 are pure PyTorch and need neither, so the
    warnings say nothing about this use."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def base_weight_paths(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """(linear module, dotted path) of every weight the base quantizes in `module`: a model, or
    one decoder layer."""
    blocks = module.layers.values() if hasattr(module, "layers") else [module]
    # Activation checkpointing wraps each block; the layers are inside it.
    blocks = [getattr(block, "_checkpoint_wrapped_module", block) for block in blocks]
    return [(block.get_submodule(path), path) for block in blocks for path in TARGETS.values()]


def _scaler_block(n_blocks: int) -> int:
    """The largest power of two up to 256 that splits `n_blocks` NF4 scales into a number of
    factors divisible by SPLIT_FACTOR (or, for a weight too small for that, divides it): a
    function of the shape alone, so every layout quantizes alike."""
    size = NF4_SCALER_BLOCK
    while size > 1 and n_blocks % (size * SPLIT_FACTOR):
        size //= 2
    while size > 1 and n_blocks % size:
        size //= 2
    return size


def quantize_weight(w: torch.Tensor, base: str) -> torch.Tensor:
    """`w` [out, in] (float) as the frozen base `base` stores it."""
    with _quiet_torchao():
        if base == "nf4":
            from torchao.quantization import to_nf4

            n_blocks = w.numel() // NF4_BLOCK
            return to_nf4(w.contiguous(), NF4_BLOCK, _scaler_block(n_blocks))
        from torchao.prototype.quantized_training.int8 import Int8QuantizedTrainingLinearWeight

        return Int8QuantizedTrainingLinearWeight.from_float(w)


def dequantize(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight a quantized base computes with (what a reference model is given)."""
    if hasattr(w, "get_original_weight"):
        return w.get_original_weight().float()
    return w.dequantize().float()


def check_base_shapes(model: nn.Module, base: str) -> str | None:
    """Why `base` cannot store this model's weights, or None. NF4 needs whole blocks of 64."""
    if base != "nf4":
        return None
    for module, path in base_weight_paths(model):
        if module.weight.numel() % NF4_BLOCK:
            shape = "x".join(map(str, module.weight.shape))
            return f"the {path} weight ({shape}) is not a whole number of NF4 blocks of {NF4_BLOCK} values"
    return None


@torch.no_grad()
def quantize_base(model: nn.Module, base: str) -> None:
    """Replace every base linear weight of `model` (a model or one decoder layer, materialised,
    frozen) by its quantized form."""
    for module, _ in base_weight_paths(model):
        w = module.weight
        module.weight = nn.Parameter(quantize_weight(w.detach(), base), requires_grad=False)
        del w


def quantized_names(model: nn.Module) -> list[str]:
    """Names of `model`'s quantized parameters (DDP must not broadcast them: every rank quantized
    the same weights, and gloo/NCCL broadcast plain tensors only)."""
    return [name for name, p in model.named_parameters() if is_quantized(p)]


def is_quantized(p: torch.Tensor) -> bool:
    inner = getattr(p, "_local_tensor", p)
    return type(inner).__name__ in ("NF4Tensor", "Int8QuantizedTrainingLinearWeight")
