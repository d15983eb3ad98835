"""What a run keeps in its folder besides checkpoints, and what a resumed run reads back:
the folder itself (chosen by rank 0), metrics.jsonl, summary.json and the checkpoint to
start from."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from ..config import Config
from ..io.disk_full import writing
from ..io.run_dir import METRICS_FILE, SUMMARY_FILE, TENSORBOARD_DIR, read_metrics, resolve_checkpoint, usable_checkpoint, warn_skipped
from ..launch import restart_note
from .entry import default_run_dir
from .membership import restarted_for_a_join
from .progress import Progress, print_summary


def agree_on_run_dir(cfg: Config, run_dir: str | None) -> Path:
    """Rank 0 picks the run folder (a timestamp differs between machines) and tells the others."""
    choice = [str(run_dir or default_run_dir(cfg.model.preset))]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def resume_source(resume: str, run_dir: Path, ck_dir: Path, rank0: bool) -> Path | None:
    """The checkpoint to start from, chosen by rank 0 so that every rank loads the same one."""
    # A worker restarted by the elastic launcher after a crash resumes where it can.
    if resume == "none" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    if resume == "none":
        return None
    choice = [None]
    if rank0 and resume == "auto":
        newest, skipped = usable_checkpoint(ck_dir)  # checkpoints but none usable: refused, not started over
        warn_skipped(skipped)
        if newest is None:
            print(f"llmsplit: no checkpoint to resume from in {ck_dir}; starting at step 0", file=sys.stderr, flush=True)
        choice = [newest and str(newest)]
    elif rank0:
        choice = [str(resolve_checkpoint(resume)[1])]
    if rank0 and not restarted_for_a_join(run_dir):  # a join is said by membership.jsonl's line instead
        announce_restart(choice[0])
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def announce_restart(checkpoint: str | None) -> None:
    """Rank 0 of workers restarted by --max-restarts: one line with the failure the launcher
    saw (launch/restarts.py) and where the run goes on from; nothing on a first attempt."""
    note = restart_note()
    if note is not None:
        where = f"resumes from checkpoint {Path(checkpoint).name}" if checkpoint else "starts over at step 0"
        print(f"llmsplit: {note} {where}", file=sys.stderr, flush=True)


class MetricsLog:
    """Rank 0's record of the steps: a line of metrics.jsonl every `log_every` steps and at
    the last, and the progress bar or log line of every step."""

    def __init__(self, run_dir: Path, start_step: int, last_step: int, log_every: int, tensorboard: bool = False):
        self.path = path = run_dir / METRICS_FILE
        _trim_metrics(path, start_step)
        self.file = open(path, "a")
        self.progress = Progress(last_step, start_step)
        self.last_step, self.log_every = last_step, log_every
        self.events = None
        if tensorboard:  # torch's own writer; a resumed run appends a new event file to the folder
            from torch.utils.tensorboard import SummaryWriter

            self.events = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1)

    def add(self, record: dict) -> None:
        if record["step"] % self.log_every == 0 or record["step"] == self.last_step or "eval_loss" in record:
            with writing(self.path, f"logging step {record['step']}"):
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
                if self.events is not None:  # the same numbers, one scalar series per key
                    for key, value in record.items():
                        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                            self.events.add_scalar(key, value, record["step"])
                    self.events.flush()
        self.progress.update(record)

    def close(self) -> None:
        self.progress.close()
        self.file.close()
        if self.events is not None:
            self.events.close()


def _trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop logged steps after the checkpoint (and a line cut off by a crash)
    so the file reads as one run."""
    if not path.exists():
        return
    keep = [record for record in read_metrics(path) if record["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    with writing(path, "rewriting the metrics of a resumed run"):
        tmp.write_text("".join(json.dumps(record) + "\n" for record in keep))
    shutil.move(tmp, path)


def run_summary(cfg: Config, world: int, counts: dict, history: list[dict], per_rank: list[dict], run_dir: Path,
                micro_batch: int) -> dict:
    """summary.json's content; `counts` the model's parameters (adapters.lora.parameter_counts),
    `micro_batch` the one the run trained with (--auto's trial may have chosen another than the
    config's)."""
    par, mem = cfg.parallel, cfg.memory
    timed = history[1:] or history  # the first step pays for warm-up
    total_time = sum(r["step_time_s"] for r in timed)
    tokens = len(timed) * cfg.train.global_batch * cfg.data.seq_len
    final_loss = history[-1]["loss"] if history else _last_logged_loss(run_dir)
    return {
        "world_size": world,
        "layout": {"dp": par.dp, "dp_replicate": par.dp_replicate, "zero": par.zero, "tp": par.tp, "pp": par.pp,
                   "pp_schedule": par.pp_schedule, "activation_checkpoint": mem.activation_checkpoint,
                   "offload": mem.offload, "ep": par.ep, "cp": par.cp, "cp_mode": par.cp_mode},
        "micro_batch": micro_batch,
        "steps": cfg.train.steps,
        "final_loss": final_loss,
        "tokens_per_s": tokens / total_time if total_time > 0 else 0.0,
        **counts,  # params, trainable_params (and frozen_base_bytes over a quantized base)
        "precision": cfg.train.precision,
        "per_rank": sorted(per_rank, key=lambda r: r["rank"]),
    }


def write_summary(summary: dict, run_dir: Path, first_loss: float | None) -> None:
    with writing(run_dir / SUMMARY_FILE, "writing the run's summary"):
        (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    print_summary(summary, run_dir, first_loss)


def amend_summary(run_dir: Path, **fields) -> None:
    """Add `fields` to a written summary.json (what the launching process knows and the
    workers do not), replacing the file at once so that a reader never sees half of it."""
    path = Path(run_dir) / SUMMARY_FILE
    summary = json.loads(path.read_text())
    summary.update(fields)
    tmp = path.with_suffix(".tmp")
    with writing(path, "writing the run's summary"):
        tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)


def _last_logged_loss(run_dir: Path) -> float | None:
    records = read_metrics(run_dir / METRICS_FILE)
    return records[-1]["loss"] if records else None
