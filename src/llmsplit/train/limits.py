"""Stopping a run that needs more memory than it may have, with the numbers the command
line needs to explain it (`diagnose/oom.py`). They travel as fields of the exception
(`details`), which the worker's error file carries to the launching process
(`launch.worker_entry`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .metrics import peak_memory_bytes


class MemoryLimitExceeded(RuntimeError):
    """`details`: {"rank", "peak_bytes", "limit_bytes", "source", "where"}, what the OOM
    explainer reads."""

    def __init__(self, rank: int, peak: int, limit: int, source: str, where: str):
        super().__init__(f"out of memory: rank {rank} peaked at {peak / 2**20:.0f} MiB, over the limit of "
                         f"{limit / 2**20:.0f} MiB ({source}) at {where}")
        self.details = {"rank": rank, "peak_bytes": peak, "limit_bytes": limit, "source": source, "where": where}


def check_memory_limit(limit: int | None, peaks: list[int], step: int) -> None:
    """After a step, with every rank's peak (`metrics.rank_peaks`): all ranks see the same
    numbers, so all of them stop together (a rank stopping alone would leave the others
    waiting in the next collective)."""
    if limit is None:
        return
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    if peaks[worst] > limit:
        raise MemoryLimitExceeded(worst, peaks[worst], limit, "memory.limit_bytes", f"step {step}")


def from_device_oom(limit: int | None, device: torch.device, where: str) -> MemoryLimitExceeded:
    """A CUDA out-of-memory error in the same form: the limit is memory.limit_bytes or the
    device's total memory; the peak is what the allocator reached before it failed."""
    total = torch.cuda.get_device_properties(device).total_memory
    source = "memory.limit_bytes" if limit is not None else f"{torch.cuda.get_device_name(device)} memory"
    return MemoryLimitExceeded(dist.get_rank(), peak_memory_bytes(device), limit or total, source, where)
