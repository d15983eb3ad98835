"""What a training loop asks of a layout, as methods of the model that `apply.build_parallel_model`
returns: which contexts a forward and backward run in, when gradients are synchronised,
how they are clipped and stepped, and one pipeline step. The loop then reads the same
whatever the layout (DDP, ZeRO-1, FSDP, tensor and pipeline parallel in any mix).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..models.llama import Transformer
from .data_parallel import allreduce_gradients, no_grad_sync
from .expert_parallel import is_expert_weight
from .mesh import Mesh
from .pipeline import PipelineParts, build_schedule


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the whole value (a DTensor under tensor parallel or FSDP)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class ParallelModel:
    """`model` holds this rank's parameters under the names of the full model (optimizer,
    clipping, checkpoints use it); `module` is what a non-pipelined forward calls
    (DDP/FSDP-wrapped); `pipeline` is set when pp > 1 and `schedule` once the trainer
    gave it its loss (`build_schedule`)."""

    module: nn.Module
    model: Transformer
    mesh: Mesh
    device: torch.device
    pipeline: PipelineParts | None = None
    pp_schedule: str = "1f1b"
    # Set when neither DDP nor FSDP averages the gradients (zero 0/1 with tp or pp > 1):
    # `sync_gradients` then all-reduces them over this group after the backward passes.
    manual_grad_group: object | None = None
    # parallel.ep > 1: the experts' gradients average over the expert_dp ranks (expert_parallel.py).
    expert_parallel: bool = False
    # parallel.cp > 1: the group whose ranks each hold a share of every row (context_parallel.shard_rows).
    cp_group: object | None = None
    # The dtype forward passes autocast to: DDP computes under autocast; FSDP casts the
    # gathered parameters itself (its MixedPrecisionPolicy), so it has none.
    amp_dtype: torch.dtype | None = None
    # Under tensor parallel the logits stay split over the vocabulary.
    sharded_loss: bool = False
    # fp16 only. With FSDP the gradients are DTensor shards; DTensor max-reduces the
    # scaler's found-inf flag over the shards, so every rank skips an overflowing step together.
    scaler: torch.amp.GradScaler | None = None
    schedule: object | None = None
    n_microbatches: int = 0

    # ------------------------------------------------------------ forward and backward

    def forward_context(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()

    def loss_context(self):
        """Around the forward, the loss and its backward: with tensor parallel, loss_parallel
        computes the cross-entropy on the vocabulary shards (both passes must run inside it)."""
        if not self.sharded_loss:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @contextmanager
    def micro_batch_context(self, last: bool):
        """Around one micro-batch's forward, loss and backward. Before the step's last one
        gradients accumulate locally: no all-reduce (DDP) or reduce-scatter (FSDP) until then."""
        with (nullcontext() if last else no_grad_sync(self.module)), self.loss_context():
            yield

    def backward(self, loss: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Backward of the (fp16: scaled) loss, plus `extra` (a MoE load-balancing term, the same
        on every tp rank) where given; returns the loss's value as a plain tensor."""
        total = loss
        if extra is not None:
            if hasattr(loss, "device_mesh"):  # loss_parallel's loss is a replicated DTensor
                from torch.distributed.tensor import DTensor, Replicate

                extra = DTensor.from_local(extra, loss.device_mesh, [Replicate()], run_check=False)
            total = loss + extra
        (self.scaler.scale(total) if self.scaler else total).backward()
        return full_tensor(loss.detach())

    def build_schedule(self, n_microbatches: int, loss_fn: Callable) -> None:
        """The pipeline schedule over `n_microbatches` per step, with the trainer's loss."""
        scale = self.scaler.scale if self.scaler else (lambda x: x)
        self.n_microbatches = n_microbatches
        self.schedule = build_schedule(self.pipeline, self.pp_schedule, n_microbatches,
                                       lambda out, target: scale(loss_fn(out, target)), self.device,
                                       self.mesh.group("pp"))

    def pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None,
                      forward_only: bool = False, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward (or, `forward_only`, forward alone) of this rank's batch through
        the schedule; the sum of the micro-batch losses this rank saw (only the last stage sees
        any). `positions` (packed rows, or a context-parallel share's global positions) and
        `doc_ids` (a share's documents) go to every stage, each micro-batch its own rows."""
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.pipeline.has_last_stage else {}
        for name, value in (("positions", positions), ("doc_ids", doc_ids)):
            if value is not None:
                kwargs[name] = value
        args = (inputs,) if self.pipeline.has_first_stage else ()
        with self.loss_context(), self.forward_context():
            if forward_only:
                self.schedule.eval(*args, return_outputs=False, **kwargs)
            else:
                self.schedule.step(*args, return_outputs=False, **kwargs)
        loss_sum = torch.zeros((), device=self.device)
        for loss in losses:
            loss_sum += full_tensor(loss.detach())
        if self.scaler is not None:
            loss_sum /= self.scaler.get_scale()
        return loss_sum

    # ------------------------------------------------------------ after the backward passes

    def sync_gradients(self) -> None:
        """Average the gradients over data parallel where no wrapper did it during backward."""
        if not self.expert_parallel:
            if self.manual_grad_group is not None:
                allreduce_gradients(self.model.parameters(), self.manual_grad_group)
            return
        # Each expert's gradient already sums the tokens of its ep group: summed over the
        # expert_dp ranks and divided by the whole dp (× cp) degree, it is the global batch's mean.
        params = list(self.model.parameters())
        if self.manual_grad_group is not None:  # else FSDP reduced the rest during backward
            allreduce_gradients([p for p in params if not is_expert_weight(p)], self.manual_grad_group)
        allreduce_gradients([p for p in params if is_expert_weight(p)], self.mesh.group("expert_dp"),
                            divisor=self.mesh.size("dp_cp"))

    def clip_gradients(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip by the global norm of the true gradients (loss scaling undone first) and
        return that norm. Under pipeline parallel each rank holds only its stages'
        gradients, so the squared norms are summed over the pipeline group."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        params = [p for p in self.model.parameters() if p.grad is not None]
        # torch's norm kernels take DTensors or plain tensors in one call, not both (ep's experts).
        kinds = [kind for kind in ([p for p in params if is_expert_weight(p) == e] for e in (False, True)) if kind]
        norms = [full_tensor(torch.nn.utils.get_total_norm([p.grad for p in kind])) for kind in kinds]
        total = torch.stack(norms).norm() if len(norms) > 1 else norms[0]
        if self.pipeline is not None:
            total = total.pow(2)
            dist.all_reduce(total, group=self.mesh.group("pp"))
            total = total.sqrt()
        if max_norm > 0:
            for kind in kinds:
                torch.nn.utils.clip_grads_with_norm_(kind, max_norm, total)
        return total

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def zero_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Free the gradients, except that a pipeline on CPU zeroes them in place.

        Freed, they go back to the OS (each is one mapping above the 4 MiB mmap threshold)
        and the next step's first backward of every stage page-faults them in again: ~90 ms
        per 190 MB on a 2-core VM, on the pipeline's critical path while the other stages
        wait (gpipe m=8 on the 101M model: bubble 0.160 -> 0.128, theory 0.111). The peak
        hardly moves (+20 MiB there), since gradients exist from the first backward to the
        optimizer step anyway. CUDA's caching allocator keeps freed memory, so there freeing
        costs nothing. DTensor gradients (e.g. the Partial ones of sequence-parallel norms)
        are freed all the same: their sharding cannot be zeroed in place."""
        if self.pipeline is None or self.device.type != "cpu":
            optimizer.zero_grad(set_to_none=True)
            return
        kept = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if type(p.grad) is torch.Tensor:
                    kept.append(p.grad)
                else:
                    p.grad = None
        if kept:
            torch._foreach_zero_(kept)

    def global_loss(self, loss_sum: torch.Tensor) -> float:
        """The mean loss over the global batch from this rank's share (a collective): each of the
        dp × cp ranks' loss is its tokens' sum over a dp × cp-th of the batch's loss tokens."""
        return self.global_sum(loss_sum).item() / self.mesh.size("dp_cp")

    def global_sum(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed in place over what the loss sees apart: the pipeline's stages (only the
        last computes a loss), the data-parallel ranks and the context-parallel ranks (each
        a share of every sequence; tensor-parallel ranks hold the same value). A collective."""
        if self.pipeline is not None:
            dist.all_reduce(t, group=self.mesh.group("pp"))
        dist.all_reduce(t, group=self.mesh.group("dp_cp"))
        return t
