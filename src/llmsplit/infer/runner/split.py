"""A model split over N worker processes: tensor parallel (`tp`), pipeline stages (`pp`) or
both (rank = stage * tp + tp_rank). Gloo on CPU, NCCL on GPUs.

The calling process is rank 0 and drives: for each step it broadcasts the command (tokens
and the KV-cache step) and takes part in the computation; the other ranks follow in a loop
until told to stop. Rank 0 can therefore be an interactive Python session or an HTTP
server. The spine is training's: the followers are started by `launch.Followers` (torch's
elastic process layer and env:// rendezvous, as `launch()` starts training's workers),
every rank finds its stage, its tensor-parallel group and its pipeline neighbours on a
`parallel.mesh.Mesh` built from the `Layout`, and the stages hold the layers of
`layout.stage_layers`. Each rank opens the weights itself and reads only its slices
(tensor parallel) or its stage's layers (pipeline).

Across machines (`nnodes` > 1, training's `--nnodes/--node-rank/--master-addr/--master-port`)
node k holds ranks k * world / nnodes onwards, as training's launcher numbers them: node 0
runs rank 0 (the caller: the HTTP server) and its own followers, every other node only
followers (`follow_node`), which join node 0's store at master_addr:master_port.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...allocator import keep_freed_memory, reapply_choice
from ...errors import ConfigError
from ...launch import Followers, Nodes
from ...layout import Layout, Workload, check, stage_layers
from ...parallel.mesh import Mesh, ParallelDims
from ..config import InferConfig
from ..engine.step import PackedStep
from ...plan.placement import Placement
from .runner import PieceSpec, Runner


@dataclass(frozen=True)
class SplitSpec:
    """What every worker of a split needs: the model's path and the whole `InferConfig`, and
    what node 0 derived from them (the checked layout, the compute dtype, the KV pool's blocks,
    the context, the weights' packing on this machine)."""
    path: str
    config: InferConfig
    layout: Layout
    dtype: torch.dtype
    num_blocks: int
    max_context: int
    quantize: str | None = None

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def world(self) -> int:
        return self.layout.world

    @property
    def nodes(self) -> Nodes:
        return self.config.nodes

    @property
    def lora(self) -> tuple[tuple[str, str], ...]:
        return self.config.adapters

    def device(self, rank: int) -> str:
        """The device of worker `rank`: its own GPU when its machine has one per local worker, else the CPU."""
        per_node = self.nodes.per_node(self.world)
        return rank_device(rank % per_node, per_node)


def split_layout(cfg, tp: int, pp: int, compile: bool = False, quantize: str = "none") -> Layout:
    """The layout of `--tp/--pp` (with --compile, weights packed as `quantize`), refused by the
    same rules training and the planner use."""
    layout = Layout(tp=tp, pp=pp, sequence_parallel=False)
    check(cfg, layout, Workload(seq_len=1, global_batch=1, mode="infer", compile=compile, quantize=quantize))
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


def _load_piece(spec: SplitSpec) -> tuple[Runner, Mesh]:
    """This rank's place on the job's mesh and its piece of the model. The mesh comes
    first: its groups are made by every rank together, so none may fail before them (a
    rank that dies loading is then reported by rank 0's watch, not awaited in a collective)."""
    from ...io.weights import open_weights

    device = spec.device(dist.get_rank())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # before the mesh, whose NCCL communicators bind to it
    mesh = Mesh(ParallelDims.from_layout(spec.layout), device.split(":")[0])
    stage, tp_rank = mesh.rank("pp"), mesh.rank("tp")
    same_adapters(spec)
    source = open_weights(spec.path)
    cfg = source.config
    placement = Placement({u: device for u in stage_units(cfg, spec.layout, stage)}, device, {}, {})
    runner = Runner(source, PieceSpec(placement, spec.dtype, spec.num_blocks, spec.config.block_size, spec.max_context,
                                      tp_rank=tp_rank, tp_size=spec.tp, tp_group=mesh.group("tp"),
                                      layers=stage_layers(cfg, spec.layout)[stage], quantize=spec.quantize,
                                      kv_dtype=spec.config.kv_dtype))
    _serve_adapters(runner, spec)
    return runner, mesh


def same_adapters(spec: SplitSpec) -> None:
    """Refuse, on the rank that has them, other --lora flags than node 0's: that node's ranks
    would compute other layers' updates than the rest. Run right after the mesh, before any
    rank can fail loading (a collective awaited then would hang instead of being reported)."""
    served = [spec.lora]
    dist.broadcast_object_list(served, src=0)
    if served[0] != spec.lora:
        raise ConfigError(f"this node was started with --lora {_flags(spec.lora)} but node 0 serves --lora "
                          f"{_flags(served[0])}; start every node with node 0's --lora flags")


def _serve_adapters(runner: Runner, spec: SplitSpec) -> None:
    """Every rank applies the adapters rank 0 serves, each reading them itself (as it reads its
    weights) and keeping its stage's and shard's part (`Runner.serve_adapters`)."""
    from ...io.weights import run_adapters

    if spec.lora:
        adapters = [run_adapters(path, f"--lora {name}", runner.cfg) for name, path in spec.lora]
        runner.serve_adapters([name for name, _ in spec.lora], [a for a, _ in adapters], [s for _, s in adapters])


def _flags(lora) -> str:
    return " ".join(f"{name}={path}" for name, path in lora) or "(none)"


def _step(runner: Runner, mesh: Mesh, tokens: torch.Tensor, step, last_only: bool, adapters=None):
    """This rank's share of one forward; rank 0 gets the logits. Activations go to the next
    stage of the same tensor-parallel rank (the mesh's pp group); the last stage's tp rank 0
    sends the logits back to stage 0, whose tp rank 0 is rank 0."""
    stage, pp, pp_group = mesh.rank("pp"), mesh.size("pp"), mesh.group("pp")
    b, s = tokens.shape
    dtype, device = runner.spec.dtype, runner.input_device
    if stage == 0:
        x = tokens
    else:
        x = torch.empty(b, s, runner.cfg.dim, dtype=dtype, device=device)
        dist.recv(x, group=pp_group, group_src=stage - 1)
    out = runner.forward(x, step, last_only, adapters)
    if stage < pp - 1:
        dist.send(out.contiguous(), group=pp_group, group_dst=stage + 1)
    elif stage > 0 and mesh.rank("tp") == 0:
        dist.send(out.contiguous(), group=pp_group, group_dst=0)
    if dist.get_rank() != 0:
        return None
    if pp > 1:
        rows = step.pick.numel() if isinstance(step, PackedStep) else 1 if last_only else s
        out = torch.empty(b, rows, runner.cfg.vocab_size, dtype=dtype, device=device)
        dist.recv(out, group=pp_group, group_src=pp - 1)
    return out.float().cpu()


def _follow(spec: SplitSpec) -> None:
    """A follower rank: load its piece, then run the steps rank 0 broadcasts until it says stop."""
    keep_freed_memory()  # a worker of generate/serve: its steps reuse their memory (allocator.py)
    runner, mesh = _load_piece(spec)
    dist.barrier()
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            break
        _step(runner, mesh, *box[0])
    runner.close()


def _followers(spec: SplitSpec) -> Followers:
    if dist.is_initialized():
        raise ConfigError("--tp/--pp start their own worker processes and cannot run inside an existing "
                          "torch.distributed job; call llmsplit.load outside torchrun")
    backend = "nccl" if spec.device(0).startswith("cuda") else "gloo"
    return Followers(_follow, (spec,), spec.world, backend, nodes=spec.nodes)


def follow_node(spec: SplitSpec) -> None:
    """Run this node's ranks (node_rank > 0) until node 0's rank 0 closes the model."""
    _followers(spec).follow_to_the_end()


class SplitRunner:
    """Rank 0's handle on the split model; `forward` has the contract of `Runner.forward`."""

    def __init__(self, spec: SplitSpec):
        self.spec = spec
        self.followers = _followers(spec)
        reapply_choice()  # starting the followers set the training workers' malloc policy here
        try:
            self.runner, self.mesh = _load_piece(spec)
            loaded = dist.barrier(async_op=True)
            self.followers.wait_until(lambda: loaded.is_completed() and loaded.wait(), " while loading the model")
        except BaseException:
            self.followers.kill()
            raise
        self.cfg = self.runner.cfg

    @property
    def decodes_in_place(self) -> bool:
        return self.runner.decodes_in_place

    @property
    def decode_compiled(self) -> bool:
        return False  # (layout.rules refuses --compile now under a split; auto stays eager there)

    def forward(self, tokens: torch.Tensor, step, last_only: bool, adapters=None) -> torch.Tensor:
        dist.broadcast_object_list([(tokens, step, last_only, adapters)], src=0)
        return _step(self.runner, self.mesh, tokens, step, last_only, adapters)

    def close(self) -> None:
        if self.followers is None or not dist.is_initialized():  # closed, or ended at exit (Followers.kill)
            return
        dist.broadcast_object_list([None], src=0)
        self.runner.close()
        self.followers.close()
        self.followers = None
