"""glibc malloc's settings, which llmsplit's own processes choose for the work they do.

glibc serves a block above its mmap threshold from a mapping of its own, returned to the
kernel when freed, and gives the top of its heap back once more than the trim threshold is
free. Both start small (128 KiB) and the mmap threshold rises by itself as large blocks are
freed, up to 32 MiB. A fresh mapping is zero pages: every 4 KiB of it faults the first time
it is written.

- Training workers keep big blocks in their own mappings (`launch.workers`, 4 MiB): FSDP's
  per-step gather/scatter buffers otherwise fragment the heap and are never returned.
- Generation and serving keep what they freed (`keep_freed_memory`): a step's activations
  are the same few hundred blocks of up to tens of MiB every step, and faulting them in again
  each time cost more than the work. SmolLM2-135M, 32 requests of 16-1,024 prompt tokens
  arriving together, 2 threads: the first 15 steps (512 tokens each) took 10.7 s as glibc
  sets itself, 6.7 and 7.4 s (two runs) with both thresholds raised, 12.8 s with the mmap one
  alone and 20.8 s with the trim one alone (which also stops the mmap one rising). One
  512-token prefill step faulted in 1,152 pages (4.5 MiB) for one gate/up output's copy, 1.2 ms
  against 0.17; the serving benchmark's burst (32 prompts, in one process) reached its median
  first token in 2.9-3.1 s against 4.8-5.5 s (seed 0) and 1.4 against 2.0-2.4 s (seed 1),
  alternating runs. The price: the process keeps the memory of its busiest step until it
  exits (its peak is unchanged: what is kept was in use before).
- Loading and quantizing give back the free pages they leave between live blocks
  (`give_back_freed_memory`, glibc's malloc_trim): raised thresholds or not, glibc keeps such
  holes resident, and PyTorch has no call that returns them.

The CLI's `generate` and `serve` and their tensor- and pipeline-parallel workers keep freed
memory from the start; the inference runner does once a model is loaded on the CPU. Other C
libraries (musl, macOS) keep their own defaults: every function here does nothing there.
"""

from __future__ import annotations

import ctypes
import functools

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MAX_MMAP_THRESHOLD = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2); bigger blocks stay mmapped
TRIM_THRESHOLD = 1 << 30  # free memory the heap's top may keep before it shrinks

_keeping = False  # whether this process chose keep_freed_memory (reapply_choice)


@functools.cache
def _glibc(name: str, argtypes: tuple, restype):
    """The C library's function `name`, typed; None where this libc has none."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def mallopt(option: int, value: int) -> bool:
    """glibc's mallopt: whether it took the setting (False where the C library is another)."""
    fn = _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    return fn is not None and bool(fn(option, int(value)))


def keep_freed_memory() -> bool:
    """Keep freed blocks for the next step (see the module's docstring): blocks up to 32 MiB
    come from the heap, and the heap gives back only what exceeds 1 GiB. Whether glibc took
    both settings (False: another C library)."""
    global _keeping
    _keeping = True
    return mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def reapply_choice() -> None:
    """After something set the training policy in this process (starting workers does, for
    workers forked from it): this process's own choice again, if it made one."""
    if _keeping:
        keep_freed_memory()


def give_back_freed_memory() -> None:
    """Return the heap's free pages to the system now (glibc's malloc_trim; nothing elsewhere).
    Loading frees what it converted a tensor at a time (a GGUF tensor's unpacked bytes, the
    packer's int32 input, the q/k/v parts once fused), and glibc keeps those holes resident
    between live blocks: SmolLM2-135M Q4_1 ended its load at 172 MiB above the imports, 143
    after a trim. Quantizing a QLoRA base does the same with torchao's temporaries of many
    sizes (to_nf4 compares every value with the 16 NF4 levels): a whole model quantized layer
    by layer left 415 MiB resident that nothing used (SmolLM2-135M's shapes: RSS 871 MiB, 455
    after a trim), counted in every rank's peak from then on."""
    trim = _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is not None:
        trim(0)
