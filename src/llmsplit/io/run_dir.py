"""The folders a training run writes, as seen by anyone who reads them (resume, generate).

A checkpoint `step_<N>/` is complete only when it holds `train_state.json`: the trainer
writes into a hidden temporary folder and renames it when every rank has finished, so
a crash mid-write never leaves a folder that looks complete. Resuming also checks what the
marker cannot vouch for (a folder copied in part, a disk that filled up): the metadata
must be readable and every data file as long as the metadata says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import Config, ConfigError, load_config

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
STATE_FILE = "train_state.json"
METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.step_(\d+)\.tmp$")


def checkpoint_dir(cfg: Config, run_dir: str | Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / METADATA_FILE).is_file()


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, in a few words, or None when it can."""
    from .dcp_files import UnsafeCheckpoint, read_metadata, storage_problem  # torch.distributed.checkpoint: slow
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is a file, not a checkpoint folder"
    for marker in (METADATA_FILE, STATE_FILE):
        if not (path / marker).is_file():
            return f"it has no {marker} (the write did not finish)"
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return f"its {STATE_FILE} has no step"
    except (OSError, ValueError) as e:
        return f"its {STATE_FILE} cannot be read ({e})"
    try:
        metadata = read_metadata(path)
    except UnsafeCheckpoint as e:
        return str(e)
    except Exception as e:  # a damaged pickle raises anything from EOFError to KeyError
        return f"its {METADATA_FILE} cannot be read ({type(e).__name__}: {e})"
    return storage_problem(path, metadata)


def newest_checkpoint(ck_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under `ck_dir` that can be resumed from, and the newer
    folders passed over on the way, each with why (for the caller to warn about)."""
    ck_dir = Path(ck_dir)
    candidates = []
    if ck_dir.is_dir():
        for p in ck_dir.iterdir():
            m = _STEP_DIR.match(p.name) or _TMP_DIR.match(p.name)
            if m:
                candidates.append((int(m.group(1)), p.name.startswith("."), p))
    skipped = []
    for _, tmp, p in sorted(candidates, reverse=True):
        why = "a write that never finished" if tmp else checkpoint_problem(p)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


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
    if not path.exists():
        raise ConfigError(f"{str(path)!r} does not exist; pass a run folder or one of its checkpoints")
    if (path / METADATA_FILE).exists() or (path / STATE_FILE).exists() or _STEP_DIR.match(path.name):
        why = checkpoint_problem(path)
        if why is not None:
            raise ConfigError(f"checkpoint {str(path)!r} cannot be used: {why}")
        run_dir = path.parent.parent if (path.parent.parent / CONFIG_FILE).is_file() else path.parent
        return run_dir, path
    cfg = read_run_config(path)
    newest, skipped = newest_checkpoint(checkpoint_dir(cfg, path))
    if newest is None:
        damaged = f" ({skipped[0][0].name}: {skipped[0][1]})" if skipped else ""
        raise ConfigError(f"run folder {str(path)!r} has no usable checkpoint{damaged}; train it to the end "
                          f"or set checkpoint.every")
    return path, newest
