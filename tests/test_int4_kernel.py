"""The int4 matmul for one row of x (quant/int4_matmul.c) against the dequantized weight's
product: int4 quantized at load, GGUF Q4_1, and Q8_0 kept as two nibble matrices, over row
counts that leave a padded last block; its fallback to PyTorch's kernel; and the compile
cache key that says which of the two a graph calls."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from llmsplit import native  # noqa: E402
from llmsplit.quant import from_gguf_blocks, kernels, pack_groups, quantize  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.native_int4_available(),
                                reason="no C compiler, or a CPU without AVX-512 VNNI/VBMI")


def _weights(rows, cols):
    w = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32))
    return {"int4": quantize(w, "int4"),
            "q4_1": pack_groups(from_gguf_blocks("Q4_1", gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1),
                                                 rows, cols)),
            "q8_0": pack_groups(from_gguf_blocks("Q8_0", gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                                 rows, cols))}


@pytest.mark.parametrize("rows,cols", [(100, 128), (192, 576), (64, 32)])
def test_one_row_matches_the_dequantized_product(rows, cols, monkeypatch):
    calls = []
    lib = kernels._native_int4()

    class Counted:
        def int4_matmul(self, args):
            calls.append(args._obj.m)
            return lib.int4_matmul(args)

    monkeypatch.setattr(kernels, "_native_int4", Counted)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols))
    for kind, w in _weights(rows, cols).items():
        want = x @ w.dequantize().t()
        got = torch.nn.functional.linear(x, w)
        # x is kept to 15 bits a block of 32 (PyTorch's kernel rounds it to bfloat16's 8).
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4 * want.abs().max(), kind
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert torch.equal(torch.nn.functional.linear(x, w), got), "threads changed the sums"
        finally:
            torch.set_num_threads(threads)
    assert calls == [1] * 6


def test_more_rows_and_no_kernel_run_pytorchs(monkeypatch, request):
    """Above NATIVE_MAX_ROWS rows, and with LLMSPLIT_INT4_KERNEL=0, PyTorch's kernel runs (its
    bf16 rounding, within 1% here); the compile cache key of a packed weight says which."""
    w = _weights(100, 128)["q4_1"]
    x = torch.randn(3, 128)
    want = x @ w.dequantize().t()
    assert not kernels.native_int4_applies(x, w) and kernels.native_int4_applies(x[:1], w)
    assert (torch.nn.functional.linear(x, w) - want).abs().max() < 0.01 * want.abs().max()
    key = w._stable_hash_for_caching()
    monkeypatch.setenv("LLMSPLIT_INT4_KERNEL", "0")
    native.forget(kernels.SOURCE)
    request.addfinalizer(lambda: native.forget(kernels.SOURCE))
    assert not kernels.native_int4_available() and not kernels.native_int4_applies(x[:1], w)
    got = torch.nn.functional.linear(x[:1], w)
    assert (got - want[:1]).abs().max() < 0.01 * want.abs().max()
    assert w._stable_hash_for_caching() != key
