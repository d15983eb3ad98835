"""The native kernels' builds (llmsplit.native). Their tests skip where a kernel is not built,
which on a CPU that has the kernel's instructions would hide a broken build: here that fails.
And the code a CPU without AVX-512 runs (paged attention's portable decode loops; PyTorch's int4
kernels) is built on this machine too (LLMSPLIT_NATIVE_GENERIC=1) and passes the same tests."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmsplit import native
from llmsplit.infer.runner import paged_attention
from llmsplit.quant import kernels

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_builds_where_the_cpu_has_its_instructions():
    if os.environ.get("LLMSPLIT_NATIVE") == "0" or os.environ.get(native.GENERIC) == "1":
        pytest.skip("native kernels switched off or built generic by the environment")
    flags = native.cpu_flags()
    assert paged_attention.available(), "paged_attention.cpp did not build: install a C++ compiler (g++)"
    if "avx512f" in flags:
        assert paged_attention.prefill_available(), "the CPU has AVX-512F but the prefill kernel is not registered"
    if {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"} <= flags:
        assert kernels.native_int4_available(), "the CPU has AVX-512 VNNI/VBMI but int4_matmul.cpp is not in use"


def test_the_generic_build_passes_the_kernel_tests():
    """LLMSPLIT_NATIVE_GENERIC=1 builds without AVX-512 (a library of its own in the cache): the
    paged decode kernel's portable loops run the decode tests (the prefill kernel, AVX-512 only,
    is absent), and the int4 layers run PyTorch's kernels, as on a CPU without AVX-512."""
    env = {**os.environ, native.GENERIC: "1"}
    probe = ("from llmsplit.infer.runner import paged_attention as p; from llmsplit.quant import kernels as k; "
             "print(p.available(), p.prefill_available(), k.native_int4_available())")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.split()[-3:] == ["True", "False", "False"], out.stderr[-2000:]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_paged_attention.py", "tests/test_int4_kernel.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and " passed" in summary and "failed" not in summary, run.stdout[-3000:]
    skipped = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    # only what needs AVX-512 skips: the prefill kernel's tests and int4_matmul.cpp's
    assert all("AVX-512" in line for line in skipped), skipped
