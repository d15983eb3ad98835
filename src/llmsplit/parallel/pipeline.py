"""Pipeline parallel with `torch.distributed.pipelining`.

The stack of layers is cut into stages balanced by cost (the output head and the
embedding weigh too, not only the layer count) and each pipeline rank keeps the layers of
its own stages — one stage for `gpipe`/`1f1b`, `pp_virtual_stages` looped stages for
`interleaved_1f1b`, two stages in a V for `zbv`/`dualpipev`.

A rank's stages share their modules with one "rank model": a `Transformer` from which
the layers of other ranks are deleted. Parameter names are therefore those of the full
model, so checkpoints, the optimizer and gradient clipping all see one ordinary module
whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import pipeline_stages_per_rank, stage_ids_of_rank
from ..models.llama import Transformer
from ..models.stages import split_layers

# torch.distributed.pipelining imports torch._dynamo: 3 s on a 2-core machine, paid by every
# run, so it is imported only by the functions of a run with pp > 1.
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
                    "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SINGLE_STAGE = ("gpipe", "1f1b")


@dataclass
class PipelineParts:
    rank_model: Transformer          # owns this rank's parameters under their full-model names
    stage_modules: list[nn.Module]   # one per local stage, sharing rank_model's modules
    stage_ids: list[int]
    n_stages: int
    stage_layers: list[list[int]]    # the layer indices of each local stage

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def split_model(model: Transformer, schedule: str, pp_rank: int, pp: int, virtual_stages: int) -> PipelineParts:
    """Cut `model` (on meta) down to the layers of this pipeline rank. The stage views are
    made later by `make_stages`, once the blocks are final (TP, checkpointing, compile)."""
    n_stages = pp * pipeline_stages_per_rank(schedule, virtual_stages)
    layers_of_stage = split_layers(model.cfg, n_stages)
    stage_ids = stage_ids_of_rank(schedule, pp_rank, pp, virtual_stages)
    mine = {i for s in stage_ids for i in layers_of_stage[s]}
    for key in [k for k in model.layers if int(k) not in mine]:
        del model.layers[key]
    if 0 not in stage_ids:
        model.tok_embeddings = None
    if n_stages - 1 not in stage_ids:
        model.norm = None
        model.output = None
    return PipelineParts(model, [], stage_ids, n_stages, [layers_of_stage[s] for s in stage_ids])


def make_stages(parts: PipelineParts) -> PipelineParts:
    views = [_stage_view(parts.rank_model, layers, first=s == 0, last=s == parts.n_stages - 1)
             for s, layers in zip(parts.stage_ids, parts.stage_layers)]
    return PipelineParts(parts.rank_model, views, parts.stage_ids, parts.n_stages, parts.stage_layers)


def _stage_view(model: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A Transformer that runs only `layer_ids`, sharing its modules (and so parameters)
    with `model`; Transformer.forward skips the embedding, norm and head that are None."""
    view = Transformer.__new__(Transformer)
    nn.Module.__init__(view)
    view.cfg = model.cfg
    view.tok_embeddings = model.tok_embeddings if first else None
    view.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
    view.norm = model.norm if last else None
    view.output = model.output if last else None
    view.register_buffer("rope_cos", model.rope_cos, persistent=False)
    view.register_buffer("rope_sin", model.rope_sin, persistent=False)
    return view


def share_buffers(parts: PipelineParts) -> None:
    """After the rank model is materialised, point every stage at its RoPE tables."""
    for view in parts.stage_modules:
        view.rope_cos, view.rope_sin = parts.rank_model.rope_cos, parts.rank_model.rope_sin


def build_schedule(parts: PipelineParts, schedule: str, n_microbatches: int, loss_fn, device: torch.device,
                   pp_group):
    from torch.distributed.pipelining import PipelineStage, schedules

    stages = [PipelineStage(m, sid, parts.n_stages, device, group=pp_group)
              for m, sid in zip(parts.stage_modules, parts.stage_ids)]
    cls = getattr(schedules, SCHEDULE_CLASSES[schedule])
    # scale_grads=False: our loss is already a sum divided by the tokens of the whole
    # data-parallel batch, so the micro-batch gradients simply add up.
    if schedule in SINGLE_STAGE:
        return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def bubble_fraction(schedule: str, pp: int, n_microbatches: int, virtual_stages: int) -> float:
    """The schedule's idle fraction in theory: (p−1)/(m+p−1) for GPipe and 1F1B,
    (p−1)/(v·m+p−1) interleaved; the V schedules overlap nearly all of it (taken as the
    interleaved figure with v = 2, an upper bound)."""
    if pp == 1:
        return 0.0
    v = pipeline_stages_per_rank(schedule, virtual_stages)
    return (pp - 1) / (v * n_microbatches + pp - 1)
