"""Expert parallel (`parallel.ep`): the experts of every MoE layer split over the ep ranks of
the data-parallel group, applied to the plain model from outside.

Each expert weight ([experts, out, in]) becomes a DTensor sharded on dim 0 over the `ep` mesh,
so a rank allocates and updates only its experts, and checkpoints (DCP, by name and global
shape) load under any other ep degree. The router and everything else stay replicated.
A layer's forward routes this rank's tokens as in one process, then `ExpertDispatch`, set as
the layer's `dispatch`:

1. exchanges the token counts per expert (all-to-all of [experts] integers),
2. sends each routed row to the rank holding its expert (all-to-all of the rows, uneven splits),
3. reorders what arrived from (source rank, expert) to (expert, source rank) and runs the
   local experts as one grouped matmul,
4. sends the outputs back the way they came (the inverse all-to-all).

The row exchanges use torch's autograd-aware functional collective
(`all_to_all_single_autograd`), whose backward is the inverse exchange of the gradients, so an
expert's gradient on its rank sums the contributions of the tokens of every ep rank. Gradient
averaging then differs from the rest of the model: an expert's replicas are the `expert_dp`
ranks (the data-parallel ranks outside its ep group, and under context parallel their cp
ranks), and its gradient already holds ep ranks' tokens, so it is summed over expert_dp and
divided by the whole dp × cp degree (ParallelModel.sync_gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from ..models.moe import MoE, grouped_swiglu

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over `ep_mesh` (model still on the meta device)."""
    dispatch = ExpertDispatch(ep_mesh)
    for module in model.modules():
        if isinstance(module, MoE):
            for name in EXPERT_WEIGHTS:
                full = getattr(module, name)
                setattr(module, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)]),
                                                   requires_grad=full.requires_grad))
            module.dispatch = dispatch


def is_expert_weight(p: torch.Tensor) -> bool:
    """An expert weight sharded by `apply_ep` (a DTensor over the ep mesh)."""
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and mesh.mesh_dim_names == ("ep",)


class ExpertDispatch:
    """MoE.dispatch under expert parallel: (layer, rows sorted by expert, counts per expert) ->
    the experts' outputs for those rows, computed on the ranks that hold the experts."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        # received[s, e]: the rows rank s sends to this rank's local expert e.
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, -1)
        send = counts.view(ep, -1).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, recv, send, self.group)
        n_local = received.shape[1]
        # Arrived rows lie by (source rank, expert); the grouped matmul wants them by expert.
        segment = torch.repeat_interleave(torch.arange(ep * n_local, device=rows.device), received.flatten())
        by_expert = ((segment % n_local) * ep + segment // n_local).argsort(stable=True)
        # FSDP (zero 2/3) casts the rest of the model to its compute dtype, never the experts.
        local = [getattr(moe, name).to_local().to(rows.dtype) for name in EXPERT_WEIGHTS]
        out = grouped_swiglu(arrived[by_expert], received.sum(0), *local)
        back = out[by_expert.argsort()]  # as they arrived
        return all_to_all_single_autograd(back, send, recv, self.group)
