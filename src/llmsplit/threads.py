"""OpenMP settings for the processes llmsplit starts: how long idle threads spin.

PyTorch's CPU build runs its parallel regions on libgomp, whose threads spin between regions
(GOMP_SPINCOUNT, 300,000 pause loops by default, milliseconds on current CPUs) before they
sleep. A decode step is hundreds of short regions, so on a quiet machine the spin saves a
wake-up each time; but when other processes want the cores, a thread that spins burns the
time slice its partner needs to reach the barrier, and 2-thread decode slowed 5-25x (issue
23). The value below was chosen by `python -m benchmarks threads` (BENCHMARKS.md, the
"Decode under CPU contention" table): it keeps the quiet-machine speed and removes the
collapse. docs/serving.md explains the trade-off.

libgomp reads these variables once, when torch is first imported, so they are applied where
llmsplit owns the process before that: at the top of the command line (`llmsplit.cli`), and
in the environment of the workers it starts (`launch.prepare_workers`). A user who sets any
of them keeps exactly what they set. Pure standard library: imported before torch.
"""

from __future__ import annotations

import os

# What llmsplit sets when the user set none of USER_KEYS.
DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
# Any of these set by the user means they chose a policy: llmsplit then adds nothing.
USER_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wait_policy_defaults(environ=None) -> dict[str, str]:
    """The variables to add to `environ` (default: this process's): DEFAULTS, or nothing
    when the user chose a policy."""
    environ = os.environ if environ is None else environ
    return {} if any(k in environ for k in USER_KEYS) else dict(DEFAULTS)


# What apply_defaults set in this process (so that `doctor` can tell it from the user's).
applied: dict[str, str] = {}


def apply_defaults() -> dict[str, str]:
    """Set the defaults in this process's environment (before torch is imported for them to
    count); returns what was set."""
    added = wait_policy_defaults()
    os.environ.update(added)
    applied.update(added)
    return added


def oversubscription(cores: int | None = None, load: float | None = None) -> str | None:
    """A sentence when more runnable processes than cores compete for this machine (the
    1-minute load average), else None: what `llmsplit doctor` warns about."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None else load
    if load <= cores:
        return None
    return f"load average {load:.1f} on {cores} cores: other processes want these cores"
