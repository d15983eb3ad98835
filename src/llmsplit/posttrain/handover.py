"""The weight hand-over from the training layout to the engine's, in memory, never through a
file: the one function GRPO calls after each optimizer step (ARCHITECTURE.md).

Training may split the model any way the layout allows (DDP, ZeRO-1/2/3, hybrid, tensor
parallel, pipeline stages, LoRA); the engine of every rank holds the whole model in one process (each rank
generates its share of the step's completions). So each parameter is gathered whole
(`full_tensor`: an all-gather under FSDP or tensor parallel, nothing under DDP) one at a time,
in the same order on every rank, and copied into the engine's weights in place. With LoRA only
the adapters move: the frozen base reaches the engine once, when it is built (a QLoRA base
dequantized as training computes with it: the engine holds it in fp32).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..adapters.lora import is_adapter
from ..adapters.qlora import dequantize, is_quantized
from ..infer.api import InferConfig, LoadedModel, load
from ..models.llama import plain_name
from ..parallel.parallel_model import full_tensor


class TrainedWeights:
    """Whole tensors by plain name as a weights reader (io/weights.py's interface), for `load`."""

    def __init__(self, config, tokenizer, eos_ids: set[int], state: dict[str, torch.Tensor]):
        self.config, self.tokenizer, self.eos_ids, self._state = config, tokenizer, set(eos_ids), state
        self.dtype = torch.float32

    def names(self) -> list[str]:
        return list(self._state)

    def read(self, name: str, shard=None) -> torch.Tensor:
        assert shard is None, "the engine of the hand-over holds the whole model"
        return self._state[name if name in self._state else "tok_embeddings.weight"]  # a tied head: one tensor


@torch.no_grad()
def gather_weights(model: torch.nn.Module, adapters: bool, stages=None) -> dict[str, torch.Tensor]:
    """The training model's parameters whole, by plain name, on this rank's device: the LoRA
    adapters (`adapters`) or every other parameter and buffer. A collective under FSDP and
    tensor parallel: every rank calls it, and walks the parameters in the same order; under
    pipeline parallel (`stages`: the pipeline's process group) every stage's too."""
    state = _this_stage(model, adapters)
    return _across_stages(state, stages) if stages is not None and dist.get_world_size(stages) > 1 else state


def _this_stage(model: torch.nn.Module, adapters: bool) -> dict[str, torch.Tensor]:
    state = {}
    for name, p in model.named_parameters():
        if is_adapter(name) == adapters:
            state[plain_name(name)] = _whole_float(p.detach())
    if not adapters:
        for name, b in model.named_buffers():
            if not name.endswith(("rope_cos", "rope_sin")):  # tables the engine builds for its own context
                state[plain_name(name)] = full_tensor(b).float()
    return state


def _across_stages(state: dict[str, torch.Tensor], stages) -> dict[str, torch.Tensor]:
    """Every pipeline stage's tensors on every rank of `stages`: the names and shapes first
    (small objects), then each tensor broadcast from the first stage holding it, in one order
    on every rank (a weight two stages hold, a tied embedding and head, comes from the first)."""
    held = [None] * dist.get_world_size(stages)
    dist.all_gather_object(held, {name: (tuple(t.shape), t.dtype) for name, t in state.items()}, group=stages)
    device = next(iter(state.values())).device if state else torch.device("cpu")
    me, whole = dist.get_rank(stages), {}
    for stage, names in enumerate(held):
        for name, (shape, dtype) in names.items():
            if name in whole:
                continue
            t = state[name] if stage == me else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=dist.get_global_rank(stages, stage), group=stages)
            whole[name] = t
    return whole


def _whole_float(p: torch.Tensor) -> torch.Tensor:
    """`p`'s whole value in fp32. A QLoRA base (NF4 or int8) is dequantized as the training
    forward computes with it, to the bit (the engine's own conversion of an NF4Tensor rounded
    differently: 7.6e-7 off, measured), shard by shard before a DTensor's gather (torchao's int8
    weight has no all-gather; both dequantize block by block or row by row, so a shard's values
    are the whole tensor's)."""
    if not is_quantized(p):
        return full_tensor(p).float()
    local = getattr(p, "_local_tensor", None)
    if local is None:
        return dequantize(p)
    return DTensor.from_local(dequantize(local), p.device_mesh, p.placements, shape=p.shape,
                              stride=p.stride()).full_tensor()


class PolicyEngine:
    """The engine of one rank, holding the policy as training last left it."""

    def __init__(self, model: torch.nn.Module, model_cfg, tokenizer, eos_ids: set[int], lora_scale: float | None,
                 config: InferConfig, reference: bool, stages=None):
        """`reference`: keep the policy as it is now as the reference of the KL term; under LoRA
        that is the base the engine holds anyway, else a second, frozen engine model. `stages`:
        the pipeline's process group (pp > 1), whose stages' layers the engine gathers too."""
        self.model, self.lora_scale, self.stages = model, lora_scale, stages
        # Copies: under DDP the gathered tensors are the training parameters themselves.
        base = {name: t.clone() for name, t in gather_weights(model, adapters=False, stages=stages).items()}
        source = TrainedWeights(model_cfg, tokenizer, eos_ids, base)
        self.loaded: LoadedModel = load(None, config, source=source)
        self.reference: LoadedModel | None = None
        if reference and lora_scale is None:
            source._state = {name: t.clone() for name, t in base.items()}
            self.reference = load(None, config, source=source)
        del base, source
        self.adapter = 0  # the served adapter sequences run with: 1 (the policy's) under LoRA
        if lora_scale is not None:
            self.loaded.runner.serve_adapters(["policy"], [gather_weights(model, adapters=True, stages=stages)],
                                              [lora_scale])
            self.adapter = 1

    def refresh(self) -> None:
        """After an optimizer step: the trained weights into the engine (a collective)."""
        if self.lora_scale is not None:
            self.loaded.runner.replace_weights({}, gather_weights(self.model, True, self.stages), self.lora_scale)
        else:
            self.loaded.runner.replace_weights(gather_weights(self.model, False, self.stages))

    def reference_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The reference's logits [b, s, vocab]: under LoRA the engine's own base (the adapters
        off: no second copy of the weights), else the frozen copy."""
        runner = (self.reference or self.loaded).runner
        return runner.forward(tokens, None, last_only=False)


def dump_engine_weights(policy: PolicyEngine, step: int, rank: int) -> None:
    """`LLMSPLIT_DUMP_ENGINE=FOLDER` (tests only): rank 0 writes the weights its engine generates
    with after step `step` to FOLDER/engine-step{step}.pt, to compare with the checkpoint of
    that step (under LoRA the adapter as the engine applies it: lora_a, and lora_b x scale)."""
    folder = os.environ.get("LLMSPLIT_DUMP_ENGINE")
    if not folder or rank != 0:
        return
    runner = policy.loaded.runner
    state = {name: p.detach().clone() for name, p in runner.model.named_parameters()}
    if runner.bank is not None:
        for layer, (a, b, _) in zip(runner.bank.layers, runner.bank.stacked):
            state[f"{layer}.lora_a"], state[f"{layer}.lora_b_scaled"] = a.clone(), b.clone()
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(state, Path(folder) / f"engine-step{step}.pt")
