"""QLoRA (Dettmers et al. 2023): LoRA over a frozen base kept 4-bit (NF4) or 8-bit, dequantized
per use, from outside the plain model like LoRA itself.

The quantized weights are torchao's tensor subclasses, not a format of our own: `NF4Tensor`
(NF4 blocks of 64 with double-quantized scales, the format of the QLoRA paper and of torchtune)
and `Int8QuantizedTrainingLinearWeight` (int8, one absmax scale per output row). Both answer
`F.linear` with a backward that gives the input its gradient (the weight gets none), and both
know how FSDP2 all-gathers them (`fsdp_pre_all_gather`), so ZeRO-2/3 shard and gather the
packed bytes, never a float copy. `quant.PackedWeight` (inference's packed weights) has no
backward and refuses every other op by design, so it is not reused here.

NF4 weights compute through `nf4_linear` rather than torchao's `linear_nf4`: the same numbers,
but torchao's dequantization (`NF4Tensor.get_original_weight`) builds each weight through int64
codes and several full-size float temporaries, ~5x the float weight at every use, forward and
backward, which on a 1B model is a few hundred MiB at the moment of the peak. `nf4_linear`
decodes a byte (two 4-bit codes) at a time from a 256-entry table into one float workspace
that every layer reuses (the ops of a step run one after another), in chunks of bounded int32
codes, and recomputes the weight in backward rather than keeping it.

What is quantized: every linear weight of every decoder layer (q, k, v, o, gate, up, down),
whether or not it carries an adapter, as QLoRA does; the embedding, the norms and the output
head stay float. The weights are quantized once, after they are loaded whole on the rank and
before FSDP/DDP wrap them (apply.py): every layout then holds the same quantized numbers.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .lora import TARGETS, LoRALinear

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


def stored_nbytes(shape: tuple[int, int], base: str) -> int:
    """Bytes `quantize_weight` stores for a weight of `shape` [out, in], counted from the shape
    (a model's count needs no quantizing): torchao's NF4Tensor holds the 4-bit codes, an int8
    scale per block, an fp32 factor per `_scaler_block` scales, an fp32 mean and its 16-value
    fp32 table; its int8 weight one byte a value and an fp32 scale per row."""
    out_features, n = shape[0], shape[0] * shape[1]
    if base == "int8":
        return n + 4 * out_features
    blocks = n // NF4_BLOCK
    return n // 2 + blocks + 4 * (blocks // _scaler_block(blocks)) + 4 + 4 * 16


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
        if base == "nf4":  # computes through nf4_linear (the class swap keeps names, parameters, hooks)
            module.__class__ = NF4LoRALinear if isinstance(module, LoRALinear) else NF4Linear


class NF4Linear(nn.Linear):
    """An nn.Linear whose weight is an NF4Tensor, computed by `nf4_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.bias)


class NF4LoRALinear(LoRALinear, NF4Linear):
    """A LoRALinear over an NF4 base weight: LoRALinear.forward's base product is NF4Linear's."""


def nf4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = _NF4Matmul.apply(x, weight)
    return out if bias is None else out + bias


class _NF4Matmul(torch.autograd.Function):
    """x @ W^T with W dequantized into the shared workspace, in forward and again in backward
    (the weight is frozen: it gets no gradient, and nothing of it is kept between the two)."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)  # the NF4 bytes, as torchao's linear_nf4 keeps them
        return F.linear(x, dequantize_nf4(weight))

    @staticmethod
    def backward(ctx, grad_out):
        w = dequantize_nf4(ctx.saved_tensors[0])
        return grad_out @ (w if w.dtype == grad_out.dtype else w.to(grad_out.dtype)), None


_WORKSPACE: dict[tuple, torch.Tensor] = {}  # (dtype, device) -> the float buffer weights decode into
_CODES_CHUNK = 1 << 20  # bytes of NF4 codes widened to int32 at a time (4 MiB of indices)


def dequantize_nf4(w) -> torch.Tensor:
    """NF4Tensor `w` as floats of its dtype, in the shared workspace: valid until the next call
    (each caller uses it at once). Equal to torchao's `get_original_weight`, value for value."""
    n, key = w.numel(), (w.dtype, w.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < n:
        _WORKSPACE[key] = buf = None  # the old one freed before the larger one is made
        _WORKSPACE[key] = buf = torch.empty(n, dtype=w.dtype, device=w.device)
    out = buf[:n]
    codes, pairs = w.quantized_data.reshape(-1), out.view(-1, 2)  # a byte: element 2j (high nibble), 2j + 1
    table = torch.stack([w.nf4.repeat_interleave(16), w.nf4.repeat(16)], 1).to(w.dtype)  # [256, 2]
    for start in range(0, codes.numel(), _CODES_CHUNK):
        chunk = codes[start:start + _CODES_CHUNK].to(torch.int32)
        torch.index_select(table, 0, chunk, out=pairs[start:start + chunk.numel()])
    scalers = w.dequantize_scalers(w.quantized_scalers, w.quantization_factor, w.scaler_block_size)
    out.view(-1, w.block_size).mul_(scalers.unsqueeze(-1))
    return out.view(w.shape)


def quantized_names(model: nn.Module) -> list[str]:
    """Names of `model`'s quantized parameters (DDP must not broadcast them: every rank quantized
    the same weights, and gloo/NCCL broadcast plain tensors only)."""
    return [name for name, p in model.named_parameters() if is_quantized(p)]


def is_quantized(p: torch.Tensor) -> bool:
    inner = getattr(p, "_local_tensor", p)
    return type(inner).__name__ in ("NF4Tensor", "Int8QuantizedTrainingLinearWeight")
