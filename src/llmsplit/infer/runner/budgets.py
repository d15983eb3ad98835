"""Memory budgets of this machine's devices for placement (plan/placement.py): --max-memory
when given, else what each device reports free. Not pure: it asks the machine."""

from __future__ import annotations

import os

from ...errors import ConfigError
from ...io.procfs import proc_bytes
from ...plan.placement import GiB, kind, parse_max_memory, parse_size


def available_cpu_bytes() -> int:
    return proc_bytes("/proc/meminfo", "MemAvailable") or 8 * GiB


def detect_budgets(max_memory=None, offload_dir=None) -> dict[str, int | None]:
    """Budgets from --max-memory, else from LLMSPLIT_GPU_COUNT / LLMSPLIT_GPU_MEMORY_LIMIT and
    the free memory each device reports; "disk" only when an offload folder is given."""
    import torch

    if max_memory:
        budgets = parse_max_memory(max_memory)
        budgets = {d: budgets[d] for d in sorted(budgets, key=lambda d: (kind(d) in ("cpu", "disk"), d == "disk", d))}
    else:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if os.environ.get("LLMSPLIT_GPU_COUNT"):
            try:
                count = min(count, int(os.environ["LLMSPLIT_GPU_COUNT"]))
            except ValueError:
                raise ConfigError(f"LLMSPLIT_GPU_COUNT={os.environ['LLMSPLIT_GPU_COUNT']!r} is not a number") from None
        limit = os.environ.get("LLMSPLIT_GPU_MEMORY_LIMIT")
        limit = parse_size(limit, "LLMSPLIT_GPU_MEMORY_LIMIT") if limit else None
        budgets = {}
        for i in range(count):
            free, _ = torch.cuda.mem_get_info(i)
            budgets[f"cuda:{i}"] = min(free, limit) if limit else free
        budgets["cpu"] = available_cpu_bytes()
    if offload_dir is not None:
        budgets["disk"] = None
    return budgets
