"""glibc malloc's settings, which llmsplit's own processes choose for the work they do.

glibc serves a block above its mmap threshold from a mapping of its own, returned to the
kernel when freed, and gives the top of its heap back once more than the trim threshold is
free. Both start small (128 KiB) and the mmap threshold rises by itself as large blocks are
freed, up to 32 MiB. A fresh mapping is zero pages: every 4 KiB of it faults the first time
it is written.

- Training workers keep big blocks in their own mappings (`launch.workers`, 4 MiB): FSDP's
  per-step gather/scatter buffers otherwise fragment the heap and are never returned.
- Generation and serving reuse what they freed (`reuse_freed_memory`): a step's activations
  are the same few hundred blocks of up to tens of MiB every step, and faulting them in again
  each time cost more than the work. SmolLM2-135M, 32 requests of 16-1,024 prompt tokens
  arriving together, 2 threads: the first 15 steps (512 tokens each) took 10.7 s as glibc
  sets itself, 6.7 and 7.4 s (two runs) with both thresholds raised, 12.8 s with the mmap one
  alone and 20.8 s with the trim one alone (which also stops the mmap one rising). The
  price: the process keeps the memory of its busiest step until it exits.

Only llmsplit's own processes change them (the CLI's `generate` and `serve`, their tensor- and
pipeline-parallel workers); a library caller's allocator is its own.
"""

from __future__ import annotations

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30

_reusing = False  # whether this process chose reuse_freed_memory (reapply_choice)


def mallopt(option: int, value: int) -> None:
    """glibc's mallopt; nothing where the C library is another (musl, macOS)."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(option, int(value))
    except (OSError, AttributeError):
        pass


def reuse_freed_memory() -> None:
    """Keep freed blocks for the next step (see the module's docstring): blocks up to 32 MiB
    come from the heap, and the heap gives back only what exceeds 1 GiB."""
    global _reusing
    _reusing = True
    mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def reapply_choice() -> None:
    """After something set the training policy in this process (starting workers does, for
    workers forked from it): this process's own choice again, if it made one."""
    if _reusing:
        reuse_freed_memory()
