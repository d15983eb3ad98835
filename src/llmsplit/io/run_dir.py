"""The folders a training run writes, as seen by anyone who reads them (resume, generate).

A checkpoint `step_<N>/` is complete only when it holds `train_state.json`: the trainer
writes into a hidden temporary folder and renames it when every rank has finished, so
a crash mid-write never leaves a folder that looks complete. Resuming also checks what the
marker cannot vouch for (a folder copied in part, a disk that filled up, a file damaged in
place): the metadata must be readable and name only files inside the folder, and every data
file must be as long as the metadata says and match the checksum recorded when it was saved.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ..config import Config, load_config
from ..errors import ConfigError

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # train.tensorboard: the event files
PROFILE_DIR = "profile"  # --profile: the traces and their summary
PLOTS_DIR = "plots"  # `llmsplit plot`
SUMMARY_FILE = "summary.json"
# Where --overwrite moves the record of the run a folder held before it started over.
PREVIOUS_DIR = "previous"
STATE_FILE = "train_state.json"
METADATA_FILE = ".metadata"  # written by torch.distributed.checkpoint
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.step_(\d+)\.tmp$")
# The run's own copy of its tokenizer files, and the ids that end the model's turns (as the
# Hugging Face folder it started from names them), so a run needs nothing outside its folder.
TOKENIZER_DIR = "tokenizer"
GENERATION_FILE = "generation_config.json"


def checkpoint_dir(cfg: Config, run_dir: str | Path) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(run_dir) / "checkpoints"


def is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / METADATA_FILE).is_file()


def checkpoint_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, in a few words, or None when it can."""
    from .checksums import first_mismatch
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
    # Checkpoints saved before llmsplit recorded checksums have no "files": sizes only.
    return storage_problem(path, metadata) or ("files" in state and first_mismatch(path, state["files"])) or None


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


