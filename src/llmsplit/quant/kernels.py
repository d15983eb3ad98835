"""The matmuls and lookups on packed weights, PyTorch's own CPU kernels chosen per shape.

Measured on this project's CI CPU (Xeon with avx512_bf16, avx512_vnni, amx_bf16/amx_int8;
one thread, CPU time per call, SmolLM2-135M's shapes; docs/quantization.md has the table):
- `_weight_int4pack_mm_for_cpu` and `_weight_int8pack_mm` are fast only with bfloat16
  inputs (their float32 paths are 5-60x slower than a float32 matmul), so the packed
  matmul feeds them bfloat16 and gives float32 back. At one row (decode) int4 takes
  0.10 ms for gate/up [3072, 576] against 0.27 ms for float32, the Q8_0 head [49152, 576]
  4.3 ms against 8.7 ms.
- From about 32 rows on they fall behind float32 (64 rows of gate/up: 3.0 ms against 2.4;
  256 rows: 11.5 against 6.9), so a prompt's rows (`KERNEL_MAX_ROWS`) widen the weight to
  bfloat16 tile by tile into a reused workspace and run oneDNN's bf16 GEMM (AMX here):
  512 rows of gate/up 9.5 ms against 24 for float32 and 41 for the int4 kernel, the Q8_0
  head 302 against 544 (under load; docs/quantization.md). Widening to float32 first, as
  before, cost more than the float32 matmul itself.
- On an AMD EPYC without AMX (avx512_bf16/vnni; BENCHMARKS.md) the crossover is ~24 rows for
  int8, ~40 for Q8_0's two nibbles and past 64 for int4: the switch stays at 32, not per kind.
- A CPU without bfloat16 arithmetic (AVX2 only) emulates oneDNN's bf16 GEMM ~90x slower than
  float32, so there the tiles are float32 (`tile_dtype`): a 72-token prompt of SmolLM2-135M
  Q4_1 10.9 s -> 0.29 s on an AVX2 EPYC.
- Up to 32 rows of an int4 weight (decode, where a token's time is the weights' bytes) run
  int4_matmul.cpp, the CPU kernel of the operator llmsplit::int4_mm, where the CPU has
  AVX-512 VNNI and VBMI: integer dot products of the nibbles with x kept to 15 bits,
  software-prefetched. Why by hand: at one row PyTorch's kernel widens every nibble to
  bfloat16 and is bound by that work, not by memory (gate/up 0.109 ms with the weight in
  cache, 8 GB/s). Compiled decode of SmolLM2-135M Q4_1 at 2 threads on the EPYC: 0.99-1.12x
  llama.cpp's tokens/s (BENCHMARKS.md, medians of three runs). It re-reads a 64-row block from cache for each
  row of x, and is still at least as fast as PyTorch's kernel up to 32 rows (`NATIVE_MAX_ROWS`).
  Its product is closer to the float one than PyTorch's kernel's (x is not rounded to
  bfloat16), and it reads the weights' float16 scales (`pack_int4`): GGUF's own, exactly.
  Int8 weights, other CPUs, and `LLMSPLIT_INT4_KERNEL=0` keep PyTorch's kernels (a portable
  form of this one was slower than them there, measured: docs/quantization.md).
- The same file widens a prompt's int4 tiles to bfloat16 (the operator llmsplit::int4_widen):
  one pass over nibbles and scales where torch ops took six, bit for bit the same values:
  SmolLM2-135M's gate/up 0.07-0.13 ms against 0.41-0.52 (2 threads, EPYC), ~6% of a
  512-token prefill step.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import native
from .formats import Groups
from .sizes import ROW_ALIGN

KERNEL_MAX_ROWS = 32
# Rows of x up to which int4_matmul.cpp runs (where the CPU has AVX-512 VNNI): every row count
# below the prompt path's, since it is at least as fast as PyTorch's kernel at each (gate/up of
# SmolLM2, weight from DRAM, 2 threads on the EPYC: 1 row 0.029 against 0.043 ms, 4 rows 0.057
# against 0.056, 16 rows 0.161 against 0.191, 32 rows 0.301 against 0.369), and it reads the
# float16 scales exactly (`pack_int4`).
NATIVE_MAX_ROWS = KERNEL_MAX_ROWS
SOURCE = Path(__file__).with_name("int4_matmul.cpp")

# The operator int4_matmul.cpp registers its CPU kernel for (where it is built and the CPU has
# the instructions), defined here so that its schema and its fake kernel (what torch.compile
# traces with) exist either way.
_ops = torch.library.Library("llmsplit", "DEF")
_ops.define("int4_mm(Tensor x, Tensor packed, Tensor scales, int rows, int group) -> Tensor")
torch.library.register_fake("llmsplit::int4_mm", lambda x, packed, scales, rows, group: x.new_empty(x.shape[0], rows),
                            lib=_ops)
_ops.define("int4_widen(Tensor packed, Tensor scales, int group, int start_block, int stop_block, bool doubled, "
            "Tensor(a!) out) -> ()")
torch.library.register_fake("llmsplit::int4_widen", lambda packed, scales, group, b0, b1, doubled, out: None, lib=_ops)


@native.process_constant  # eager decode asks ~120 times a token; a compiled step calls it too
def native_int4_available() -> bool:
    """Whether int4_matmul.cpp runs on this machine."""
    built = native.torch_ops(SOURCE, "LLMSPLIT_INT4_KERNEL", "int4 matmuls of few rows run PyTorch's kernel")
    return (int4_block() == 64 and built
            and torch._C._dispatch_has_kernel_for_dispatch_key("llmsplit::int4_mm", "CPU"))


def forget_native_int4() -> None:
    """Ask again at the next use (LLMSPLIT_INT4_KERNEL changed: tests, benchmarks)."""
    native.forget(SOURCE)
    native_int4_available.cache_clear()


def native_int4_applies(x: torch.Tensor, w) -> bool:
    """Checked cheapest first: eager decode asks this for every int4 matmul."""
    if x.numel() > NATIVE_MAX_ROWS * x.shape[-1] or x.device.type != "cpu":
        return False
    padded, group = w.scales.shape[1], w.group
    return (group % 32 == 0 and x.shape[-1] % 32 == 0 and (w.packed.numel() * 2 // padded) % group == 0
            and native_int4_available())


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
    """(packed uint8, scales [groups, rows, 2]) with rows padded to ROW_ALIGN. Packed a few
    thousand rows at a time: the kernel's int32 input is 4 bytes a weight.

    The scales take one of two forms, by which kernels will read them:
    - where int4_matmul.cpp runs: float16 (scale, min), a weight q * scale + min. GGUF's
      Q4_0, Q4_1 and Q8_0 store exactly these numbers in float16 (Q4_1's d and m; Q4_0's and
      Q8_0's min is -8 d or -128 d), so the packed weights are the file's to the bit, as the
      float32 model's are: rounding the scale and zero to bfloat16 moved SmolLM2's mean NLL
      by -0.00115 (docs/quantization.md). Q4_K's sub-block products and scales computed at
      load are rounded to float16 (11 bits, where bfloat16 keeps 8).
      GGUF Q8_0's two nibble matrices (`doubled`) keep the file's d alone, float16
      [in / group, rows, 1]: the high nibbles' scale and min are 16 d and -128 d, the low ones'
      d and 0, so two pairs a block would hold 40 bytes per 32 weights where the file has 34
      (SmolLM2-135M's embedding and head: 5.3 MB more held and read for every token).
    - elsewhere: PyTorch's int4 kernel's bfloat16 (scale, zero), a weight (q - 8) * scale +
      zero; that kernel takes no float16 scales with bfloat16 inputs, and its float16 inputs
      run 50-120x slower (measured)."""
    rows, cols = g.q.shape
    pad = -rows % ROW_ALIGN
    q = F.pad(g.q, (0, 0, 0, pad)) if pad else g.q
    chunk = 4096
    packed = torch.cat([torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[i:i + chunk].to(torch.int32), 1)
                        for i in range(0, rows + pad, chunk)])
    if native_int4_available():
        d = _q8_0_d(g)
        if d is not None:
            return packed, _grouped(d[..., None], pad)
        sz = _grouped(torch.stack([g.scale, g.zero - 8 * g.scale], dim=-1), pad).to(torch.float16)
        if torch.isfinite(sz).all():
            return packed, sz
        # Past float16's range (a min -8 d below -65504, a Q4_0 block's d past 8188): PyTorch's
        # form, which int4_matmul.cpp reads too.
    return packed, _grouped(torch.stack([g.scale, g.zero], dim=-1), pad).to(torch.bfloat16)


def _q8_0_d(g: Groups) -> torch.Tensor | None:
    """Q8_0's float16 d [rows, in / group] when g's two nibble halves are the split of one
    int8 with that scale (hi: 16 d and zero 0, lo: d and zero 8 d, exactly), else None."""
    if not g.doubled:
        return None
    half = g.scale.shape[1] // 2
    d = g.scale[:, half:]
    d16 = d.to(torch.float16)
    exact = (torch.equal(d16.float(), d) and torch.equal(g.scale[:, :half], 16 * d)
             and not g.zero[:, :half].any() and torch.equal(g.zero[:, half:], 8 * d))
    return d16 if exact else None


def _grouped(sz: torch.Tensor, pad: int) -> torch.Tensor:
    """[rows, groups, 2] -> [groups, rows + pad, 2], the padded rows zero."""
    return (F.pad(sz, (0, 0, 0, 0, 0, pad)) if pad else sz).transpose(0, 1).contiguous()


def _scale_and_zero(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (scale, zero) [groups, rows] of any form of `pack_int4` ([groups', rows, 1 or 2]):
    a weight (q - 8) * scale + zero."""
    if sz.shape[-1] == 1:  # Q8_0's d: the high nibbles' groups, then the low ones'
        d = sz[..., 0].float()
        return torch.cat([16 * d, d]), torch.cat([torch.zeros_like(d), 8 * d])
    scale, other = sz[..., 0].float(), sz[..., 1].float()
    return scale, other + 8 * scale if sz.dtype == torch.float16 else other


def _pytorch_scales(w) -> torch.Tensor:
    """The scales as PyTorch's int4 kernel takes them. A weight packed for int4_matmul.cpp
    (float16) is converted at each call: that happens only where the kernel was switched off
    after the weight was packed (LLMSPLIT_INT4_KERNEL=0 then `forget_native_int4`)."""
    if w.scales.dtype == torch.bfloat16:
        return w.scales
    return torch.stack(_scale_and_zero(w.scales), dim=-1).to(torch.bfloat16)


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
        # Each row's byte column alone, [n, cols]: gathering its whole blocks first ([n, cols, b/2],
        # 36 KiB a token for SmolLM2's Q8_0 embedding) cost 14 ms per 512-token prefill step.
        within = index % b
        byte = packed.reshape(padded // b, cols, b // 2)[index // b, :, within % (b // 2)]
        q = torch.where((within >= b // 2)[:, None], byte >> 4, byte & 15)
        s = sz[:, index]
    scale, zero = _scale_and_zero(s)
    return Groups(q, scale.t().contiguous(), zero.t().contiguous(), group, doubled)


def int4_linear(x: torch.Tensor, w) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > KERNEL_MAX_ROWS:
        return _tiled(x, w, _int4_tile)
    if native_int4_applies(rows, w):
        y = torch.ops.llmsplit.int4_mm(rows.float().contiguous(), w.packed, w.scales, w.shape[0], w.group)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    xb = rows.to(torch.bfloat16)
    if w.doubled:
        xb = torch.cat([xb, xb], dim=1)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.packed, w.group, _pytorch_scales(w))
    return y[:, :w.shape[0]].to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def int8_linear(x: torch.Tensor, w) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > KERNEL_MAX_ROWS:
        return _tiled(x, w, _int8_tile)
    y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), w.packed, w.scales)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


# Many rows (a prompt): the weight is widened to bfloat16 a tile of output rows at a time into
# one reused workspace and multiplied there (oneDNN's bf16 GEMM, AMX where the CPU has it), so
# no whole float weight ever exists and no allocation is paid per call. A tile is at most
# TILE_ELEMS weights: 4 MiB of bf16, the size of a layer's gate/up on SmolLM2-135M.
TILE_ELEMS = 1 << 21
_workspaces = threading.local()


def _workspace(slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_workspaces, slot, None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = torch.empty(max(numel, TILE_ELEMS), dtype=dtype)
        setattr(_workspaces, slot, buf)
    return buf[:numel]


@functools.cache
def tile_dtype() -> torch.dtype:
    """What a prompt's tiles are widened to: bfloat16 where oneDNN multiplies it natively
    (avx512_bf16, AMX), else float32. On a CPU with AVX2 only, a bfloat16 GEMM is emulated:
    72 x 576 by 576 x 1536 took 103 ms against 1.1 ms in float32 (AMD EPYC, AVX2, 2 threads),
    and a 72-token prefill of SmolLM2-135M Q4_1 10.9 s against 0.19 s for its float32 copy."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def _tiled(x: torch.Tensor, w, tile_fn) -> torch.Tensor:
    """x @ w.T with the weight widened tile by tile (`tile_fn(w, start, stop)` -> [in, stop - start]
    in `tile_dtype()`)."""
    dtype = tile_dtype()
    rows = x.reshape(-1, x.shape[-1]).to(dtype)
    n = w.shape[0]
    cols = w.shape[1] if w.kind == "int8" else w.packed.numel() * 2 // w.scales.shape[1]  # Q8_0: 2 x in
    step = max(ROW_ALIGN, TILE_ELEMS // cols // ROW_ALIGN * ROW_ALIGN)
    y = torch.empty(rows.shape[0], n, dtype=dtype)
    for start in range(0, n, step):
        stop = min(n, start + step)
        torch.mm(rows, tile_fn(w, start, stop), out=y[:, start:stop])
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _int8_tile(w, start: int, stop: int) -> torch.Tensor:
    out = _workspace("tile", (stop - start) * w.shape[1], tile_dtype()).view(stop - start, w.shape[1])
    torch.mul(w.packed[start:stop], w.scales[start:stop, None], out=out)
    return out.t()


def _int4_tile(w, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of an int4 weight as `tile_dtype()` [in, rows] from its scales as
    packed (`pack_int4`): q * scale + min (float16) or (q - 8) * scale + zero (bfloat16), in
    float32 and rounded once to the tile's dtype. The kernel's layout is [rows / B, in, B/2]
    bytes (`int4_block`), rows j and j + B/2 of a block sharing a byte, so the nibbles split
    into [blocks, in, 2, B/2] are the rows in order. Every step is one contiguous pass; an
    `addcmul` whose scales broadcast with a stride was 10x slower, measured."""
    b = int4_block()
    cols = w.packed.numel() * 2 // w.scales.shape[1]
    wanted, stop = stop - start, -(-stop // b) * b  # the last tile reads the padded rows too
    rows = stop - start
    if native_int4_available() and tile_dtype() == torch.bfloat16:  # one pass, the same values (int4_widen)
        out = _workspace("bf16", cols // (2 if w.doubled else 1) * rows, torch.bfloat16).view(-1, rows)
        torch.ops.llmsplit.int4_widen(w.packed, w.scales, w.group, start // b, stop // b, w.doubled, out)
        return out[:, :wanted]
    p = w.packed.view(-1, cols, b // 2)[start // b:stop // b]
    q = _workspace("i8", p.numel() * 2, torch.int8).view(-1, cols, 2, b // 2)
    torch.bitwise_and(p, 15, out=q[:, :, 0])
    torch.bitwise_right_shift(p, 4, out=q[:, :, 1])
    sz = w.scales[:, start:stop]  # [groups, rows, 2]
    if w.doubled:  # Q8_0: the int8 value is 16 (hi - 8) + lo, the scale the low half's d, exactly
        cols //= 2
        q = q[:, :cols].sub_(8).mul_(16).add_(q[:, cols:])
        sz = sz if sz.shape[-1] == 1 else sz[sz.shape[0] // 2:]
    elif w.scales.dtype == torch.bfloat16:  # (q - 8) * scale + zero; float16's q * scale + min
        q.sub_(8)
    out = _workspace("tile", cols * rows, tile_dtype()).view(cols, rows)
    out.view(cols, -1, b).copy_(q.reshape(-1, cols, b).transpose(0, 1))
    grouped = out.view(sz.shape[0], -1, rows)
    scale = sz[..., 0].unsqueeze(1).contiguous()
    if w.doubled:
        grouped.mul_(scale)
    else:
        torch.addcmul(sz[..., 1].unsqueeze(1).contiguous(), grouped, scale, out=grouped)
    return out[:, :wanted]
