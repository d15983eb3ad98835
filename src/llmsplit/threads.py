"""Whether other processes compete for this machine's cores, for `llmsplit doctor`.

PyTorch's CPU build runs its parallel regions on libgomp, whose threads spin at each barrier
(GOMP_SPINCOUNT, 300,000 pause loops by default) before they sleep. When other processes
want the cores, a spinning thread burns the time slice its partner needs, and 2-thread
decode slowed 3-9x (issue 23; `python -m benchmarks threads`). Decode copes by itself
(`infer/thread_tuner.py` drops to one thread while that is faster); `doctor` says when the
machine is oversubscribed and which wait policy the user set. Pure standard library.
"""

from __future__ import annotations

import os

# The variables that set libgomp's wait policy (read once, when torch is first imported).
POLICY_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def oversubscription(cores: int | None = None, load: float | None = None) -> str | None:
    """A sentence when more runnable processes than cores compete for this machine (the
    1-minute load average), else None."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None else load
    if load <= cores:
        return None
    return f"load average {load:.1f} on {cores} cores: other processes want these cores"
