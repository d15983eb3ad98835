"""One object that owns the device mesh and answers "which rank am I in each dimension".

The mesh always has the six dimensions pp × dp_replicate × edp × ep × cp × tp (size 1 where
unused), so the code that asks for a group never has to know which techniques are on.
Expert parallel splits the sharded data-parallel ranks: `dp_shard` is edp × ep flattened,
`ep` holds one copy of the experts between its ranks and `edp` (with dp_replicate and cp:
"expert_dp") the ranks that hold the same experts. Data loading uses the flattened
data-parallel dimension "dp" (rank order the same as without ep). Context parallel's cp ranks
read the same rows (each a share of every sequence) and hold the same weights, so gradients
are reduced over "dp_cp", dp × cp flattened (FSDP shards over "dp_shard_cp"), as torchtitan's
dp_shard_cp mesh does. Training and inference `--tp/--pp` both build it from a `Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ParallelSection
from ..layout import Layout

DIMS = ("pp", "dp_replicate", "edp", "ep", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1

    @property
    def edp(self) -> int:
        return self.dp_shard // self.ep

    @classmethod
    def from_layout(cls, layout: Layout) -> "ParallelDims":
        return cls(pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp // layout.dp_replicate,
                   tp=layout.tp, ep=layout.ep, cp=layout.cp)

    @classmethod
    def from_config(cls, par: ParallelSection) -> "ParallelDims":
        assert par.dp > 0, "resolve parallel.dp before building the mesh"
        return cls.from_layout(Layout(dp=par.dp, dp_replicate=par.dp_replicate, tp=par.tp, pp=par.pp,
                                      ep=par.ep, cp=par.cp))

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def ranks(self, **coords: int) -> list[int]:
        """The global ranks at these coordinates of the mesh (e.g. `ranks(pp=1)`: stage 1's),
        numbered as `init_device_mesh` numbers them: row-major over DIMS. The one place the
        rank order is written, for what needs it without a process group (a device map)."""
        sizes = [getattr(self, d) for d in DIMS]
        found = []
        for rank in range(self.world_size):
            rest, at = rank, {}
            for dim, size in zip(reversed(DIMS), reversed(sizes)):
                at[dim], rest = rest % size, rest // size
            if all(at[d] == v for d, v in coords.items()):
                found.append(rank)
        return found


class Mesh:
    def __init__(self, dims: ParallelDims, device_type: str):
        assert dist.is_initialized(), "the process group must exist before the mesh"
        assert dims.world_size == dist.get_world_size(), (dims, dist.get_world_size())
        self.dims = dims
        self.device_type = device_type
        self.mesh: DeviceMesh = init_device_mesh(
            device_type, tuple(getattr(dims, d) for d in DIMS), mesh_dim_names=DIMS)
        # `_flatten` is how torchtitan names a merged dimension; there is no public API yet.
        # torch deprecates slicing a flattened dimension from the root mesh: they are kept here.
        self.flat: dict[str, DeviceMesh] = {
            "dp_shard": self.mesh["edp", "ep"]._flatten("dp_shard"),
            "expert_dp": self.mesh["dp_replicate", "edp"]._flatten("expert_dp"),
            "dp": self.mesh["dp_replicate", "edp", "ep"]._flatten("dp")}
        # Without cp these are the same ranks as dp and dp_shard: no second set of groups.
        self.flat["dp_cp"], self.flat["dp_shard_cp"] = self.flat["dp"], self.flat["dp_shard"]
        if dims.cp > 1:
            self.flat["dp_cp"] = self.mesh["dp_replicate", "edp", "ep", "cp"]._flatten("dp_cp")
            self.flat["dp_shard_cp"] = self.mesh["edp", "ep", "cp"]._flatten("dp_shard_cp")
            # The cp ranks of an ep rank hold its experts too, and route other tokens to them.
            self.flat["expert_dp"] = self.mesh["dp_replicate", "edp", "cp"]._flatten("expert_dp_cp")
        self.dp_mesh: DeviceMesh = self.flat["dp"]
        # Hybrid sharding's (replicas, shards) mesh, shards being edp × ep × cp: with expert or
        # context parallel the rest of the model shards over those ranks too. Unflattened from
        # dp_cp, as slicing the flattened dp_shard_cp from the root mesh is deprecated.
        self.hybrid: DeviceMesh | None = None
        if dims.dp_replicate > 1:
            self.hybrid = self.flat["dp_cp"]._unflatten(0, (dims.dp_replicate, dims.dp_shard * dims.cp),
                                                        ("replicas", "shards"))

    def sub(self, dim: str) -> DeviceMesh:
        """The 1-D mesh of `dim`, one of DIMS or a flattened one (dp, dp_shard, expert_dp, dp_cp, dp_shard_cp)."""
        return self.flat[dim] if dim in self.flat else self.mesh[dim]

    def rank(self, dim: str) -> int:
        return self.sub(dim).get_local_rank()

    def size(self, dim: str) -> int:
        return self.sub(dim).size()

    def group(self, dim: str):
        return self.sub(dim).get_group()
