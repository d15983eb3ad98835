"""Distributed checkpoints with `torch.distributed.checkpoint` (DCP).

Model and optimizer state are saved by parameter name (`get_model_state_dict` /
`get_optimizer_state_dict`), never by rank, so a checkpoint is readable under another
layout or world size. The trainer's own state (step, data position, RNG, LR schedule)
is a small JSON file, which also records the size and CRC-32 of every data file (checked
before a resume or a load: io/checksums.py). Writes go to a hidden temporary folder that
rank 0 renames once every rank has finished: the final name appears only for a complete
checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..adapters.lora import is_adapter
from ..errors import ConfigError
from ..io import dcp_files
from ..io.checksums import file_records
from ..io.disk_full import writing
from ..io.run_dir import METADATA_FILE, STATE_FILE, list_checkpoints
from ..models.llama import plain_name
from ..models.weight_shapes import shape_mismatch
from ..parallel.data_parallel import local_optimizer

# Optimizer state keyed by parameter name ("state.<name>.exp_avg"), one entry per
# parameter: every layout writes and reads the same keys, and a rank that holds the state
# of only some parameters (ZeRO-1, pipeline stages) writes just those.
_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)
# Frozen parameters (the base under LoRA) are not saved: they come from the seed or model.hf
# again, and a checkpoint holds only what training changed (adapters and their optimizer state).
_MODEL = StateDictOptions(ignore_frozen_params=True)


def _model_state(model) -> dict:
    """The model state a checkpoint holds: the trained parameters (a LoRA run's adapters only).
    torch's ignore_frozen_params misses a frozen parameter reached under a second name, a tied
    head (`output.weight` is `tok_embeddings.weight`: named_parameters lists it once), so a LoRA
    run on a tied model saved the frozen embedding as if trained, and no reader took it as
    adapters; frozen names are dropped here under every name."""
    state = get_model_state_dict(model, options=_MODEL)
    frozen = {plain_name(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {name: t for name, t in state.items() if name not in frozen}


def save_checkpoint(ck_dir: Path, step: int, model, optimizer, train_state: dict, keep: int,
                    async_group=None) -> Path | PendingSave:
    """Write the checkpoint of `step` and make it complete (a collective). With `async_group`
    (a process group of its own: DCP's writer thread runs collectives while training runs its
    own), DCP stages the state to host memory and writes it in the background: the returned
    `PendingSave` completes it later."""
    ck_dir = Path(ck_dir)
    final = ck_dir / f"step_{step}"
    tmp = ck_dir / f".step_{step}.tmp"
    rank0 = dist.get_rank() == 0
    doing = f"saving the checkpoint of step {step}"
    if rank0:
        with writing(ck_dir, doing):
            ck_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash: never resumed from
    dist.barrier()
    state = {"model": _model_state(model), "optim": _optim_state(model, optimizer)}
    # The RNG as of this step, whenever the checkpoint completes.
    train_state = dict(train_state, rng=base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode())
    pending = PendingSave(tmp, final, step, train_state, keep, doing)
    with writing(tmp, doing), dcp_files.plain_errors(doing):
        if async_group is None:
            dcp.save(state, checkpoint_id=str(tmp))
            return pending.complete()
        pending.future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=async_group)
    return pending


@dataclass
class PendingSave:
    """A checkpoint whose data files are written (or being written, `future`) into `tmp`; it
    becomes complete, under its final name, only once every rank's files are done, their
    checksums recorded and the folder renamed, so a crash or a lost node meanwhile never
    leaves a checkpoint a resume would take."""

    tmp: Path
    final: Path
    step: int
    train_state: dict
    keep: int
    doing: str
    future: object = None

    def complete(self) -> Path:
        """Wait for the writer, then checksums, state file and rename (a collective)."""
        with writing(self.tmp, self.doing), dcp_files.plain_errors(self.doing):
            if self.future is not None:
                self.future.result()
        dist.barrier()
        files = _checksums(self.tmp)
        if dist.get_rank() == 0:
            with writing(self.tmp, self.doing), open(self.tmp / STATE_FILE, "w") as f:
                json.dump(dict(self.train_state, files=files), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if self.final.exists():  # a re-run of the same step (after a restart) replaces it
                shutil.rmtree(self.final)
            os.replace(self.tmp, self.final)
            _drop_old(self.final.parent, self.step, self.keep)
        dist.barrier()
        return self.final


def _checksums(folder: Path) -> dict:
    """Size and CRC-32 of every file of the checkpoint just written (each rank checks its
    share of the data files), gathered on every rank; rank 0 records them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = sorted(p.name for p in folder.iterdir() if p.name.endswith(".distcp"))
    mine = file_records(folder, data[rank::world] + ([METADATA_FILE] if rank == 0 else []))
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return {name: record for part in gathered for name, record in sorted(part.items())}


def _drop_old(ck_dir: Path, step: int, keep: int) -> None:
    """Keep the checkpoint of `step`, just written and complete, and the `keep` - 1 before
    it. Those of later steps (left when a run was resumed from an earlier checkpoint, say
    because the newer ones were damaged) are neither counted nor deleted: they can never
    crowd out the one good checkpoint, and evidence of damage is left for the user."""
    older = [path for s, path in list_checkpoints(ck_dir) if s < step]
    for old in older[:max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def _optim_state(model, optimizer) -> dict:
    # ZeRO-1's inner optimizer holds this rank's share; the other ranks write the rest.
    with _without_empty_groups(local_optimizer(optimizer)) as local:
        return get_optimizer_state_dict(model, local, options=_OPTIM)


def _load_optim_state(model, optimizer, state: dict) -> None:
    with _without_empty_groups(local_optimizer(optimizer)) as local:
        set_optimizer_state_dict(model, local, state, options=_OPTIM)


@contextmanager
def _without_empty_groups(optimizer):
    """torch's flattened optimizer state dict cannot express a parameter group with no
    parameters (it names groups by their first parameter), which a ZeRO-1 rank has when
    all of a group's parameters went to other ranks. Hide such groups meanwhile; they
    carry no state."""
    groups = optimizer.param_groups
    optimizer.param_groups = [g for g in groups if g["params"]]
    try:
        yield optimizer
    finally:
        # load_state_dict replaces the group dicts; put the new ones back in place.
        kept = iter(optimizer.param_groups)
        optimizer.param_groups = [next(kept) if g["params"] else g for g in groups]


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Load model and optimizer state in place; returns the trainer state."""
    path = Path(path)
    state = {"model": _model_state(model), "optim": _optim_state(model, optimizer)}
    dcp_files.load(state, path)  # never unpickles code from the checkpoint
    frozen = any(not p.requires_grad for p in model.parameters())
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not frozen))
    _load_optim_state(model, optimizer, state["optim"])
    train_state = json.loads((path / STATE_FILE).read_text())
    rng = train_state.pop("rng", None)
    if rng is not None:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))
    return train_state


def check_fits(path: Path, model_cfg, lora_rank: int = 0) -> None:
    """Refuse, before any worker starts, a checkpoint whose tensors are not this model's:
    DCP would otherwise fail deep inside a load on every rank, or (for a missing tensor)
    silently keep the fresh initialisation. A LoRA run's checkpoint holds adapters only."""
    saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(path))
    adapters = bool(saved) and all(is_adapter(name) for name in saved)
    if lora_rank or adapters:
        ranks = {shape[0] for name, shape in saved.items() if name.endswith("lora_a")}
        if not adapters or ranks != {lora_rank}:
            held = f"LoRA adapters of rank {', '.join(map(str, sorted(ranks)))}" if adapters else "the whole model"
            raise ConfigError(f"checkpoint {str(path)!r} holds {held}, not what lora.rank={lora_rank} trains; "
                              f"resume with the [lora] settings it was trained with (its run folder's config.toml)")
        return
    mismatch = shape_mismatch(model_cfg, saved, layers_key="model.n_layers")
    if mismatch:
        raise ConfigError(f"checkpoint {str(path)!r} is not of this model: {mismatch}; resume with the [model] "
                          f"settings it was trained with (its run folder's config.toml)")
