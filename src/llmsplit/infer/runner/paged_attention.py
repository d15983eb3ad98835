"""Attention that reads the paged KV pool in place, on CPU (paged_attention.cpp, the operators
llmsplit::paged_decode and llmsplit::paged_prefill): decode (one query a sequence) and prefill
(a chunk of one sequence's queries, causal).

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

It is built at first use by `llmsplit.native` (the C++ compiler against torch's headers, this
CPU, torch's OpenMP runtime, a cache folder) and registered in torch's dispatcher, so eager
steps and a compiled decode step call the same kernel: a compiled step used to gather and run
SDPA, whose per-head matrix-vector calls and copies were ~8% of a compiled SmolLM2-135M Q4_1
token at batch 1 (perf). Where it cannot be built or does not apply (another device, a compute
dtype other than float32), the cache gathers and runs SDPA as before, which gives the same
values to float rounding; `LLMSPLIT_PAGED_KERNEL=0` asks for that path too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ... import native

SOURCE = Path(__file__).with_name("paged_attention.cpp")
KINDS = (torch.float32, torch.bfloat16, torch.int8)  # the pool dtypes the kernels read

# The operators' schemas and fake kernels (what torch.compile traces with), defined here so that
# they exist whether or not paged_attention.cpp is built; it registers their CPU kernels.
_ops = torch.library.Library("llmsplit", "FRAGMENT")
_ops.define("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_scale, Tensor? v_scale, Tensor slots, "
            "Tensor lens, float scale, float softcap, int window) -> Tensor")
torch.library.register_fake("llmsplit::paged_decode", lambda q, *args: q.new_empty(q.shape), lib=_ops)
_ops.define("paged_prefill(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_scale, Tensor? v_scale, Tensor slots, "
            "int start, float scale) -> Tensor")
torch.library.register_fake("llmsplit::paged_prefill",
                            lambda q, *args: q.new_empty(q.shape[2], q.shape[1] * q.shape[3]), lib=_ops)


@native.process_constant  # asked once a layer a step, by compiled decode steps too
def available() -> bool:
    """Whether the kernels are built (or can be, at this first call)."""
    return native.torch_ops(SOURCE, "LLMSPLIT_PAGED_KERNEL", "attention gathers the keys for SDPA")


@native.process_constant
def prefill_available() -> bool:
    """Whether the chunk kernel runs here too (it needs AVX-512)."""
    return available() and torch._C._dispatch_has_kernel_for_dispatch_key("llmsplit::paged_prefill", "CPU")


def forget() -> None:
    """Ask again at the next use (LLMSPLIT_PAGED_KERNEL changed: tests)."""
    native.forget(SOURCE)
    available.cache_clear()
    prefill_available.cache_clear()


def applies(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether decode attention for queries `q` over `pool` runs here (else: gather + SDPA)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and pool.dtype in KINDS and available()


def decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
           v_scale: torch.Tensor | None, slots: torch.Tensor, lens: torch.Tensor, scale: float,
           softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q [b, heads, dim] float32 (one query token per sequence) against pool rows slots[i, :lens[i]]
    of the pools [rows, kv_heads, dim]: returns [b, heads, dim]. `applies` must hold."""
    return torch.ops.llmsplit.paged_decode(q, k_pool, v_pool, k_scale, v_scale, slots, lens, scale, softcap or 0.0,
                                           window or 0)


PREFILL_DIMS = (64, 128)  # head sizes the chunk kernel has register blocking for


def applies_prefill(q: torch.Tensor, pool: torch.Tensor, softcap: float | None) -> bool:
    """Whether a chunk's queries q [1, heads, n, dim] attend here (else: gather + SDPA); a
    sliding window is the caller's to rule out."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[0] == 1 and q.shape[-1] in PREFILL_DIMS
            and q.stride(-1) == 1 and pool.dtype in KINDS and softcap is None and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and prefill_available())


def prefill(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None, slots: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [1, heads, n, dim] float32, a chunk of one sequence at positions start .. start + n - 1,
    each seeing the pool rows slots[:start + i + 1] (causal): returns [n, heads * dim].
    `applies_prefill` must hold."""
    return torch.ops.llmsplit.paged_prefill(q, k_pool, v_pool, k_scale, v_scale, slots, start, scale)
