"""CPU threads: the thread count chosen as a process runs, and whether other processes
compete for this machine's cores (`llmsplit doctor`).

PyTorch's CPU ops run on libgomp, whose threads spin at each barrier (GOMP_SPINCOUNT,
300,000 pause loops by default) before they sleep. On a quiet machine that is the fastest
way to run (`python -m benchmarks threads`: SmolLM2-135M, 2 threads, 28.9 tokens/s). When
another process wants the cores, a spinning thread burns the time slice its partner needs to
reach the barrier: 2-thread decode fell to 4.6 tokens/s, and a 1-worker, 2-thread training
step took 5.8-6.5x as long (`python -m benchmarks train_threads`). No fixed setting served both:
OMP_WAIT_POLICY=PASSIVE kept decode at 20.6 tokens/s under contention but gave 0.66x on the
quiet machine (training 0.77x), and one thread lost 14% there (training, 48%). So the thread
count is measured instead: a few steps run with the other count, and the faster one is kept.
With one thread there is no barrier to spin at.

Decode (`generate`, `serve`) tries the other count now and then, since its steps vary with
batch and position; a trial that loses makes the next wait twice as long (up to
`MAX_PERIOD_S`), and one that is far slower from its first two steps ends there. Training
steps all do the same work, so a trainer's tuner (`uniform=True`) leaves a quiet machine
alone: after one early trial it tries one thread only when its steps slow down by
`SLOWDOWN`, and, while at one thread, tries the full count again after a number of steps
that doubles each time.

libgomp reads its variables once, at start-up, so only the thread count can change on the
fly; a user who set OMP_NUM_THREADS keeps exactly that (`count_is_the_users`).
"""

from __future__ import annotations

import os
import statistics
import sys

# The variables that set libgomp's wait policy (read once, when torch is first imported).
POLICY_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Set beside OMP_NUM_THREADS when llmsplit chose the count (its workers): theirs to tune.
CHOSEN_BY_LLMSPLIT = "LLMSPLIT_TUNE_THREADS"
# The count a tunable worker starts at: 1 where its launcher saw other threads wanting the cores.
START_THREADS = "LLMSPLIT_START_THREADS"

TRIAL_STEPS = 4  # steps per measurement (median: the first step after a switch is slower)
# Decode time (s) before the first trial, and after a switch; doubled after each trial that loses.
FIRST_PERIOD_S, SWITCHED_PERIOD_S, MAX_PERIOD_S = 1.0, 4.0, 32.0
# Training: steps at one thread before the full count is tried again, doubled after each loss.
FIRST_PERIOD_STEPS, MAX_PERIOD_STEPS = 8, 256
SLOWDOWN = 1.5  # training: steps this much slower than the fastest seen suggest contention
GAIN = 0.9  # the other count is kept when its median step is below this fraction of the current one
GIVE_UP = 1.5  # two trial steps this many times the current median end the trial (it lost)
GIVE_UP_AT_ONCE = 4.0  # one trial step this many times slower ends it (2 spinning threads beside a busy core: 4-14x)


def count_is_the_users() -> bool:
    """Whether OMP_NUM_THREADS is the user's choice (then nothing tunes it), not one that
    llmsplit's launcher set for its workers."""
    return "OMP_NUM_THREADS" in os.environ and os.environ.get(CHOSEN_BY_LLMSPLIT) != "1"


class ThreadTuner:
    def __init__(self, threads: int | None = None, uniform: bool = False, allowed: bool = True):
        """`allowed`: whether the caller's steps may be tuned at all (CPU steps, timed alike)."""
        import torch  # here: doctor's oversubscription check below needs no torch

        self._set_threads = torch.set_num_threads
        self.high = threads or torch.get_num_threads()
        self.enabled = allowed and self.high > 1 and not count_is_the_users()
        self.uniform = uniform
        self.current = self.high
        self.switches = self.trials = 0
        first = FIRST_PERIOD_STEPS if uniform else FIRST_PERIOD_S
        self._period, self._since, self._fastest = first, 0.0, float("inf")
        self._base: list[float] = []
        self._trial: list[float] | None = None
        self._shape = None
        if self.enabled and 0 < int(os.environ.get(START_THREADS, "0")) < self.high:
            self.current = 1  # the launcher saw the cores taken (`contention`): full count tried later
            self._set_threads(1)

    def record(self, seconds: float, shape=None) -> None:
        """One step took `seconds` at the current count; `shape` (batch size, say) keeps the
        comparison to steps of the same kind."""
        if not self.enabled:
            return
        if shape != self._shape:  # another batch size: measurements so far do not compare
            self._shape, self._base = shape, []
            if self._trial is not None:
                self._end_trial(keep=False)
            return
        if self._trial is not None:
            self._trial.append(seconds)
            base = statistics.median(self._base)
            if seconds > GIVE_UP_AT_ONCE * base or len(self._trial) >= 2 and min(self._trial[-2:]) > GIVE_UP * base:
                self._end_trial(keep=False)  # far slower (2 threads under contention): no need for more
            elif len(self._trial) == TRIAL_STEPS:
                self._end_trial(keep=statistics.median(self._trial) < GAIN * base)
            return
        self._base = (self._base + [seconds])[-TRIAL_STEPS:]
        self._since += 1 if self.uniform else seconds
        if len(self._base) == TRIAL_STEPS and self._trial_due():
            self._trial, self.trials = [], self.trials + 1
            self._set_threads(self._other())

    def _trial_due(self) -> bool:
        if not self.uniform or self.current == 1:
            return self._since >= self._period
        # Training at the full count: one trial early (the machine may be loaded from the
        # start), then only once steps have slowed down.
        median = statistics.median(self._base)
        self._fastest = min(self._fastest, median)
        slowed = median > SLOWDOWN * self._fastest or self.trials == 0
        return slowed and self._since >= self._period

    def _other(self) -> int:
        return 1 if self.current > 1 else self.high

    def _end_trial(self, keep: bool) -> None:
        if keep:
            self.current = self._other()
            self._period = FIRST_PERIOD_STEPS if self.uniform else SWITCHED_PERIOD_S
            self.switches += 1
        else:
            self._period = min(2 * self._period, MAX_PERIOD_STEPS if self.uniform else MAX_PERIOD_S)
        self._set_threads(self.current)
        self._trial, self._base, self._since = None, [], 0.0


