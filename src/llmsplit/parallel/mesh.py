"""One object that owns the device mesh and answers "which rank am I in each dimension".

The mesh always has the four dimensions pp × dp_replicate × dp_shard × tp (size 1 where
unused), so the code that asks for a group never has to know which techniques are on.
Data loading and DDP use the flattened data-parallel dimension "dp". Training and
inference `--tp/--pp` both build it from a `Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ParallelSection
from ..layout import Layout

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
        return cls(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp // layout.dp_replicate,
                   tp=layout.tp)

    @classmethod
    def from_config(cls, par: ParallelSection) -> "ParallelDims":
        assert par.dp > 0, "resolve parallel.dp before building the mesh"
        return cls.from_layout(Layout(dp=par.dp, dp_replicate=par.dp_replicate, tp=par.tp, pp=par.pp))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


class Mesh:
    def __init__(self, dims: ParallelDims, device_type: str):
        assert dist.is_initialized(), "the process group must exist before the mesh"
        assert dims.world_size == dist.get_world_size(), (dims, dist.get_world_size())
        self.dims = dims
        self.device_type = device_type
        self.mesh: DeviceMesh = init_device_mesh(
            device_type, tuple(getattr(dims, d) for d in DIMS), mesh_dim_names=DIMS)
        # `_flatten` is how torchtitan names a merged dimension; there is no public API yet.
        self.dp_mesh: DeviceMesh = self.mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def rank(self, dim: str) -> int:
        if dim == "dp":
            return self.dp_mesh.get_local_rank()
        return self.mesh.get_local_rank(dim)

    def size(self, dim: str) -> int:
        return self.dims.dp if dim == "dp" else getattr(self.dims, dim)

    def group(self, dim: str):
        return self.dp_mesh.get_group() if dim == "dp" else self.mesh.get_group(dim)
