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

from ..layout import ACTION_COSTS, Layout, single_stage_order, stage_ids_of_rank, stage_layers
from ..models.llama import Transformer

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
    layout = Layout(pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual_stages)
    n_stages = layout.n_stages
    layers_of_stage = stage_layers(model.cfg, layout)
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
    built = cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if torch.distributed.get_backend(pp_group) == "gloo":
        post_receives_first(built.pipeline_order_with_comms)
    return built


def post_receives_first(order: dict[int, list]) -> None:
    """Move every receive of a step to its start, in the order the schedule posts them.

    The multi-stage schedules post each receive as soon as the sender has scheduled its
    send (torch's `_add_send_recv`), i.e. between compute actions. Over gloo, posting takes
    the TCP pair's lock, which the transport thread holds while it streams in an earlier
    message from the same peer; on a busy CPU that blocked the compute thread for 2-9 ms a
    post (zbv, m = 8, 101M model: 13-35 ms a step on the rank that receives from both
    directions, ~1.5 ms once posted up front). An irecv only names the buffer, and every
    micro-batch has its own, so posting them all first is safe; gloo matches a peer's
    messages in order, which is kept. Not for NCCL, whose receives run in order on the
    communicator's stream, so a receive posted early would hold back the sends behind it."""
    from torch.distributed.pipelining.schedules import _ComputationType

    receives = (_ComputationType.RECV_F, _ComputationType.RECV_B)
    for rank, actions in order.items():
        order[rank] = ([a for a in actions if a.computation_type in receives]
                       + [a for a in actions if a.computation_type not in receives])


def schedule_order(schedule) -> tuple[dict[int, list[tuple[int, str, int]]], dict[int, int]]:
    """(order, stage → rank) of the compute actions a torch.distributed.pipelining schedule
    runs, for `schedule_bubble`. The multi-stage schedules execute their `pipeline_order`;
    GPipe and 1F1B run a hard-coded loop whose `pipeline_order` only draws it (1F1B's starts
    the last rank at micro-batch 1 in torch 2.13), so theirs is rebuilt here."""
    pipeline_order = getattr(schedule, "pipeline_order", None)
    stage_rank = getattr(schedule, "stage_index_to_group_rank", None)
    if not pipeline_order or not stage_rank:
        kind = "gpipe" if type(schedule).__name__ == SCHEDULE_CLASSES["gpipe"] else "1f1b"
        pp = schedule._num_stages
        return single_stage_order(kind, pp, schedule._n_microbatches), {r: r for r in range(pp)}
    stage_rank = dict(stage_rank)
    order: dict[int, list] = {}
    for rank, actions in pipeline_order.items():
        items = []
        for a in actions:
            if a is None:
                continue
            leaves = [(x.stage_index, x.computation_type.value, x.microbatch_index) for x in (a.sub_actions or (a,))]
            leaves = [x for x in leaves if x[1] in ACTION_COSTS]
            if len(leaves) > 1:
                items.append(leaves)
            elif leaves:
                items.append(leaves[0])
        order[rank] = items
    return order, stage_rank
