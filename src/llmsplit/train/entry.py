"""The function the launcher starts in every worker, kept apart from the trainer.

The launching process must import the entry point to hand it to torch's elastic launcher;
importing only this small module spares it the trainer's imports (DTensor, pipelining:
about 1.5 s per launch), which only the workers need.
"""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path

from ..launch import worker_entry


@worker_entry
def run_worker(config_text: str, run_dir: str | None, resume: str = "none") -> dict | None:
    """Entry point of one worker process (started by llmsplit's launcher or torchrun)."""
    from .trainer import Trainer

    return run_trainer(Trainer, config_text, run_dir, resume)


def run_trainer(trainer_class, config_text: str, run_dir: str | None, resume: str) -> dict | None:
    """A worker's run with `trainer_class` (the Trainer, or a room above that extends it:
    posttrain/entry.py)."""
    from ..launch import PEER_GONE
    from .trainer import train_worker

    try:
        return train_worker(config_text, run_dir, resume, trainer_class)
    except RuntimeError as e:
        if any(s in str(e) for s in PEER_GONE):
            # Another rank died and took the connection with it. The launcher reports the
            # first failure it notices, so give the rank that failed first a head start.
            time.sleep(2)
        raise


def default_run_dir(preset: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{preset}"
