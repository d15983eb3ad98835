"""Memory savers: activation checkpointing and optimizer-state offload to NVMe.

(CPU offload of sharded parameters, gradients and optimizer state is FSDP2's own
`CPUOffloadPolicy`, set where FSDP is applied: data_parallel.apply_fsdp.)
"""

from __future__ import annotations

import fcntl
import mmap
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# ---------------------------------------------------------------- activation checkpointing

# Outputs of these ops are kept by `selective` checkpointing: the matmuls are the
# expensive part of a block; norms, RoPE, SiLU, residual adds and attention (whose saved
# tensors grow with the sequence) are recomputed in backward.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap every transformer block in place. `full` keeps only each block's input and
    recomputes the block in backward; `selective` also keeps the matmul outputs."""
    if mode == "none":
        return
    assert mode in ("full", "selective"), mode
    extra = {}
    if mode == "selective":
        extra["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_matmuls)
    for name, block in list(model.layers.items()):
        # Non-reentrant checkpointing: works with FSDP's hooks and keyword arguments.
        # RNG state need not be saved: the blocks have no dropout.
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **extra)


# ---------------------------------------------------------------- NVMe offload of optimizer state

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor shaped like `param`: a DTensor with the same sharding when
    `param` is one, so the optimizer's arithmetic and the checkpoint see matching types."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return local


class NvmeAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in a memory-mapped file on disk (one file per rank).

    torch's own AdamW does the arithmetic, one group of parameters (about `group_bytes`
    of state) at a time, on views into the file. After each group the pages are handed
    back to the kernel (`MADV_DONTNEED`; it writes dirty pages to the file), so at most one
    group's state is resident in this process (plus what the kernel maps around a page
    fault from its page cache). The parameters themselves are the fp32
    master weights: FSDP gathers from them every step, so they stay in memory.
    """

    _ALIGN = 64  # bytes; keeps every view aligned for vectorised kernels

    def __init__(self, params, offload_dir: str | os.PathLike, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, group_bytes: int = 64 << 20):
        # Exactly torch AdamW's group keys, so that checkpoints move between this
        # optimizer and a plain AdamW in either direction.
        defaults = torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay).defaults
        super().__init__(params, dict(defaults))
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.path = Path(offload_dir) / f"llmsplit-optim-rank{rank}.bin"
        layout, chunks, size = self._plan(group_bytes)
        # The file is scratch space: it is rebuilt from zeros or from a checkpoint at every
        # start, so a file left by a crashed run is simply reused. The lock stops two live
        # runs from sharing it.
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise RuntimeError(f"{self.path} is in use by another run; give each run its own "
                               f"memory.offload_dir") from None
        # Truncated only once locked (the owner may have it mapped), then regrown sparse:
        # zeros, and no disk blocks until written.
        os.ftruncate(self._fd, 0)
        os.ftruncate(self._fd, max(size, 1))
        self._mmap = mmap.mmap(self._fd, max(size, 1), flags=mmap.MAP_SHARED)
        self._disk: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for p, (offset, local) in layout.items():
            n = local.numel()
            views = {}
            for i, key in enumerate(("exp_avg", "exp_avg_sq")):
                start = offset + i * self._aligned(n * local.element_size())
                # An empty shard (more ranks than rows) has nothing to put on disk.
                flat = (torch.frombuffer(self._mmap, dtype=local.dtype, count=n, offset=start) if n
                        else torch.empty(0, dtype=local.dtype))
                views[key] = _like(p, flat.view(local.shape))
            self._disk[p] = views
        # One torch AdamW per group; its state dicts are ours, so it updates the views in place.
        # Groups are referred to by index: load_state_dict replaces the group dicts.
        self._groups: list[tuple[int, torch.optim.AdamW, int, int]] = []
        for index, params, start, end in chunks:
            self._groups.append((index, torch.optim.AdamW(params, lr=lr), start, end))
        self._bind_state(fresh=True)

    def _aligned(self, nbytes: int) -> int:
        return -(-nbytes // self._ALIGN) * self._ALIGN

    def _plan(self, group_bytes: int):
        page = mmap.ALLOCATIONGRANULARITY
        layout, chunks, offset = {}, [], 0
        for index, group in enumerate(self.param_groups):
            current, start = [], offset
            for p in group["params"]:
                local = _local(p)
                need = 2 * self._aligned(local.numel() * local.element_size())
                if current and offset - start + need > group_bytes:
                    chunks.append((index, current, start, offset))
                    offset = -(-offset // page) * page  # madvise works on whole pages
                    current, start = [], offset
                layout[p] = (offset, local)
                current.append(p)
                offset += need
            if current:
                chunks.append((index, current, start, offset))
            offset = -(-offset // page) * page
        return layout, chunks, offset

    def _bind_state(self, fresh: bool) -> None:
        for p, views in self._disk.items():
            # A loaded step is copied: a state dict hands out references to its source's tensors.
            step = torch.zeros((), dtype=torch.float32) if fresh else self.state[p]["step"].clone()
            self.state[p] = {"step": step, **views}
        for _, inner, _, _ in self._groups:
            for p in inner.param_groups[0]["params"]:
                inner.state[p] = self.state[p]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "NvmeAdamW does not take a closure"
        for index, inner, start, end in self._groups:
            inner.param_groups[0].update({k: v for k, v in self.param_groups[index].items() if k != "params"})
            staged = self._stage(inner)
            inner.step()
            self._unstage(inner, staged)
            self._release(start, end)

    def _stage(self, inner: torch.optim.AdamW) -> list:
        """Off-CPU parameters: copy the group's moments to the parameter's device for the
        step (and back afterwards); on a CPU the views are used directly."""
        staged = []
        for p in inner.param_groups[0]["params"]:
            if p.device.type != "cpu":
                views = self._disk[p]
                inner.state[p] = {"step": self.state[p]["step"],
                                  **{k: v.to(p.device, non_blocking=True) for k, v in views.items()}}
                staged.append(p)
        return staged

    def _unstage(self, inner: torch.optim.AdamW, staged: list) -> None:
        for p in staged:
            for key, view in self._disk[p].items():
                _local(view).copy_(_local(inner.state[p][key]))
            inner.state[p] = self.state[p]

    def _release(self, start: int, end: int) -> None:
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def load_state_dict(self, state_dict: dict) -> None:
        """Loaded moments are copied into the file; the state keeps pointing at it."""
        super().load_state_dict(state_dict)
        for p, views in self._disk.items():
            loaded = self.state[p]
            for key, view in views.items():
                if key in loaded and loaded[key] is not view:
                    _local(view).copy_(_local(loaded[key]))
        self._bind_state(fresh=False)
        self._release(0, len(self._mmap))

    def offloaded_tensors(self) -> list[torch.Tensor]:
        return [v for views in self._disk.values() for v in views.values()]

    def close(self) -> None:
        """Remove the file (the state that matters is in the checkpoints by now)."""
        self.path.unlink(missing_ok=True)
        self._disk.clear()
        self.state.clear()
        for _, inner, _, _ in self._groups:
            inner.state.clear()
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when the process ends
        os.close(self._fd)