def usable_checkpoint(ck_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`newest_checkpoint`, refusing to go on when there are checkpoints but none can be
    used: starting again from step 0 would replace the run's metrics and let retention
    delete the damaged checkpoints, which may be all that is left of the run."""
    newest, skipped = newest_checkpoint(ck_dir)
    # A `.step_N.tmp` alone is a save that never finished, not a checkpoint: nothing to keep.
    if newest is None and any(not path.name.startswith(".") for path, _ in skipped):
        listed = "; ".join(f"{p.name}: {why}" for p, why in skipped)
        raise ConfigError(f"--resume auto: no checkpoint in {str(ck_dir)!r} can be used ({listed}); resume from "
                          f"a good copy with --resume PATH, or start the run over from step 0 with --resume none "
                          f"--overwrite (which moves them and the run's records aside)")
    return newest, skipped


def warn_skipped(skipped: list[tuple[Path, str]]) -> None:
    for path, why in skipped:
        print(f"llmsplit: warning: skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl. A line that is not one JSON object (what a crash or a
    full disk leaves at the end) is dropped with a warning instead of failing every reader."""
    path = Path(path)
    records = []
    if not path.exists():
        return records
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a step record")
        except ValueError:
            print(f"llmsplit: warning: dropping line {n} of {path}, which is cut off or damaged: {line[:60]!r}",
                  file=sys.stderr, flush=True)
            continue
        records.append(record)
    return records


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


def finished_steps(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` got anywhere: a logged step, a checkpoint (finished or
    not) or a summary. A run that failed before its first step (a wrong tokenizer, a
    worker that could not start) leaves only config.toml and may be started again."""
    return holds_record(run_dir) or bool(_checkpoint_folders(run_dir))


def holds_record(run_dir: str | Path) -> bool:
    """Whether the run in `run_dir` logged a step or wrote summary.json: what starting it
    again from step 0 would overwrite."""
    # is_file: a record is a file (a summary.json pointed at /dev/full by a test is none).
    return (Path(run_dir) / SUMMARY_FILE).is_file() or _has_logged_step(Path(run_dir) / METRICS_FILE)


def _checkpoint_folders(run_dir: Path) -> list[Path]:
    """The checkpoint folders (finished or not) of the run that config.toml describes."""
    try:
        ck_dir = checkpoint_dir(read_run_config(run_dir), run_dir)
    except (ConfigError, OSError, ValueError):  # a config.toml that cannot be read: the default place
        ck_dir = Path(run_dir) / "checkpoints"
    if not ck_dir.is_dir():
        return []
    return [p for p in ck_dir.iterdir() if _STEP_DIR.match(p.name) or _TMP_DIR.match(p.name)]


def set_aside(run_dir: str | Path) -> Path | None:
    """Make way for a new run in `run_dir` (--overwrite): the run it holds (`finished_steps`)
    moves to RUN_DIR/previous/<UTC time>/ (its metrics, summary, event files, profile, plots
    and checkpoints, with copies of its config.toml and tokenizer files, which the new run's
    config may name), so that nothing of it is truncated, replaced or taken for the new
    run's; returns that folder, or None when there was no run to keep."""
    import shutil
    import time

    run_dir = Path(run_dir)
    if not finished_steps(run_dir):
        return None
    checkpoints = _checkpoint_folders(run_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest, n = run_dir / PREVIOUS_DIR / stamp, 1
    while dest.exists():  # started over twice within a second
        dest, n = run_dir / PREVIOUS_DIR / f"{stamp}-{n}", n + 1
    dest.mkdir(parents=True)
    if (run_dir / CONFIG_FILE).is_file():
        shutil.copy2(run_dir / CONFIG_FILE, dest / CONFIG_FILE)
    if (run_dir / TOKENIZER_DIR).is_dir():
        shutil.copytree(run_dir / TOKENIZER_DIR, dest / TOKENIZER_DIR)
    for name in (METRICS_FILE, SUMMARY_FILE, TENSORBOARD_DIR, PROFILE_DIR, PLOTS_DIR):
        if (run_dir / name).exists():
            shutil.move(run_dir / name, dest / name)
    for path in checkpoints:  # a rename on the same disk; a checkpoint.dir on another one is copied
        (dest / "checkpoints").mkdir(exist_ok=True)
        shutil.move(path, dest / "checkpoints" / path.name)
    return dest


def _has_logged_step(path: Path) -> bool:
    if not path.is_file():  # a device (/dev/full, /dev/zero) would be read without end
        return False
    with open(path, errors="replace") as f:
        return any(line.strip() for line in f)


def absolute_paths(cfg: Config) -> None:
    """Make the config's paths absolute before config.toml is written, so the run folder
    (generate, export, a resume) means the same files from any directory."""
    import os

    def absolute(path: str | None) -> str | None:
        return os.path.abspath(path) if path else path

    cfg.model.hf, cfg.model.gguf = absolute(cfg.model.hf), absolute(cfg.model.gguf)
    cfg.lora.init = absolute(cfg.lora.init)
    cfg.checkpoint.dir, cfg.memory.offload_dir = absolute(cfg.checkpoint.dir), absolute(cfg.memory.offload_dir)
    if cfg.data.tokenizer != "byte":
        cfg.data.tokenizer = absolute(cfg.data.tokenizer)
    for key in ("source", "eval_source"):
        value = getattr(cfg.data, key)
        if value and value.startswith("text:"):
            setattr(cfg.data, key, "text:" + absolute(value[len("text:"):]))
        elif value and value != "builtin":
            setattr(cfg.data, key, absolute(value))
    # GRPO's reward functions given as file.py:function (module:function entries stay as they are).
    cfg.grpo.rewards = [f"{absolute(path)}:{fn}" if path.endswith(".py") else entry
                        for entry in cfg.grpo.rewards for path, _, fn in [entry.rpartition(":")]]


def write_run_config(run_dir: Path, cfg: Config) -> None:
    """config.toml, and the run's copy of its tokenizer files with the model's eos ids."""
    from ..config import to_toml
    from .tokenizer import ByteTokenizer, copy_tokenizer_files, load_tokenizer, save_tokenizer_files

    (run_dir / CONFIG_FILE).write_text(to_toml(cfg))
    tok = load_tokenizer(cfg.data.tokenizer)
    if isinstance(tok, ByteTokenizer):
        return  # nothing to copy: the byte tokenizer is built in
    dest = run_dir / TOKENIZER_DIR
    if tok.name.endswith(".gguf"):  # built from the file's metadata: saved, not copied
        save_tokenizer_files(tok, dest)
    elif Path(tok.name).resolve() != (dest / "tokenizer.json").resolve():  # not already the copy
        copy_tokenizer_files(tok.name, dest)
    eos = {tok.eos_id} - {None}
    if cfg.model.hf or cfg.model.gguf:
        from .weights import pretrained_weights

        eos |= pretrained_weights(cfg).eos_ids
    (dest / GENERATION_FILE).write_text(json.dumps({"bos_token_id": tok.bos_id, "eos_token_id": sorted(eos)}))


def run_tokenizer(run_dir: str | Path, cfg: Config):
    """(tokenizer, eos ids) of a run: its own copy, or data.tokenizer for a run made before
    runs kept one."""
    from .tokenizer import load_tokenizer

    dest = Path(run_dir) / TOKENIZER_DIR
    copied = (dest / "tokenizer.json").is_file()
    tok = load_tokenizer(str(dest / "tokenizer.json") if copied else cfg.data.tokenizer)
    try:
        listed = json.loads((dest / GENERATION_FILE).read_text())["eos_token_id"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    listed = listed if isinstance(listed, list) else []
    return tok, ({tok.eos_id} - {None}) | {i for i in listed if isinstance(i, int)}


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
        damaged = f" ({'; '.join(f'{p.name}: {why}' for p, why in skipped)})" if skipped else ""
        raise ConfigError(f"run folder {str(path)!r} has no usable checkpoint{damaged}; train it to the end "
                          f"or set checkpoint.every")
    warn_skipped(skipped)  # an older checkpoint stands in for the damaged newer ones: say so
    return path, newest
