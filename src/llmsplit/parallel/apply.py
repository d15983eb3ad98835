"""The single function that turns a plain model into the parallel model the config asks for.

Order (the one torchtitan uses): PP split → TP → CP → EP → LoRA → activation checkpointing → compile →
FSDP/DDP (LoRA after TP, so that each adapter is split like the layer it adapts; CP swaps in the
attention across the sequence shards, which then runs on each rank's tp share of the heads). A quantized
base (QLoRA) is quantized once its weights are loaded, and FSDP wraps it after that: FSDP2 then
shards the quantized bytes (adapters/qlora.py). The model is built on the meta device, so no rank ever allocates the whole
model before it is split; weights are then materialised on the device (already sharded
under FSDP) and initialised from (seed, parameter name), which gives every layout the
weights of a single process. What comes back is a `ParallelModel` (parallel_model.py),
whose methods are everything the training loop asks of the layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..adapters.lora import apply_lora, init_lora, parse_targets
from ..adapters.qlora import quantize_base, quantized_names
from ..allocator import give_back_freed_memory
from ..config import Config
from ..layout import SPLIT_BACKWARD_SCHEDULES
from ..models.llama import LlamaConfig, Transformer, plain_name
from .context_parallel import apply_context_parallel
from .data_parallel import (
    apply_ddp,
    apply_fsdp,
    autocast_dtype,
    local_optimizer,
    zero1_optimizer,
)
from .expert_parallel import apply_ep, is_expert_weight
from .memory import NvmeAdamW, apply_activation_checkpointing
from .mesh import Mesh
from .parallel_model import ParallelModel
from .pipeline import make_stages, share_buffers, split_model
from .tensor_parallel import apply_tp


def build_parallel_model(model_cfg: LlamaConfig, cfg: Config, mesh: Mesh, device: torch.device,
                         load_weights: Callable[[nn.Module], None] | None = None) -> ParallelModel:
    """`load_weights(model)` copies pretrained weights in (shard by shard) after initialisation."""
    par, mem = cfg.parallel, cfg.memory
    with torch.device("meta"):
        model = Transformer(model_cfg)
    parts = None
    if par.pp > 1:
        parts = split_model(model, par.pp_schedule, mesh.rank("pp"), par.pp, par.pp_virtual_stages)
    if par.tp > 1:
        apply_tp(model, mesh.mesh["tp"], par.sequence_parallel)
    cp_group = mesh.group("cp") if par.cp > 1 else None
    if cp_group is not None:
        apply_context_parallel(model, cp_group, par.cp_mode)
    if par.ep > 1:
        apply_ep(model, mesh.sub("ep"))
    lora = cfg.lora
    if lora.rank:
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, parse_targets(lora.targets))
    apply_activation_checkpointing(model, mem.activation_checkpoint)
    if cfg.train.compile:
        for block in model.layers.values():
            block.compile()  # in place: parameter names stay those of the plain model
    if parts is not None:
        # Stages are views over the finished blocks (after TP, checkpointing, compile).
        parts = make_stages(parts)
    quantized = bool(lora.rank) and lora.base != "none"
    if quantized:
        _materialise_quantized(model, cfg, device, load_weights)
        if par.zero >= 2:
            _shard(model, parts, mesh, cfg)
    else:
        if par.zero >= 2:
            _shard(model, parts, mesh, cfg)
        # CPU offload keeps the sharded parameters in host memory; FSDP moves them per use.
        model.to_empty(device="cpu" if mem.offload == "cpu" else device)
        model.tie_weights()
        model.init_weights(cfg.train.seed, buffer_device=device)
        if load_weights is not None:
            load_weights(model)
    if lora.rank:
        init_lora(model, cfg.train.seed)
    if parts is not None:
        share_buffers(parts)
    module, manual_grad_group = model, None
    if par.zero < 2 and (parts is not None or par.tp > 1 or par.ep > 1):
        # DDP can wrap neither a pipeline stage (many micro-batch backwards per step
        # through one module) nor DTensor parameters (tp; ep's experts, which also average
        # over other ranks); gradients are averaged after the backward instead, in one flat
        # all-reduce per group, over the data- and context-parallel ranks (mesh.py).
        manual_grad_group = mesh.group("dp_cp") if mesh.size("dp_cp") > 1 else None
    elif par.zero < 2:
        # DDP must wrap materialised parameters (it broadcasts rank 0's at construction).
        module = apply_ddp(model, mesh, device, ignore=quantized_names(model))
    precision = cfg.train.precision
    return ParallelModel(module=module, model=model, mesh=mesh, device=device, pipeline=parts,
                         pp_schedule=par.pp_schedule, manual_grad_group=manual_grad_group,
                         expert_parallel=par.ep > 1, cp_group=cp_group,
                         amp_dtype=autocast_dtype(par.zero, precision), sharded_loss=par.tp > 1,
                         scaler=torch.amp.GradScaler(device.type) if precision == "fp16" else None)


def _materialise_quantized(model: Transformer, cfg: Config, device: torch.device, load_weights) -> None:
    """QLoRA: make each decoder layer's weights (initialised, then pretrained ones copied in) and
    quantize its base at once, a layer at a time, so that a rank never holds more than one
    layer in float; then the rest of the model (embedding, norm, head, buffers)."""
    seed = cfg.train.seed
    for key, block in model.layers.items():
        prefix = f"layers.{key}."
        block.to_empty(device=device)
        model.init_weights(seed, buffer_device=device, only=lambda name: plain_name(name).startswith(prefix))
        if load_weights is not None:
            load_weights(model, only=lambda name: name.startswith(prefix))
        quantize_base(block, cfg.lora.base)
    give_back_freed_memory()  # what quantizing freed, before the float parts and training take memory
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    model.tie_weights()
    outside = lambda name: not plain_name(name).startswith("layers.")  # noqa: E731
    model.init_weights(seed, buffer_device=device, only=outside)
    if load_weights is not None:
        load_weights(model, only=outside)


def _shard(model: Transformer, parts, mesh: Mesh, cfg: Config) -> None:
    par = cfg.parallel
    roots = parts.stage_modules if parts is not None else [model]
    # Expert parallel's experts are already split over ep and average over other ranks
    # than FSDP's (sync_gradients): FSDP leaves them alone.
    experts = {p for p in model.parameters() if is_expert_weight(p)}
    apply_fsdp(model, roots, mesh, par.zero, cfg.train.precision, cpu_offload=cfg.memory.offload == "cpu",
               split_backward=par.pp > 1 and par.pp_schedule in SPLIT_BACKWARD_SCHEDULES, ignored=experts)


def build_optimizer(model: nn.Module, cfg: Config, mesh: Mesh) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; ZeRO-1 shards its state over the data-parallel
    ranks and NVMe offload keeps its moments on disk."""
    # No weight decay on norms and biases (1-D tensors), as in the Llama recipes. Frozen
    # parameters (the base under LoRA) have no optimizer state at all.
    trained = [p for p in model.parameters() if p.requires_grad]
    # Expert parallel's experts get a group of their own: torch's fused and foreach kernels
    # take either DTensors or plain tensors in one call, not both.
    experts = [p for p in trained if is_expert_weight(p)]
    decay = [p for p in trained if p.dim() >= 2 and not is_expert_weight(p)]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.train.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if experts:
        groups.append({"params": experts, "weight_decay": cfg.train.weight_decay})
    hyper = dict(lr=cfg.train.lr, betas=(0.9, 0.95), eps=1e-8)
    optimizer_class = torch.optim.AdamW
    if cfg.memory.offload == "nvme":
        # Bound here, not passed with the hyperparameters: ZeRO-1 would copy those into
        # every parameter group, and so into checkpoints.
        optimizer_class = partial(NvmeAdamW, offload_dir=cfg.memory.offload_dir)
    elif _fused_adamw_runs_on(decay + no_decay):
        # One kernel per tensor instead of about a dozen: on a CPU thread 79 ms a step for a
        # 24M-parameter model against 300 ms for the default per-tensor loop, the same
        # results to one float32 ulp.
        optimizer_class = partial(torch.optim.AdamW, fused=True)
    if cfg.parallel.zero == 1:
        return zero1_optimizer(groups, mesh, optimizer_class, **hyper)
    return optimizer_class(groups, **hyper)


def _fused_adamw_runs_on(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW takes floating-point tensors on these device types only."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda", "xpu", "mps") for p in params)


def close_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Give back what the optimizer holds outside memory (NVMe offload files)."""
    close = getattr(local_optimizer(optimizer), "close", None)
    if close is not None:
        close()
