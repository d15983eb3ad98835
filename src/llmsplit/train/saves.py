"""When a run writes its checkpoints, and how: after every `checkpoint.every` steps or
`checkpoint.every_seconds` seconds (rank 0's clock, so every rank saves after the same step),
and with `checkpoint.async` in the background (train/checkpoint.py's `PendingSave`): training
goes on while DCP's thread writes, and the checkpoint is completed (checksums, rename) as soon
as every rank's writer is done, or before the next save, or at the end of the run."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from .checkpoint import PendingSave


class Saves:
    def __init__(self, checkpoint, device: torch.device, hangs):
        self.every, self.every_seconds = checkpoint.every, checkpoint.every_seconds
        self.device, self.hangs = device, hangs
        # DCP's writer thread runs collectives of its own, on a group of its own.
        self.group = dist.new_group(backend="gloo") if checkpoint.async_save else None
        self.pending: PendingSave | None = None
        self.last = time.monotonic()  # when the last save began
        # Seconds the loop stood still for the checkpoints it saves on the way (not the end's).
        self.stall_s, self.saved = 0.0, 0

    def due(self, step: int, last_step: int) -> bool:
        """Save after `step`? (The last step's checkpoint is the run's end's, always written.)"""
        if step == last_step:
            return False
        if self.every and step % self.every == 0:
            return True
        if not self.every_seconds:
            return False
        due = torch.tensor([float(time.monotonic() - self.last >= self.every_seconds)], device=self.device)
        dist.broadcast(due, src=0)
        return bool(due.item())

    def save(self, write: Callable, wait: bool = False) -> None:
        """`write(group)` (save_checkpoint with DCP's async group, or None) after the save under
        way is complete; with `wait`, or without checkpoint.async, complete on return."""
        t0 = time.monotonic()
        self.complete()
        self.last = time.monotonic()
        saved = write(None if wait else self.group)
        self.pending = saved if isinstance(saved, PendingSave) else None
        if not wait:
            self.stall_s += time.monotonic() - t0
            self.saved += 1

    def complete_if_written(self) -> None:
        """Complete a background save once every rank's writer is done (a small collective per
        step while one is under way): the newest checkpoint is a restart's as early as it can be."""
        if self.pending is None:
            return
        done = torch.tensor([float(self.pending.future.done())], device=self.device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            t0 = time.monotonic()
            self.complete()
            self.stall_s += time.monotonic() - t0

    def record(self) -> dict:
        """summary.json's figures: checkpoints saved during the run and the seconds training
        stood still for them (the end's checkpoint, written before the run returns, apart)."""
        return {"saved": self.saved, "stall_s": self.stall_s, "async": self.group is not None}

    def complete(self) -> None:
        if self.pending is not None:
            self.hangs.where = f"completing the checkpoint of step {self.pending.step} (written in the background)"
            self.pending.complete()
            self.pending = None
