"""Attention that reads the paged KV pool in place, on CPU (paged_attention.c): decode (one
query a sequence) and prefill (a chunk of one sequence's queries, causal).

Why by hand: PyTorch has no paged-attention kernel on CPU (SDPA takes each sequence's keys
contiguous, padded to the longest), so without one every decode step first gathers every
sequence's keys and values out of the pool into a padded copy, in every layer, and SDPA then
reads the copy: a decode step of 28 streams on SmolLM2-135M spent 30% of its time in that
gather and 32% in SDPA (BENCHMARKS.md). This kernel reads each sequence's own rows of the
pool where they lie, once, with no padding: one layer's decode attention for 28 streams of
100-1,200 tokens took 2.3 ms against 10.6-19.3 ms gathered (float32 pool, 2 threads; the
bfloat16 pool 2.0 against 11.3-23.4 ms).

Prefill, by hand too: SDPA's CPU flash kernel takes a chunk that follows cached keys only with
an explicit mask, which it reads and never skips (and its causal form skipped no work here
either), at 75-150 GFLOP/s in float32: ~30% of a 512-token prefill step of SmolLM2-135M. The
chunk kernel skips the key blocks a row block cannot see and keeps R rows x 64 keys of scores
in registers: 398 queries after 4 cached keys 0.61 against 2.62 ms (gather + SDPA), 480 after
480 2.37 against 6.71, 256 after 768 1.76 against 3.71 (9 heads over 3, 2 threads); a
1,024-token prompt of SmolLM2-135M Q4_1 0.59 against 0.85 s (medians of 6, alternating). It
needs AVX-512 and head sizes 64 or 128; elsewhere chunks gather and run SDPA.

It is built at first use by `llmsplit.native` (the C compiler, this CPU, torch's OpenMP
runtime, a cache folder). Where it cannot be built or does not apply (another device, a
compute dtype other than float32), the cache gathers and runs SDPA as before, which gives
the same values to float rounding; `LLMSPLIT_PAGED_KERNEL=0` asks for that path too.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import native

SOURCE = Path(__file__).with_name("paged_attention.c")
KINDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}  # pool dtype -> entry point


class _Args(ctypes.Structure):
    """paged_attention.c's Args, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("lens", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("b", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("dim", ctypes.c_int64), ("width", ctypes.c_int64),
                ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
                ("window", ctypes.c_int64), ("threads", ctypes.c_int64)]


class _ChunkArgs(ctypes.Structure):
    """paged_attention.c's ChunkArgs, field for field."""
    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("k_scale", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("n", ctypes.c_int64), ("start", ctypes.c_int64),
                ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("q_head", ctypes.c_int64), ("q_row", ctypes.c_int64), ("scale", ctypes.c_float),
                ("threads", ctypes.c_int64)]


def _kernel() -> ctypes.CDLL | None:
    entries = {f"paged_decode_{kind}": ([ctypes.POINTER(_Args)], ctypes.c_int) for kind in KINDS.values()}
    entries.update({f"paged_prefill_{kind}": ([ctypes.POINTER(_ChunkArgs)], ctypes.c_int) for kind in KINDS.values()})
    entries["paged_prefill_supported"] = ([], ctypes.c_int)
    return native.library(SOURCE, entries, "LLMSPLIT_PAGED_KERNEL", "attention gathers the keys for SDPA")


def available() -> bool:
    """Whether the kernel is built (or can be, at this first call)."""
    return _kernel() is not None


def applies(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether decode attention for queries `q` over `pool` runs here (else: gather + SDPA)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and pool.dtype in KINDS
            and not torch.compiler.is_compiling() and _kernel() is not None)


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, slots: torch.Tensor, lens: torch.Tensor, scale: float,
           softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [b, heads, dim] float32 (one query token per sequence) against pool rows slots[i, :lens[i]]
    of the pools [rows, kv_heads, dim]: returns [b, heads, dim]. `applies` must hold."""
    # The kernel reads raw memory: anything but these layouts would be read as garbage.
    assert slots.dtype == lens.dtype == torch.int64 and slots.is_contiguous() and lens.is_contiguous()
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype
    q = q.contiguous()
    b, heads, dim = q.shape
    out = torch.empty_like(q)
    args = _Args(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                 k_scale.data_ptr() if k_scale is not None else None,
                 v_scale.data_ptr() if v_scale is not None else None,
                 slots.data_ptr(), lens.data_ptr(), out.data_ptr(),
                 b, heads, k_pool.shape[1], dim, slots.shape[1], scale, softcap or 0.0, window or 0,
                 torch.get_num_threads())
    if getattr(_kernel(), f"paged_decode_{KINDS[k_pool.dtype]}")(ctypes.byref(args)) != 0:
        raise MemoryError("the paged decode kernel could not allocate its per-thread scores")
    return out


PREFILL_DIMS = (64, 128)  # head sizes the chunk kernel has register blocking for


def applies_prefill(q: torch.Tensor, pool: torch.Tensor, softcap: float | None) -> bool:
    """Whether a chunk's queries q [1, heads, n, dim] attend here (else: gather + SDPA); a
    sliding window is the caller's to rule out."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[0] == 1 and q.shape[-1] in PREFILL_DIMS
            and q.stride(-1) == 1 and pool.dtype in KINDS and softcap is None and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and (lib := _kernel()) is not None and lib.paged_prefill_supported())


def prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, slots: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [1, heads, n, dim] float32, a chunk of one sequence at positions start .. start + n - 1,
    each seeing the pool rows slots[:start + i + 1] (causal): returns [n, heads * dim].
    `applies_prefill` must hold."""
    _, heads, n, dim = q.shape
    assert slots.dtype == torch.int64 and slots.is_contiguous() and slots.numel() >= start + n
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and k_pool.dtype == v_pool.dtype
    out = torch.empty(n, heads * dim)
    args = _ChunkArgs(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                      k_scale.data_ptr() if k_scale is not None else None,
                      v_scale.data_ptr() if v_scale is not None else None,
                      slots.data_ptr(), out.data_ptr(), n, start, heads, k_pool.shape[1], dim, q.stride(1),
                      q.stride(2), scale, torch.get_num_threads())
    if getattr(_kernel(), f"paged_prefill_{KINDS[k_pool.dtype]}")(ctypes.byref(args)) != 0:
        raise MemoryError("the paged prefill kernel could not allocate its keys and values")
    return out
