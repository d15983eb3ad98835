"""The folders a training run writes, as seen by anyone who reads them (resume, generate).

A checkpoint `step_<N>/` is complete only when it holds `train_state.json`: the trainer
writes into a hidden temporary folder and renames it when every rank has finished, so
a crash mid-write never leaves a folder that looks complete.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..config import Config, ConfigError, load_config

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(cfg: Config, run_dir: str | Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def list_checkpoints(ck_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ck_dir`, oldest first."""
    ck_dir = Path(ck_dir)
    found = []
    if ck_dir.is_dir():
        for p in ck_dir.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and is_complete_checkpoint(p):
                found.append((int(m.group(1)), p))
    return sorted(found)


def read_run_config(run_dir: str | Path) -> Config:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run folder (no {CONFIG_FILE}); pass a folder that "
                          f"`llmsplit train` wrote")
    return load_config(path)


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run dir, checkpoint dir) for a run folder (its newest complete checkpoint) or a
    checkpoint folder inside one."""
    path = Path(path)
    if is_complete_checkpoint(path):
        run_dir = path.parent.parent if (path.parent.parent / CONFIG_FILE).is_file() else path.parent
        return run_dir, path
    cfg = read_run_config(path)
    found = list_checkpoints(checkpoint_dir(cfg, path))
    if not found:
        raise ConfigError(f"run folder {str(path)!r} has no complete checkpoint yet; train it to the end "
                          f"or set checkpoint.every")
    return path, found[-1][1]