def available_cores() -> int:
    """The cores this process may run on (its affinity), else the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscription(cores: int | None = None, load: float | None = None) -> str | None:
    """A sentence when more runnable processes than cores compete for this machine (the
    1-minute load average), else None."""
    cores = cores or available_cores()
    load = os.getloadavg()[0] if load is None else load
    if load <= cores:
        return None
    return f"load average {load:.1f} on {cores} cores: other processes want these cores"


def workers_threads(nproc: int, busy: int = 0) -> dict[str, str]:
    """The thread variables of `nproc` local workers: the cores shared among them, or the
    count the user exported (then nothing tunes it). A count llmsplit chose is marked so: its
    workers may tune it (ThreadTuner), and a later launch from the same process chooses
    afresh. Where `busy` threads of other processes want the cores (`runnable_elsewhere`),
    `contention` sets the count the workers start at, and its sentence goes to stderr."""
    if count_is_the_users():
        omp = os.environ["OMP_NUM_THREADS"]
        return {"OMP_NUM_THREADS": omp, "LLMSPLIT_THREADS": omp, CHOSEN_BY_LLMSPLIT: "0", START_THREADS: "0"}
    omp = max(1, (os.cpu_count() or 1) // nproc)
    start, note = contention(nproc, omp, busy)
    if note:
        print(f"llmsplit: {note}", file=sys.stderr, flush=True)
    return {"OMP_NUM_THREADS": str(omp), "LLMSPLIT_THREADS": str(omp), CHOSEN_BY_LLMSPLIT: "1",
            START_THREADS: str(start)}


def runnable_elsewhere(samples: int = 20, interval_s: float = 0.002) -> int:
    """Threads of other processes that want a core now: the kernel's count of runnable tasks
    (/proc/stat's procs_running), the median of `samples` reads 2 ms apart, less the one
    reading it; 0 where it cannot be read (not Linux). Unlike the load average (a 1-minute
    mean) it says what competes now, not what ran before this process started."""
    import time

    counts = []
    for _ in range(samples):
        try:
            with open("/proc/stat") as f:
                counts += [int(line.split()[1]) for line in f if line.startswith("procs_running ")]
        except (OSError, ValueError, IndexError):
            return 0
        time.sleep(interval_s)
    return max(0, int(statistics.median(counts)) - 1) if counts else 0


def contention(nproc: int, threads: int, busy: int, cores: int | None = None) -> tuple[int, str | None]:
    """(the thread count each of `nproc` workers of `threads` threads starts at, a sentence
    for the user or None) when `busy` threads of other processes want this machine's cores.
    A team of threads beside them stalls at every barrier (libgomp spins for the preempted
    one), so each worker starts at one thread and its tuner tries the full count as it runs;
    one-thread workers get their fair share of the cores, and the sentence says about what
    that costs."""
    cores = cores or available_cores()
    if busy <= 0 or nproc * threads + busy <= cores:
        return threads, None
    others = f"{busy} thread{'s' if busy > 1 else ''} of other processes want{'s' if busy == 1 else ''} " \
             f"this machine's {cores} cores"
    if threads > 1:
        return 1, (f"{others}: each worker starts at 1 thread instead of {threads} (a team of threads beside them "
                   f"waits at every step for the one that lost its core) and tries {threads} again as it runs")
    slower = (nproc + busy) / cores
    return 1, (f"{others}: the {nproc} worker{'s' if nproc > 1 else ''} share them, so each step takes about "
               f"{slower:.1f}x as long as on a quiet machine")
