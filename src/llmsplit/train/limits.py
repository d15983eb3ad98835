"""Stopping a run that needs more memory than it may have, with the numbers the command
line needs to explain it (`diagnose/oom.py`).

A worker's exception reaches the launching process only as the last line of its message
(`LaunchError`), so the measured peak and the limit travel in that line, in a fixed form
that `parse_oom` reads back.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from .metrics import peak_memory_bytes

_MARK = "llmsplit out of memory:"
_FORM = re.compile(_MARK + r" rank (\d+) peaked at (\d+) bytes, over the limit of (\d+) bytes \(([^)]*)\) at (.+)$", re.MULTILINE)


class MemoryLimitExceeded(RuntimeError):
    def __init__(self, rank: int, peak: int, limit: int, source: str, where: str):
        super().__init__(f"{_MARK} rank {rank} peaked at {peak} bytes, over the limit of {limit} bytes ({source}) "
                         f"at {where}")


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


def parse_oom(message: str) -> dict | None:
    """{"rank", "peak_bytes", "limit_bytes", "source", "where"} from a failure message, or None."""
    m = _FORM.search(message)
    if m is None:
        return None
    rank, peak, limit, source, where = m.groups()
    return {"rank": int(rank), "peak_bytes": int(peak), "limit_bytes": int(limit), "source": source,
            "where": where.strip()}
