"""LoRA (Hu et al. 2021) applied from outside the plain model: the chosen projections of every
decoder layer learn a low-rank update W + (alpha / rank) · B·A while everything else is frozen.

Applied after the pipeline split and tensor parallel (parallel/apply.py), in place: each target
`nn.Linear` becomes a `LoRALinear` (its class is swapped, so its name, parameters and the TP
hooks around it stay), and gets `lora_a` [rank, in] and `lora_b` [out, rank] split like the
layer they adapt: a column-parallel weight (rows split) has B split by rows and A whole; a
row-parallel weight (columns split) has A split by columns and B whole; a replicated weight
both whole. DTensor then computes the adapter on the same shards as the layer and reduces what
the layer reduces, so every layout computes the single-process result. FSDP2 shards them like
any parameter (it allows frozen and trained parameters in one group, which FSDP1 did not).

Initialisation as PEFT's default: A kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in),
1/sqrt(in))), B zeros, drawn whole from (seed, parameter name) as the base weights are, so
every layout starts from the same adapters.

On the CPU, a float32 LoRA layer (no autocast, plain tensors: not tensor parallel's DTensors, not
a quantized base) computes through `_LoRAMatmul`: its base and adapter
products run on oneDNN, and its backward computes no weight gradient for the frozen base.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import Transformer, assign_full_tensor, plain_name

TARGETS = {"q": "attention.wq", "k": "attention.wk", "v": "attention.wv", "o": "attention.wo",
           "gate": "feed_forward.w1", "up": "feed_forward.w3", "down": "feed_forward.w2"}
ADAPTER_NAMES = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """An nn.Linear plus its low-rank update; made by `apply_lora`, never constructed."""

    lora_scale: float = 1.0
    lora_dropout: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dropped = self.lora_dropout and self.training
        h = F.dropout(x, self.lora_dropout, self.training) if dropped else x  # what the adapter sees
        if _onednn_runs(x, self.weight, self.bias, self.lora_a, self.lora_b):
            return _LoRAMatmul.apply(x, h if dropped else None, self.weight, self.bias, self.lora_a, self.lora_b,
                                     self.lora_scale)
        out = super().forward(x)  # the base layer's product (nn.Linear's, or qlora.NF4Linear's)
        return out + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.lora_scale


def _onednn_runs(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether `_LoRAMatmul` computes this layer: float32 CPU tensors of torch's own types (a
    DTensor, an NF4 or int8 base is a subclass), oneDNN built in, and neither autocast (its
    casts are F.linear's) nor torch.compile (Inductor picks its own kernels) in charge."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 and type(x) is torch.Tensor
            and torch.backends.mkldnn.is_available() and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()):
        return False
    return all(p is None or (type(p) in (torch.Tensor, nn.Parameter) and p.device.type == "cpu"
                             and p.dtype == torch.float32) for p in params)


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias), x 2-D, on oneDNN: the fp32 matmul torch itself exposes only as this
    inference op (Inductor's), without a derivative, hence `_LoRAMatmul`'s backward."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _LoRAMatmul(torch.autograd.Function):
    """x W^T + b + s (h A^T) B^T (h: x after the adapter's dropout, or x), its backward by hand: on
    the CPU, F.linear's matmul is MKL's sgemm, which on an AMD CPU runs its AVX2 code even where
    AVX-512 is there (this machine's AMD EPYC: 95-100 GFLOP/s on one thread for the shapes of a
    24M-parameter Llama); oneDNN's fp32 matmul, in torch as `mkldnn._linear_pointwise`, runs
    AVX-512 at 200-230 GFLOP/s, float32 throughout (about 1e-6 of the largest value from a float64
    product, MKL's 5e-7). The scale multiplies the [tokens, rank] product rather than the
    [tokens, out] one, and the adapter's product is added into the base's in place; W (frozen)
    gets no gradient, so backward runs its input's product only."""

    @staticmethod
    def forward(ctx, x, h, weight, bias, lora_a, lora_b, scale):
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        h2 = x2 if h is None else h.reshape(-1, h.shape[-1]).contiguous()
        xa = _mm(h2, lora_a).mul_(scale)  # [tokens, rank]
        out = _mm(x2, weight, bias).add_(_mm(xa, lora_b))
        ctx.save_for_backward(x2, None if h is None else h2, weight, lora_a, lora_b, xa)
        ctx.scale, ctx.shape = scale, x.shape
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_out):
        x2, h2, weight, lora_a, lora_b, xa = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        need_x, need_h, need_w, need_bias, need_a, need_b, _ = ctx.needs_input_grad
        gxa = _mm(g, lora_b.t()).mul_(ctx.scale)  # [tokens, rank]
        grad_x = grad_h = None
        if h2 is None:  # the adapter saw x itself: both products' input gradients go to x
            grad_x = _mm(g, weight.t()).add_(_mm(gxa, lora_a.t())).view(ctx.shape) if need_x else None
        else:
            grad_x = _mm(g, weight.t()).view(ctx.shape) if need_x else None
            grad_h = _mm(gxa, lora_a.t()).view(ctx.shape) if need_h else None
        grad_w = _mm(g.t().contiguous(), x2.t()) if need_w else None  # only if someone unfroze the base
        grad_bias = g.sum(0) if need_bias else None
        # Weight gradients as [rank, features] products: a transposed [rank, tokens] input is copied
        # (oneDNN takes its input dense), a transposed weight is not (it reorders weights anyway).
        h2 = x2 if h2 is None else h2
        grad_a = _mm(gxa.t().contiguous(), h2.t()) if need_a else None
        grad_b = _mm(xa.t().contiguous(), g.t()).t().contiguous() if need_b else None
        return grad_x, grad_h, grad_w, grad_bias, grad_a, grad_b, None


def is_adapter(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


def parse_targets(targets: str) -> list[str]:
    return [t.strip() for t in targets.split(",") if t.strip()]


def apply_lora(model: Transformer, rank: int, alpha: float, dropout: float, targets: list[str]) -> None:
    """Freeze `model` and add adapters of `rank` to the `targets` of each of its layers."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers.values():
        for t in targets:
            layer = block.get_submodule(TARGETS[t])
            out_features, in_features = layer.weight.shape
            a, b = _adapter_tensors(layer.weight, rank, in_features, out_features)
            layer.register_parameter("lora_a", nn.Parameter(a))
            layer.register_parameter("lora_b", nn.Parameter(b))
            layer.__class__ = LoRALinear
            layer.lora_scale, layer.lora_dropout = alpha / rank, dropout


def parameter_counts(model_cfg, rank: int = 0, targets: str = "", base: str = "none") -> dict:
    """The run's parameters, each counted once, on the whole model: `params` the model's (the
    figure `num_params` computes; LoRA's adapters are not in it), `trainable_params` those the
    optimizer updates (LoRA's: the adapters of `rank` on `targets`), and with a quantized base
    (QLoRA) `frozen_base_bytes`, what the frozen parameters take as stored. Built on the meta
    device (no memory): a rank's own model holds its tensor / pipeline / ZeRO share only."""
    with torch.device("meta"):
        model = Transformer(model_cfg)
        if rank:
            apply_lora(model, rank, 1.0, 0.0, parse_targets(targets))
    named = dict(model.named_parameters())  # a tied head is the embedding's Parameter: named once
    counts = {"params": sum(p.numel() for name, p in named.items() if not is_adapter(name)),
              "trainable_params": sum(p.numel() for p in named.values() if p.requires_grad)}
    if rank and base != "none":
        from .qlora import base_weight_paths, stored_nbytes

        quantized = {id(module.weight) for module, _ in base_weight_paths(model)}
        counts["frozen_base_bytes"] = sum(stored_nbytes(tuple(p.shape), base) if id(p) in quantized
                                          else p.numel() * p.element_size()
                                          for p in named.values() if not p.requires_grad)
    return counts


def _adapter_tensors(weight: torch.Tensor, rank: int, in_features: int, out_features: int):
    """A and B, on the weight's device and split like it (see the module's docstring)."""
    a = torch.empty(rank, in_features, device=weight.device, dtype=weight.dtype)
    b = torch.empty(out_features, rank, device=weight.device, dtype=weight.dtype)
    placements = getattr(weight, "placements", None)
    if placements is None:
        return a, b
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    (p,) = placements  # tensor parallel weights live on the 1-D tp mesh
    a_place = Shard(1) if p == Shard(1) else Replicate()
    b_place = Shard(0) if p == Shard(0) else Replicate()
    mesh = weight.device_mesh
    return (distribute_tensor(a, mesh, [a_place], src_data_rank=None),
            distribute_tensor(b, mesh, [b_place], src_data_rank=None))


@torch.no_grad()
def init_lora(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation, from (seed, name) alone: the same adapters under every layout."""
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        if name.endswith("lora_b"):
            full = torch.zeros(p.shape)
        else:
            bound = 1 / math.sqrt(p.shape[1])
            digest = hashlib.sha256(f"lora:{seed}:{plain_name(name)}".encode()).digest()
            g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            full = torch.empty(p.shape).uniform_(-bound, bound, generator=g)
        assign_full_tensor(p, full)
