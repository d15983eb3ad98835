"""`llmsplit train --auto`: confirm by trial the largest micro-batch that fits.

The planner predicts a micro-batch; real memory can still differ (allocator slack, a
kernel's workspace). Like Accelerate's `find_executable_batch_size`, the workers try,
but they start from the prediction and go both ways: up while the next larger
micro-batch still fits, down while the current one does not.

A trial runs one whole step's forward and backward (every micro-batch, with the real
gradient synchronisation) and no optimizer step, so it changes neither the weights nor
the optimizer. What the first optimizer step will add, AdamW's two moments of every
local parameter, is counted on top of the trial's peak. A micro-batch fits when no rank
raised out-of-memory and every rank's peak + moments stays under the limit:
`memory.limit_bytes` when set (which makes the trial testable on a CPU), otherwise the
device's total memory less the explainer's safety margin. All ranks decide together.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist

from .metrics import peak_memory_bytes, reset_peak_memory

MARGIN = 0.08  # the share of device memory kept free, as diagnose/oom.py keeps


def candidates(per_rank: int) -> list[int]:
    """Micro-batches the step can be cut into: the divisors of the per-rank batch."""
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def memory_limit(limit_bytes: int | None, device: torch.device) -> int | None:
    if limit_bytes is not None:
        return limit_bytes
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * (1 - MARGIN))
    return None  # a CPU without a limit: nothing to confirm


def moment_bytes(params) -> int:
    """AdamW's exp_avg and exp_avg_sq for the parameters this rank holds (fp32 like them)."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "meta":
            total += 2 * local.numel() * local.element_size()
    return total


def search(start: int, options: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest option that fits, found from `start`: up while the next fits, down
    while the current does not. None when not even the smallest fits."""
    i = options.index(start)
    if fits(options[i]):
        while i + 1 < len(options) and fits(options[i + 1]):
            i += 1
        return options[i]
    while i > 0:
        i -= 1
        if fits(options[i]):
            return options[i]
    return None


def confirm_micro_batch(start: int, per_rank: int, limit: int, device: torch.device, extra_bytes: int,
                        run_step: Callable[[int], None], clear: Callable[[], None]) -> int | None:
    """Try micro-batches from `start`; `run_step(mb)` runs one step's forward and backward,
    `clear()` drops its gradients. Returns the micro-batch to train with (None: none fits)."""
    rank0 = dist.get_rank() == 0

    def fits(mb: int) -> bool:
        reset_peak_memory(device)
        oom = 0
        try:
            run_step(mb)
        except torch.OutOfMemoryError:
            oom = 1
        clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        verdict = torch.tensor([oom, peak_memory_bytes(device) + extra_bytes], dtype=torch.int64,
                               device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        ok = not verdict[0].item() and verdict[1].item() <= limit
        if rank0:
            state = "out of memory" if verdict[0].item() else f"peak {verdict[1].item() / 2**20:.0f} MiB"
            print(f"llmsplit: --auto trial micro_batch={mb}: {state} against {limit / 2**20:.0f} MiB -> "
                  f"{'fits' if ok else 'does not fit'}", file=sys.stderr, flush=True)
        return ok

    chosen = search(start, candidates(per_rank), fits)
    reset_peak_memory(device)
    return chosen
