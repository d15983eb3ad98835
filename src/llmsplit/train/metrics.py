"""What a rank holds and how much memory it peaked at."""

from __future__ import annotations

import torch

from ..io.procfs import proc_bytes
from ..models.moe import MoE
from ..parallel.data_parallel import local_optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _stored(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold `t`'s bytes: a tensor subclass (QLoRA's quantized base, a
    wrapper with no storage of its own) keeps them in its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _stored(getattr(t, name))]
    return [t]


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in (inner for t in tensors if t is not None for inner in _stored(_local(t))):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:  # tied weights count once
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes of parameters, gradients and optimizer state that this rank actually holds
    in memory; optimizer state kept in files on disk (NVMe offload) is counted apart."""
    params = list(model.parameters())
    local = local_optimizer(optimizer)  # ZeRO-1: only this rank's share has state
    on_disk = getattr(local, "offloaded_tensors", list)()
    disk_ids = {id(t) for t in on_disk}
    optim = [v for state in local.state.values() for v in state.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in disk_ids]
    experts = [getattr(m, w) for m in model.modules() if isinstance(m, MoE) for w in ("w1", "w3", "w2")]
    return {"param_bytes": tensor_bytes(params),
            "expert_param_bytes": tensor_bytes(experts),  # the routed experts' share of param_bytes
            "grad_bytes": tensor_bytes(p.grad for p in params),
            "optim_bytes": tensor_bytes(optim),
            "offloaded_bytes": tensor_bytes(on_disk)}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:  # resets VmHWM to the current resident size (Linux)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak. CPU: the process's peak resident size (VmHWM)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return proc_bytes("/proc/self/status", "VmHWM") or 0


def rank_peaks(device: torch.device) -> list[int]:
    """Every rank's `peak_memory_bytes`, on every rank."""
    import torch.distributed as dist

    mine = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [int(t.item()) for t in gathered]
