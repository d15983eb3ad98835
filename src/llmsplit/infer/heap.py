"""Freed memory kept for reuse by inference processes (glibc's malloc, where it is the allocator).

PyTorch's CPU allocator takes every tensor from malloc. glibc hands a block above its mmap
threshold (dynamic, 128 KiB at first) to the kernel when it is freed, and shrinks the heap's
top above its trim threshold, so the next step's activation of the same size is new memory
that page-faults in zeroed: on SmolLM2-135M, some 512-token prefill steps faulted in 1,152
pages (4.5 MiB) for one gate/up output's copy, 1.2 ms against 0.17. Raising both thresholds
keeps freed blocks in the heap, where the next step takes them again: the serving benchmark's
burst (32 prompts, in one process) reached its median first token in 2.9-3.1 s against
4.8-5.5 s (seed 0) and 1.4 against 2.0-2.4 s (seed 1), alternating runs. The
process's peak is unchanged (what is kept was in use before); what it no longer does is give
memory back between steps. Other C libraries (musl, macOS) keep their own defaults."""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit); bigger blocks stay mmapped
TRIM_THRESHOLD = 1 << 30  # free memory the heap's top may keep before it shrinks


@functools.cache
def _glibc(name: str, argtypes: tuple, restype):
    """The C library's function `name`, typed; None where this libc has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


@functools.cache
def keep_freed_memory() -> bool:
    """Once a process: whether glibc's thresholds were raised (False: another libc)."""
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return (mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system now (glibc's malloc_trim; nothing elsewhere).
    Loading frees what it converted a tensor at a time (a GGUF tensor's unpacked bytes, the
    packer's int32 input, the q/k/v parts once fused), and glibc keeps those holes resident
    between live blocks: SmolLM2-135M Q4_1 ended its load at 172 MiB above the imports, 143
    after a trim. Called after each unit the runner loads (the unit's q/k/v and gate/up fused
    first, so their parts go too), before `keep_freed_memory` makes the heap keep them."""
    trim = _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)
