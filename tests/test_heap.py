"""Inference processes keep freed memory for reuse (allocator.py): a block of an activation's
size, freed and taken again, comes back without page faults."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A fresh process: glibc's thresholds move as blocks are freed, so each variant starts from them.
SCRIPT = """
import resource, sys, torch
from llmsplit.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.ones(6 << 20)  # 24 MiB of float32, written whole and freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(5 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    return int(subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def test_a_freed_activation_is_reused_without_page_faults():
    """A 24 MiB block freed, then 20 MiB taken: it fits in the freed one (an exact fit would not
    hold malloc's alignment header), which stays in the heap; glibc's defaults unmap it."""
    keep, default = _faults("keep"), _faults("default")
    assert keep < 100, keep
    # glibc's defaults give the block back to the kernel: its 5,120 pages of 4 KiB fault in again
    # (unless transparent huge pages back it, when both fault a few 2 MiB pages).
    assert default > 4000 or default < 100, default


# Freed below a live block, a heap block stays resident (the thresholds `keep_freed_memory`
# sets make the heap keep even 24 MiB); `give_back_freed_memory` returns its pages.
TRIM = """
import sys, torch
from llmsplit.allocator import give_back_freed_memory, keep_freed_memory
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) << 10
assert keep_freed_memory()
low, high = torch.ones(6 << 20), torch.ones(1 << 10)
before = rss()
del low
if sys.argv[1] == "trim":
    give_back_freed_memory()
print(before - rss())
"""


def test_freed_memory_goes_back_when_asked():
    """What loading frees between live blocks (a tensor's conversion transients, the q/k/v parts
    once fused) leaves the resident set when given back, and only then."""
    def released(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", TRIM, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert released("trim") > 20 << 20
    assert released("keep") < 4 << 20
