"""The matmuls and lookups on packed weights, PyTorch's own CPU kernels chosen per shape.

Measured on this project's CI CPU (Xeon with avx512_bf16, avx512_vnni, amx_bf16/amx_int8;
one thread, CPU time per call, SmolLM2-135M's shapes; docs/quantization.md has the table):
- `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` are fast only with bfloat16
  inputs (their float32 paths are 5-60x slower than a float32 matmul), so the packed
  matmul feeds them bfloat16 and gives float32 back. At one row (decode) int4 takes
  0.10 ms for gate/up [3072, 576] against 0.27 ms for float32, the Q8_0 head [49152, 576]
  4.3 ms against 8.7 ms.
- From about 32 rows on they fall behind float32 (64 rows of gate/up: 3.0 ms against 2.4;
  256 rows: 11.5 against 6.9), so a prompt's rows dequantize the weight once for the call
  and run the float32 matmul: `KERNEL_MAX_ROWS`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .formats import Groups

KERNEL_MAX_ROWS = 32
ROW_ALIGN = 64  # the CPU int4 layout works in blocks of 64 (avx512) or 32 output rows


@functools.cache
def int4_block() -> int:
    """Rows per block of `_convert_weight_to_int4pack_for_cpu`'s layout on this machine, found
    by packing a probe: the layout is [rows / B, in, B / 2] bytes, row r and r + B/2 of a
    block sharing a byte (low, high nibble). Torch documents no layout, so it is checked."""
    probe = torch.randint(0, 16, (ROW_ALIGN * 2, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for b in (64, 32, 16):
        if torch.equal(_unpack(packed, b, *probe.shape), probe.to(torch.uint8)):
            return b
    raise RuntimeError("torch's CPU int4 weight layout is not one llmsplit knows; upgrade llmsplit")


def _unpack(packed: torch.Tensor, b: int, rows: int, cols: int) -> torch.Tensor:
    blocks = packed.reshape(rows // b, cols, b // 2)
    q = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [nb, cols, b]
    return q.transpose(1, 2).reshape(rows, cols)


def pack_int4(g: Groups) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8, scales-and-zeros bf16 [groups, rows, 2]) with rows padded to ROW_ALIGN.
    Packed a few thousand rows at a time: the kernel's int32 input is 4 bytes a weight."""
    rows, cols = g.q.shape
    pad = -rows % ROW_ALIGN
    q = F.pad(g.q, (0, 0, 0, pad)) if pad else g.q
    chunk = 4096
    packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + chunk].to(torch.int32), 1)
                        for i in range(0, rows + pad, chunk)])
    sz = torch.stack([g.scale, g.zero], dim=-1)
    sz = F.pad(sz, (0, 0, 0, 0, 0, pad)) if pad else sz
    return packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def unpack_int4(packed: torch.Tensor, sz: torch.Tensor, rows: int, group: int, doubled: bool,
                index: torch.Tensor | None = None) -> Groups:
    """The `Groups` of all rows (or of rows `index`) of a packed weight."""
    b = int4_block()
    padded = sz.shape[1]
    cols = packed.numel() * 2 // padded
    if index is None:
        q = _unpack(packed, b, padded, cols)[:rows]
        s = sz[:, :rows]
    else:
        blocks = packed.reshape(padded // b, cols, b // 2)[index // b]  # [n, cols, b/2]
        within = index % b
        byte = blocks.gather(2, (within % (b // 2))[:, None, None].expand(-1, cols, 1)).squeeze(2)
        q = torch.where((within >= b // 2)[:, None], byte >> 4, byte & 15)
        s = sz[:, index]
    s = s.float().transpose(0, 1)
    return Groups(q, s[..., 0].contiguous(), s[..., 1].contiguous(), group, doubled)


def int4_linear(x: torch.Tensor, w) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > KERNEL_MAX_ROWS:
        return F.linear(x, w.dequantize().to(x.dtype))
    xb = rows.to(torch.bfloat16)
    if w.doubled:
        xb = torch.cat([xb, xb], dim=1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group, w.scales)
    return y[:, :w.shape[0]].to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def int8_linear(x: torch.Tensor, w) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > KERNEL_MAX_ROWS:
        return F.linear(x, w.dequantize().to(x.dtype))
    y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), w.packed, w.scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
