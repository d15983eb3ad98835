"""`PackedWeight`: a linear layer's or embedding's weight [out, in] kept packed in memory.

A tensor subclass rather than a swapped module, because the plain model calls
`F.linear` on weights directly (the fused q/k/v and gate/up weights of inference,
`runner.fuse_projections`): the subclass catches `F.linear`, `F.embedding` and `torch.cat`
(the fusion) at `__torch_function__` and answers them from the packed bytes, so neither
`models/` nor the runner knows. Any other operation on it is refused by name: nothing
silently widens a packed weight to float.

It is a traceable wrapper subclass (`__tensor_flatten__`, as torchao's quantized tensors
are), so `torch.compile` inlines the same `__torch_function__` and the graph calls the same
int4/int8 kernels on the packed tensors: the compiled decode step keeps the weights packed
(an aten op reaching the subclass itself would still be refused, so a graph cannot widen
one either). Measured against the alternatives in docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import kernels
from .formats import Groups

PACK_ROWS = 2048  # output rows packed at a time (a multiple of the kernel's row blocks)


class PackedWeight(torch.Tensor):
    """kind "int4": `packed` is the CPU kernel's layout, `scales` [groups, rows, 2] (or Q8_0's d,
    [groups, rows, 1]) in one of `kernels.pack_int4`'s forms, `doubled` for Q8_0's two nibbles. kind "int8": `packed` int8 [out, in]
    and `scales` bf16 [out]. `rows` (start, stop, whole) makes it a view of rows [start, stop)
    of the `whole`-row weight whose `packed` and `scales` it shares (`base`)."""

    @staticmethod
    def __new__(cls, kind, packed, scales, shape, group=0, doubled=False, rows=None):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=packed.device,
                                                   requires_grad=False)

    def __init__(self, kind, packed, scales, shape, group=0, doubled=False, rows=None):
        self.kind, self.packed, self.scales, self.group, self.doubled = kind, packed, scales, group, doubled
        self.rows = rows

    @property
    def base(self) -> PackedWeight | None:
        """The whole weight a view of rows reads, or None for a whole weight."""
        if self.rows is None:
            return None
        return PackedWeight(self.kind, self.packed, self.scales, (self.rows[2], self.shape[1]), self.group,
                            self.doubled)

    def __tensor_flatten__(self):
        return ["packed", "scales"], (self.kind, tuple(self.shape), self.group, self.doubled, self.rows)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        kind, shape, group, doubled, rows = meta
        return PackedWeight(kind, inner["packed"], inner["scales"], shape, group, doubled, rows)

    def _stable_hash_for_caching(self) -> str:
        """What torch.compile's on-disk cache keys a graph input on: the layout, not the values,
        and which kernel the graph calls (AOTAutograd traces `__torch_function__` below the
        key it caches on, so a graph built where int4_matmul.cpp runs would otherwise be served
        to a process where it does not)."""
        return repr((self.__tensor_flatten__()[1], tuple(self.packed.shape), tuple(self.scales.shape),
                     str(self.scales.dtype), self.kind == "int4" and kernels.native_int4_available()))

    @classmethod
    def from_groups(cls, g: Groups) -> PackedWeight:
        packed, sz = kernels.pack_int4(g)
        return cls("int4", packed, sz, (g.q.shape[0], g.in_features), g.group, g.doubled)

    @classmethod
    def from_row_chunks(cls, rows: int, groups_of: Callable[[slice], Groups]) -> PackedWeight:
        """Packed PACK_ROWS output rows at a time into tensors allocated once, so the unpacked
        form (a byte a weight, and the int32 the kernel's packer takes) exists for one chunk
        only: SmolLM2's Q8_0 embedding is 56 MB as bytes, 4x that as int32."""
        first = cls.from_groups(groups_of(slice(0, min(rows, PACK_ROWS))))
        if rows <= PACK_ROWS:
            return first
        padded = -(-rows // kernels.ROW_ALIGN) * kernels.ROW_ALIGN
        packed = first.packed.new_empty((padded, first.packed.shape[1]))
        scales = first.scales.new_empty((first.scales.shape[0], padded, first.scales.shape[2]))
        for start in range(0, rows, PACK_ROWS):
            part = first if start == 0 else cls.from_groups(groups_of(slice(start, min(rows, start + PACK_ROWS))))
            n = part.packed.shape[0]  # the last chunk's padded rows included
            packed[start:start + n], scales[:, start:start + n] = part.packed, part.scales
        return cls("int4", packed, scales, (rows, first.shape[1]), first.group, first.doubled)

    @classmethod
    def int8(cls, q: torch.Tensor, scale: torch.Tensor) -> PackedWeight:
        return cls("int8", q, scale.to(torch.bfloat16), tuple(q.shape))

    def __repr__(self):
        return f"PackedWeight({self.kind}, shape={tuple(self.shape)}, group={self.group}, doubled={self.doubled})"

    def form(self) -> tuple:
        """What two weights must share for their rows to be concatenated packed: the kind, the
        group, and the form of the scales (`kernels.pack_int4`: dtype, numbers a group)."""
        numbers = self.scales.shape[-1] if self.kind == "int4" else 0
        return self.kind, self.group, self.doubled, self.scales.dtype, numbers

    def _same(self) -> PackedWeight:
        return PackedWeight(self.kind, self.packed, self.scales, tuple(self.shape), self.group, self.doubled,
                            self.rows)

    def groups(self, index: torch.Tensor | None = None) -> Groups:
        assert self.kind == "int4" and self.base is None
        return kernels.unpack_int4(self.packed, self.scales, self.shape[0], self.group, self.doubled, index)

    def dequantize(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out, in] (or rows `index` of it)."""
        if self.base is not None:
            full = self.base.dequantize()
            return full[self.rows[0]:self.rows[1]] if index is None else full[self.rows[0] + index]
        if self.kind == "int8":
            q = self.packed if index is None else self.packed[index]
            s = self.scales if index is None else self.scales[index]
            return q.float() * s.float()[:, None]
        return self.groups(index).dequantize()

    def nbytes_held(self) -> dict[int, int]:
        """Bytes of the tensors behind this weight, by storage (a view shares its base's)."""
        if self.base is not None:
            return self.base.nbytes_held()
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (self.packed, self.scales)}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear(*args, **kwargs)
        if func is F.embedding:
            ids, weight = args[0], args[1]
            return weight.dequantize(ids.reshape(-1)).reshape(*ids.shape, weight.shape[1])
        if func is torch.cat:
            return _cat(*args, **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[1], slice) and args[1].step in (None, 1):
            self = args[0]
            start, stop, _ = args[1].indices(self.shape[0])
            offset, whole = (0, self.shape[0]) if self.rows is None else (self.rows[0], self.rows[2])
            return PackedWeight(self.kind, self.packed, self.scales, (stop - start, self.shape[1]), self.group,
                                self.doubled, (offset + start, offset + stop, whole))
        if func in (torch.Tensor.detach, torch.Tensor.requires_grad_, torch.Tensor.contiguous):
            return args[0]._same() if func is torch.Tensor.detach else args[0]
        if func is torch.Tensor.to:
            return _to(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not defined on a packed (int4/int8) weight; llmsplit runs packed "
                                  f"weights through F.linear and F.embedding only")


def _linear(x, weight, bias=None):
    if weight.base is not None:
        y = _linear(x, weight.base)[..., weight.rows[0]:weight.rows[1]]
    elif weight.kind == "int8":
        y = kernels.int8_linear(x, weight)
    else:
        y = kernels.int4_linear(x, weight)
    return y if bias is None else y + bias


def _cat(tensors, dim=0):
    """The fused q/k/v and gate/up weights: rows of packed weights of one kind, repacked once
    at load. Weights of mixed kinds (a GGUF that stores v in another type) are widened."""
    tensors = list(tensors)
    first = tensors[0]
    same = all(isinstance(t, PackedWeight) and t.base is None and t.form() == first.form() for t in tensors)
    if dim != 0 or not same:
        return torch.cat([t.dequantize() if isinstance(t, PackedWeight) else t for t in tensors], dim)
    if first.kind == "int8":
        return PackedWeight.int8(torch.cat([t.packed for t in tensors]), torch.cat([t.scales for t in tensors]))
    if all(t.packed.shape[0] == t.shape[0] for t in tensors):  # no padded rows: the blocks of rows just follow
        return PackedWeight("int4", torch.cat([t.packed for t in tensors]), torch.cat([t.scales for t in tensors], 1),
                            (sum(t.shape[0] for t in tensors), first.shape[1]), first.group, first.doubled)
    parts = [t.groups() for t in tensors]
    return PackedWeight.from_groups(Groups(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                                           torch.cat([p.zero for p in parts]), first.group, first.doubled))


def _to(self, *args, **kwargs):
    """A floating dtype is the activations' (packed weights keep their bytes); another device
    is refused: the CUDA kernels want another layout, packed at load on that device."""
    device = kwargs.get("device") or next((a for a in args if isinstance(a, (str, torch.device))), None)
    if device is not None and torch.device(device).type != self.device.type:
        raise NotImplementedError("packed weights stay on the CPU they were packed on in this version")
    return self


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers `module` holds, each storage once, packed weights
    by their packed bytes: what a loaded model costs in memory."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if isinstance(t, PackedWeight):
            seen.update(t.nbytes_held())
        elif t.device.type != "meta":
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
