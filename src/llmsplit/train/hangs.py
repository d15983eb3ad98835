"""Turning a collective timeout into a message that names the rank(s) that did not arrive.

A timed-out gloo collective only says "Timed out waiting 600000ms for recv operation",
from whichever rank noticed first, and it closes that group's connections, so the group
cannot be asked anything afterwards. A second gloo group, made at start-up and otherwise
unused, stays healthy: after a timeout every live rank enters `monitored_barrier` on it,
and rank 0 learns which ranks never came (`wait_all_ranks=True` lists all of them).

With NCCL the timeout is enforced by NCCL's watchdog thread, which aborts the process
before Python sees an exception; there the flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE)
is the tool, and this module only serves the gloo (CPU) case.
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch.distributed as dist

_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than train.timeout_s; the message names who was missing."""


class HangReporter:
    def __init__(self, timeout_s: float):
        self.timeout = timedelta(seconds=timeout_s)
        self.where = "start-up"  # what this rank was doing, set by the trainer
        self._group = dist.new_group(backend="gloo", timeout=self.timeout)

    def explain(self, error: BaseException) -> CollectiveTimeout | None:
        """For a timeout: a CollectiveTimeout naming the ranks that did not arrive (this call
        waits up to timeout_s for them). For any other error: None."""
        if not _TIMEOUT.search(str(error)):
            return None
        rank = dist.get_rank()
        lines = str(error).strip().splitlines()
        # gloo prefixes its messages with the C++ source location, which tells a user nothing.
        first = re.sub(r"^\[[^\]]*\]\s*", "", lines[-1]) if lines else type(error).__name__
        head = (f"a collective timed out after {self.timeout.total_seconds():g}s (train.timeout_s) on rank {rank} "
                f"during {self.where} ({first})")
        try:
            # Non-zero ranks wait longer so that rank 0, which collects the arrivals, reports first.
            dist.monitored_barrier(group=self._group, timeout=self.timeout * (1 if rank == 0 else 2),
                                   wait_all_ranks=True)
        except RuntimeError as e:
            missing = _MISSING.search(str(e))
            if missing:
                ranks = missing.group(1).strip().rstrip(",")
                return CollectiveTimeout(f"{head}: rank(s) {ranks} did not arrive; look at what those ranks "
                                         f"were doing (their log lines above) or raise train.timeout_s")
            if rank != 0:
                time.sleep(1.0)  # let rank 0's report, which names the missing ranks, be the first failure
                return CollectiveTimeout(f"{head}: rank 0 did not confirm which ranks arrived; either rank 0 is "
                                         f"the one stuck or its report names the missing ranks")
            return CollectiveTimeout(f"{head}; checking which ranks arrived failed too: {e}")
        return CollectiveTimeout(f"{head}; every rank arrived at the check afterwards, so the ranks were "
                                 f"waiting in different collectives (a rank-dependent code path)")
