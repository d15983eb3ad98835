"""Data parallel wrappers, one per `parallel.zero` level.

- zero 0: DDP, everything replicated.
- zero 1: DDP for the gradients + torch's `ZeroRedundancyOptimizer`, which gives each
  data-parallel rank the optimizer state of a share of the parameters and broadcasts the
  updated parameters after the step.
- zero 2 / 3: FSDP2 `fully_shard`, one unit per transformer block plus the root. Zero 2
  keeps the gathered parameters from forward to backward (`reshard_after_forward=False`),
  zero 3 frees them after each block's forward. With `dp_replicate > 1` the mesh is 2-D
  (replicate × shard): hybrid sharding.

Every wrapper reduces over the data-parallel ranks together with the context-parallel ones
(the mesh's dp_cp / dp_shard_cp): cp ranks hold the same weights and each computes the
gradients of its share of the tokens.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .mesh import Mesh

LOW_PRECISION = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def _loaded(module: str, name: str):
    """`module.name` if that module is already imported, else None. FSDP and ZeRO-1 are
    imported only by the runs that use them (torch.distributed.optim costs ~1 s of start-up,
    jit-compiling its functional optimizers); an object of a class whose module was never
    imported cannot exist, so the isinstance checks below need no import."""
    return getattr(sys.modules.get(module), name, None)


def apply_ddp(model: nn.Module, mesh: Mesh, device: torch.device, ignore: list[str] = ()) -> nn.Module:
    """Replicate the model over the data- and context-parallel group; gradients are averaged in buckets
    that overlap with the backward pass. `ignore`: parameters DDP neither broadcasts nor
    reduces (a quantized frozen base, the same on every rank by construction)."""
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    return DistributedDataParallel(
        model,
        process_group=mesh.group("dp_cp"),
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


def apply_fsdp(model: nn.Module, roots: list[nn.Module], mesh: Mesh, zero: int, precision: str,
               cpu_offload: bool, split_backward: bool = False, ignored: set | None = None) -> nn.Module:
    """Shard `model` (still on the meta device) in place; weights are materialised later,
    already sharded, so no rank ever holds the whole model. `roots` are the modules that
    are called: the model itself, or each pipeline stage (whose embedding, norm and head
    become that stage's root group).

    `split_backward`: a pipeline schedule runs a micro-batch's weight-gradient pass after
    later forwards (zbv, dualpipev). zero 3 then keeps a stage's parameters gathered from
    forward to its last weight-gradient pass of the step, as zero 2 does: resharding after
    each forward freed them while a weight-gradient pass was still due, and its gradients
    were lost (zbv, dp 2 × pp 2: losses off the single process from the second step). The
    schedule reshards each stage after its last use in the step. `ignored`: parameters FSDP
    neither shards nor synchronises (expert parallel's experts)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    assert zero in (2, 3), zero
    dp_mesh = mesh.hybrid if mesh.hybrid is not None else mesh.sub("dp_shard_cp")
    kwargs = {"mesh": dp_mesh, "mp_policy": mixed_precision_policy(precision), "ignored_params": ignored or None}
    if cpu_offload:
        # Pinned host memory needs an accelerator; a CPU-only build refuses it.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    reshard = zero == 3 and not split_backward
    units = list(model.layers.values()) + list(roots)
    # The root holds the embedding, final norm and output layer; FSDP never frees the
    # root's parameters after forward (they are needed first in backward).
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard, **kwargs)
    if torch.distributed.get_backend(mesh.group("dp_shard_cp")) == "gloo":
        reduce_scatter = _gloo_reduce_scatter()  # stateless: one for every unit
        for unit in units:
            unit.set_custom_reduce_scatter(reduce_scatter)
    return model


def _gloo_reduce_scatter():
    """FSDP's gradient reduce-scatter as one `reduce` per destination rank. gloo has no
    reduce-scatter of its own: on a 2-core machine, 2 processes, 50 MB of fp32, its
    `reduce_scatter_tensor` took 75 ms where one reduce per rank took 48 ms."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class GlooReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            n, me = group.size(), group.rank()
            chunks = input_tensor.view(n, -1)  # FSDP lays the input out rank by rank
            works = [dist.reduce(chunks[i], dst=dist.get_global_rank(group, i), op=op, group=group, async_op=True)
                     for i in range(n)]
            for work in works:
                work.wait()
            output_tensor.copy_(chunks[me].view_as(output_tensor))
            return None

    return GlooReduceScatter()


def mixed_precision_policy(precision: str) -> "torch.distributed.fsdp.MixedPrecisionPolicy":
    """Compute in the low-precision dtype, keep fp32 master weights and reduce gradients
    in fp32 (summing many low-precision shards loses bits)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=LOW_PRECISION[precision], reduce_dtype=torch.float32)


def autocast_dtype(zero: int, precision: str) -> torch.dtype | None:
    """The dtype the trainer autocasts to: DDP computes under autocast; FSDP casts the
    gathered parameters itself (its MixedPrecisionPolicy), so it needs none."""
    return None if zero >= 2 else LOW_PRECISION[precision]


def zero1_optimizer(param_groups: list[dict], mesh: Mesh, optimizer_class,
                    **defaults) -> "torch.distributed.optim.ZeroRedundancyOptimizer":
    """Each data- (and context-) parallel rank keeps the optimizer state of about 1/(dp × cp) of
    the parameters (whole tensors, balanced by size) and broadcasts the ones it updated."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(param_groups, optimizer_class=optimizer_class,
                                   process_group=mesh.group("dp_cp"), **defaults)


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's inner optimizer (over this
    rank's share of the parameters), or the optimizer itself."""
    zero1 = _loaded("torch.distributed.optim", "ZeroRedundancyOptimizer")
    return optimizer.optim if zero1 is not None and isinstance(optimizer, zero1) else optimizer


@contextmanager
def no_grad_sync(model: nn.Module):
    """Accumulate gradients locally for a micro-batch that is not the last of the step:
    no all-reduce (DDP) or reduce-scatter (FSDP) until the last one."""
    fsdp_module = _loaded("torch.distributed.fsdp", "FSDPModule")
    if fsdp_module is not None and isinstance(model, fsdp_module):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:  # gradients are averaged by `allreduce_gradients` after the whole step
        yield


def allreduce_gradients(params, group, divisor: int | None = None) -> None:
    """Average gradients over the data-parallel group after the step's backward passes,
    where DDP cannot be used (see apply.py): one flat all-reduce per dtype, the same
    bytes as DDP's buckets without the overlap with backward. `divisor`: divide the sum
    by this instead of the group's size (expert parallel's experts)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    world = dist.get_world_size(group)
    divisor = divisor or world
    if divisor == 1:
        return
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = _flatten_dense_tensors(same)
        if world > 1:
            dist.all_reduce(flat, group=group)
        flat /= divisor
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)
