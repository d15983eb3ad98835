"""Decode's thread count, chosen as it runs: all the threads torch has, or one when other
processes want the cores.

PyTorch's CPU ops run on libgomp, whose threads spin at each barrier (GOMP_SPINCOUNT,
300,000 pause loops by default) before they sleep. On a quiet machine that is the fastest
way to decode (`python -m benchmarks threads`: SmolLM2-135M, 2 threads, 34.6 tokens/s).
When another process wants the cores, a spinning thread burns the time slice its partner
needs to reach the barrier and decode collapsed to 3.8-10.7 tokens/s. No fixed setting
served both: a short spin (GOMP_SPINCOUNT=10000) or OMP_WAIT_POLICY=PASSIVE kept 11-27
tokens/s under contention but lost 9-43% on the quiet machine, and one thread lost 21%
there. So the thread count is measured instead: every so often a few decode steps run with
the other count, and the faster one is kept. With one thread there is no barrier to spin
at, and decode under contention kept 20-24 tokens/s. A trial that loses makes the next one
wait twice as long (up to `MAX_PERIOD_S`), and one that is far slower from its first two
steps ends there, so a steady machine, quiet or loaded, pays little for the trials.

libgomp reads its variables once, at start-up, so only the thread count can change on the
fly; a user who set OMP_NUM_THREADS (or called torch.set_num_threads to 1) keeps exactly
that: the tuner is off. It runs in `generate` and `serve` (`load(tune_threads=True)`), not
in a library caller's process, whose torch thread count is the caller's.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

TRIAL_STEPS = 4  # decode steps per measurement (median: the first step after a switch is slower)
# Decode time before the first trial, and after a switch; doubled after each trial that loses.
FIRST_PERIOD_S, SWITCHED_PERIOD_S, MAX_PERIOD_S = 1.0, 4.0, 32.0
GAIN = 0.9  # the other count is kept when its median step is below this fraction of the current one
GIVE_UP = 2.0  # a trial step this many times the current median ends the trial at once (it lost)


class ThreadTuner:
    def __init__(self, threads: int | None = None):
        self.high = threads or torch.get_num_threads()
        self.enabled = self.high > 1 and "OMP_NUM_THREADS" not in os.environ
        self.current = self.high
        self.switches = 0
        self._period, self._since = FIRST_PERIOD_S, 0.0
        self._base: list[float] = []
        self._trial: list[float] | None = None
        self._shape = None

    def record(self, seconds: float, shape) -> None:
        """One decode step took `seconds` at the current count; `shape` (batch size, say)
        keeps the comparison to steps of the same kind."""
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
            if len(self._trial) >= 2 and min(self._trial[-2:]) > GIVE_UP * base:
                self._end_trial(keep=False)  # two steps far slower (2 threads under contention): no need for more
            elif len(self._trial) == TRIAL_STEPS:
                self._end_trial(keep=statistics.median(self._trial) < GAIN * base)
            return
        self._base = (self._base + [seconds])[-TRIAL_STEPS:]
        self._since += seconds
        if self._since >= self._period and len(self._base) == TRIAL_STEPS:
            self._trial = []
            torch.set_num_threads(self._other())

    def _other(self) -> int:
        return 1 if self.current > 1 else self.high

    def _end_trial(self, keep: bool) -> None:
        if keep:
            self.current, self._period = self._other(), SWITCHED_PERIOD_S
            self.switches += 1
        else:
            self._period = min(2 * self._period, MAX_PERIOD_S)
        torch.set_num_threads(self.current)
        self._trial, self._base, self._since = None, [], 0.0
