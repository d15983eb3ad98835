"""A model split over N worker processes: tensor parallel (`tp`), pipeline stages (`pp`) or
both (rank = stage * tp + tp_rank). Gloo on CPU, NCCL on GPUs.

The calling process is rank 0 and drives: for each step it broadcasts the command (tokens
and the KV-cache step) and takes part in the computation; the other ranks, started here
with torch.multiprocessing, follow in a loop until told to stop. Rank 0 can therefore be
an interactive Python session or an HTTP server. Each rank opens the weights itself and
reads only its slices (tensor parallel) or its stage's layers (pipeline).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import ConfigError
from ..launch import free_port
from ..layout import Layout, Workload, check, stage_layers
from .placement import Placement
from .runner import PieceSpec, Runner


@dataclass(frozen=True)
class SplitSpec:
    path: str
    tp: int
    pp: int
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_context: int
    port: int

    @property
    def world(self) -> int:
        return self.tp * self.pp


def split_layout(cfg, tp: int, pp: int) -> Layout:
    """The layout of `--tp/--pp`, refused by the same rules training and the planner use."""
    layout = Layout(tp=tp, pp=pp, sequence_parallel=False)
    check(cfg, layout, Workload(seq_len=1, global_batch=1, mode="infer"))
    return layout


def stage_units(cfg, layout: Layout, stage: int) -> list[str]:
    """The modules pipeline stage `stage` holds: its layers (the one cost-balanced split of
    `layout.stage_layers`), the embedding on the first stage, norm and head on the last."""
    layers = stage_layers(cfg, layout)[stage]
    return ((["tok_embeddings"] if stage == 0 else []) + [f"layers.{i}" for i in layers]
            + (["norm", "output"] if stage == layout.pp - 1 else []))


def rank_device(rank: int, world: int) -> str:
    """The device of worker `rank`: its own GPU when there is one per worker, else the CPU."""
    return f"cuda:{rank}" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "cpu"


class WorkerError(RuntimeError):
    """A worker process died; the message names its rank and exit code."""


def _wait(store, keys: list[str], procs) -> None:
    """Wait for the workers to set `keys`, failing fast if one of them has died (a blocking
    rendezvous or barrier would wait for the full timeout instead)."""
    while not store.check(keys):
        for rank, p in enumerate(procs, 1):
            if p.exitcode is not None:
                raise WorkerError(f"inference worker rank {rank} exited with code {p.exitcode} while loading "
                                  f"the model")
        time.sleep(0.02)


def _setup(rank: int, spec: SplitSpec, procs=()):
    """Join the group and build this rank's piece (rank 0 also watches the workers start)."""
    from ..io.weights import open_weights

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    device = rank_device(rank, spec.world)
    store = dist.TCPStore("127.0.0.1", spec.port, spec.world, is_master=rank == 0, timeout=timedelta(minutes=10))
    if rank == 0:
        _wait(store, [f"joined/{r}" for r in range(1, spec.world)], procs)
    else:
        store.set(f"joined/{rank}", "1")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=rank,
                            world_size=spec.world, timeout=timedelta(minutes=10))
    groups = [dist.new_group(list(range(s * spec.tp, (s + 1) * spec.tp))) for s in range(spec.pp)]
    source = open_weights(spec.path)
    cfg = source.config
    stage, tp_rank = divmod(rank, spec.tp)
    layout = split_layout(cfg, spec.tp, spec.pp)
    layers = stage_layers(cfg, layout)[stage]
    units = stage_units(cfg, layout, stage)
    placement = Placement({u: device for u in units}, device, {}, {})
    runner = Runner(source, PieceSpec(placement, spec.dtype, spec.num_blocks, spec.block_size, spec.max_context,
                                      tp_rank=tp_rank, tp_size=spec.tp, tp_group=groups[stage], layers=layers))
    if rank == 0:
        _wait(store, [f"ready/{r}" for r in range(1, spec.world)], procs)
    else:
        store.set(f"ready/{rank}", "1")
    dist.barrier()
    return runner


def _step(runner: Runner, spec: SplitSpec, tokens: torch.Tensor, step, last_only: bool):
    """This rank's share of one forward; rank 0 gets the logits."""
    rank = dist.get_rank()
    stage, tp_rank = divmod(rank, spec.tp)
    b, s = tokens.shape
    device = runner.input_device
    if stage == 0:
        x = tokens
    else:
        x = torch.empty(b, s, runner.cfg.dim, dtype=spec.dtype, device=device)
        dist.recv(x, src=rank - spec.tp)
    out = runner.forward(x, step, last_only)
    if stage < spec.pp - 1:
        dist.send(out.contiguous(), dst=rank + spec.tp)
    elif rank != 0 and tp_rank == 0:
        dist.send(out.contiguous(), dst=0)
    if rank != 0:
        return None
    if spec.pp > 1:
        out = torch.empty(b, 1 if last_only else s, runner.cfg.vocab_size, dtype=spec.dtype, device=device)
        dist.recv(out, src=(spec.pp - 1) * spec.tp)
    return out.float().cpu()


def _follow(rank: int, spec: SplitSpec) -> None:
    runner = _setup(rank, spec)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        _step(runner, spec, *box[0])
    runner.close()
    dist.destroy_process_group()


class SplitRunner:
    """Rank 0's handle on the split model; `forward` has the contract of `Runner.forward`."""

    def __init__(self, spec: SplitSpec):
        if dist.is_initialized():
            raise ConfigError("--tp/--pp start their own worker processes and cannot run inside an existing "
                              "torch.distributed job; call llmsplit.load outside torchrun")
        self.spec = spec
        self._threads = torch.get_num_threads()
        ctx = mp.get_context("spawn")
        self._procs = [ctx.Process(target=_follow, args=(r, spec), daemon=True) for r in range(1, spec.world)]
        for p in self._procs:
            p.start()
        self.runner = _setup(0, spec, self._procs)
        self.cfg = self.runner.cfg

    def forward(self, tokens: torch.Tensor, step, last_only: bool) -> torch.Tensor:
        dist.broadcast_object_list([(tokens, step, last_only)], src=0)
        return _step(self.runner, self.spec, tokens, step, last_only)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        dist.broadcast_object_list([None], src=0)
        self.runner.close()
        dist.destroy_process_group()
        for p in self._procs:
            p.join(timeout=30)
        torch.set_num_threads(self._threads)


def split_spec(path: str, tp: int, pp: int, dtype, num_blocks: int, block_size: int, max_context: int) -> SplitSpec:
    return SplitSpec(str(path), tp, pp, dtype, num_blocks, block_size, max_context, free_port())
