"""Test-only hooks of the trainer, read from the environment and inert unless set (in the
style of the trainer's `LLMSPLIT_FAULT`):

- `LLMSPLIT_DUMP_GRADS=DIR`: after step 1's gradients are synchronised (before clipping),
  every rank writes every parameter's whole gradient that it holds, by its plain model name
  (the names checkpoints use), to DIR/rank<R>.pt: how the tests compare a layout's gradients
  with one process's, parameter by parameter (tests/helpers.py `assert_same_gradients`).
  `LLMSPLIT_DUMP_GRADS_STEP=N` dumps step N's instead (LoRA: at step 1 every lora_a's
  gradient is zero, lora_b starting at zero).
- `LLMSPLIT_MUTATE=double_grads:RANK` (that rank's gradients ×2 before they are synchronised,
  its logged loss unchanged) and `LLMSPLIT_MUTATE=skip_dp_divide` (each rank's loss divided by
  all the batch's loss tokens instead of its data-parallel share: the gradients 1/dp of
  theirs): planted bugs, there only for the tests that prove the comparisons catch them.

The environment is read at each call, not at import: the tests' workers are forked from a
process that imported this module before their environment was set.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..models.llama import plain_name
from ..parallel.mesh import Mesh
from ..parallel.parallel_model import full_tensor

DUMP_VAR, DUMP_STEP_VAR, MUTATE_VAR = "LLMSPLIT_DUMP_GRADS", "LLMSPLIT_DUMP_GRADS_STEP", "LLMSPLIT_MUTATE"


def dump_gradients(model: torch.nn.Module, step: int, rank: int) -> None:
    """With LLMSPLIT_DUMP_GRADS=DIR, at step 1 (or LLMSPLIT_DUMP_GRADS_STEP), this rank's gradients made whole to
    DIR/rank<rank>.pt ({plain name: fp32 CPU tensor}; a pipeline rank writes its stages'
    parameters, a LoRA run its adapters). A collective under FSDP, tensor and expert parallel:
    every rank gathers every DTensor gradient it holds, in the same (named_parameters) order."""
    folder = os.environ.get(DUMP_VAR)
    if not folder or step != int(os.environ.get(DUMP_STEP_VAR, "1")):
        return
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[plain_name(name)] = full_tensor(p.grad.detach()).to("cpu", torch.float32).clone()
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(grads, Path(folder) / f"rank{rank}.pt")


def planted_loss(loss: torch.Tensor, rank: int) -> torch.Tensor:
    """`loss`, whose backward, with LLMSPLIT_MUTATE=double_grads:<rank>, doubles this rank's
    gradients (the value, so the logged loss, unchanged): a bug that only the gradients show."""
    if os.environ.get(MUTATE_VAR) != f"double_grads:{rank}":
        return loss
    return _DoubleGradient.apply(loss)


def loss_divisor(mesh: Mesh) -> int:
    """What the global batch's loss tokens are divided by to give one rank's share: the dp × cp
    ranks; with LLMSPLIT_MUTATE=skip_dp_divide the cp ranks only (the planted missing divide-by-dp)."""
    if os.environ.get(MUTATE_VAR) == "skip_dp_divide":
        return mesh.size("dp_cp") // mesh.size("dp")
    return mesh.size("dp_cp")


class _DoubleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 2
