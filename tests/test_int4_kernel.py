"""The int4 matmul for up to 32 rows of x (quant/int4_matmul.cpp) against the dequantized
weight's product: int4 quantized at load, GGUF Q4_0, Q4_1, Q4_K, and Q8_0 kept as two nibble
matrices, over row counts that leave a padded last block; GGUF's float16 scales kept to the bit;
its fallback to PyTorch's kernel; the compile cache key that says which of the two a graph calls;
and the prompt path's tiles widened to bfloat16 by the same file (int4_widen) against the torch
form. The tests of PyTorch's kernels (what a CPU without AVX-512 VNNI/VBMI runs) run everywhere;
tests/test_native_builds.py fails where the kernel's tests would skip on a CPU that has them."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from llmsplit.quant import from_gguf_blocks, kernels, pack_groups, packed_nbytes, quantize  # noqa: E402

needs_kernel = pytest.mark.skipif(not kernels.native_int4_available(),
                                  reason="no C++ compiler, a CPU without AVX-512 VNNI/VBMI, or LLMSPLIT_NATIVE_GENERIC=1")


def _blocks(rows, cols, kind):
    w = np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32)
    return gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))


def _q4_k_blocks(rows, cols):
    """Q4_K super-blocks of random bytes with sane d and dmin (gguf has no Q4_K quantizer)."""
    rng = np.random.default_rng(rows + cols)
    raw = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, 2 * len(raw)).astype(np.float16)  # d and dmin of each super-block
    raw[:, :4] = np.frombuffer(d.tobytes(), np.uint8).reshape(-1, 4)
    return raw.reshape(rows, -1)


def _weights(rows, cols):
    w = torch.from_numpy(np.random.default_rng(rows).standard_normal((rows, cols)).astype(np.float32))
    packed = {"int4": quantize(w, "int4"),
              **{kind.lower(): pack_groups(from_gguf_blocks(kind, _blocks(rows, cols, kind), rows, cols))
                 for kind in ("Q4_0", "Q4_1", "Q8_0")}}
    if cols % 256 == 0:  # Q4_K's super-blocks: 256 inputs
        packed["q4_k"] = pack_groups(from_gguf_blocks("Q4_K", _q4_k_blocks(rows, cols), rows, cols))
    return packed


def _kernel_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "llmsplit::int4_mm")


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_scales_are_kept_to_the_bit(kind):
    """The packed weight is the file's: its float16 (scale, min) give back gguf's own
    dequantization exactly (bfloat16 scales had moved SmolLM2's mean NLL by -0.00115)."""
    rows, cols = 100, 128
    blocks = _blocks(rows, cols, kind)
    w = pack_groups(from_gguf_blocks(kind, blocks, rows, cols))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, kind)))
    assert w.scales.dtype == torch.float16 and torch.equal(w.dequantize(), want.reshape(rows, cols))
    # Q8_0 keeps the file's d alone: 34 bytes a block of 32 weights, as in the file, not 40.
    assert w.scales.shape[-1] == (1 if kind == "Q8_0" else 2)
    held = sum(w.nbytes_held().values())
    assert held == packed_nbytes((rows, cols), "q8_0" if kind == "Q8_0" else "int4")
    if kind == "Q8_0":
        assert held == 128 * cols * 34 // 32  # rows padded to 128


def _product_is_the_dequantized_weights(w, cols):
    # A fixed x: the error is x's rounding times the one large group, so an x whose product
    # happens to cancel to a small number can pass 1e-3 of it (seen with unseeded draws).
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(0))
    want = x @ w.dequantize().t()
    assert torch.isfinite(w.dequantize()).all()
    # (x's 15 bits against one group 2,000 times the others': 3e-4 of the largest output)
    assert (torch.nn.functional.linear(x, w) - want).abs().max() < 1e-3 * want.abs().max()


@needs_kernel
def test_scales_past_float16s_range_keep_pytorchs_form():
    """A group whose min (-8 d) is past float16's range keeps the bfloat16 form, which the kernel
    reads too; a Q8_0 block whose 16 d and -128 d are past it keeps its d alone, which is not."""
    g = from_gguf_blocks("Q4_0", _blocks(64, 64, "Q4_0"), 64, 64)
    g.scale[0, 0] = 16384.0  # min -131072
    w = pack_groups(g)
    assert w.scales.dtype == torch.bfloat16
    _product_is_the_dequantized_weights(w, 64)
    g = from_gguf_blocks("Q8_0", _blocks(64, 64, "Q8_0"), 64, 64)
    d = 8192.0  # the first block of row 0: groups 0 (high nibbles) and 2 (low ones)
    g.scale[0, 0], g.zero[0, 0], g.scale[0, 2], g.zero[0, 2] = 16 * d, 0.0, d, 8 * d
    w = pack_groups(g)
    assert w.scales.dtype == torch.float16 and w.scales.shape[-1] == 1 and w.scales[0, 0, 0] == d
    _product_is_the_dequantized_weights(w, 64)


@needs_kernel
@pytest.mark.parametrize("rows,cols,m", [(100, 128, 1), (192, 576, 1), (64, 32, 1), (100, 128, 3), (192, 576, 32),
                                         (100, 512, 1), (100, 512, 32)])
def test_few_rows_match_the_dequantized_product(rows, cols, m):
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(cols))
    for kind, w in _weights(rows, cols).items():
        want = x @ w.dequantize().t()
        got = []
        assert _kernel_calls(lambda: got.append(torch.nn.functional.linear(x, w))) == 1, kind
        got = got[0]
        # x is kept to 15 bits a block of 32 (PyTorch's kernel rounds it to bfloat16's 8).
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4 * want.abs().max(), kind
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert torch.equal(torch.nn.functional.linear(x, w), got), "threads changed the sums"
        finally:
            torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(100, 128), (192, 576), (100, 512)])
def test_a_prompts_widened_tile_is_the_torch_forms_bit_for_bit(rows, cols, monkeypatch, request):
    """Many rows (a prompt) widen the weight to bfloat16 tile by tile: int4_widen's one pass
    gives the values the torch form's six passes give, for every kind, padded rows included."""
    weights = _weights(rows, cols)
    tiles = {kind: kernels._int4_tile(w, 64, rows).clone() for kind, w in weights.items()}
    monkeypatch.setenv("LLMSPLIT_INT4_KERNEL", "0")
    kernels.forget_native_int4()
    request.addfinalizer(kernels.forget_native_int4)
    for kind, w in weights.items():
        want = kernels._int4_tile(w, 64, rows)
        assert want.shape == (cols, rows - 64) and torch.equal(tiles[kind], want), kind
        assert torch.allclose(want.float().t(), w.dequantize()[64:], rtol=1e-2, atol=1e-3), kind


@needs_kernel
def test_the_operator_refuses_what_it_would_misread():
    """Called directly with a layout it has no code for, the operator raises instead of reading
    memory it does not own."""
    w = _weights(100, 128)["q4_1"]
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.llmsplit.int4_mm(torch.randn(1, 128, dtype=torch.float64), w.packed, w.scales, 100, 32)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.llmsplit.int4_mm(torch.randn(1, 96), w.packed, w.scales, 100, 32)
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.llmsplit.int4_widen(w.packed, w.scales, 32, 0, 1, False, torch.empty(128, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="do not match"):
        torch.ops.llmsplit.int4_widen(w.packed, w.scales, 32, 0, 3, False, torch.empty(128, 192, dtype=torch.bfloat16))
    q8 = _weights(100, 128)["q8_0"]  # Q8_0's d alone: its columns are two nibble matrices
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.llmsplit.int4_mm(torch.randn(1, 256), q8.packed, q8.scales, 100, 32)
    with pytest.raises(RuntimeError, match="does not match its scales"):
        torch.ops.llmsplit.int4_widen(q8.packed, q8.scales, 32, 0, 1, False, torch.empty(256, 64, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_more_rows_and_no_kernel_run_pytorchs(kind, monkeypatch, request):
    """Above NATIVE_MAX_ROWS rows the prompt path runs (bf16 tiles); with LLMSPLIT_INT4_KERNEL=0
    PyTorch's kernel runs on the same weight (its bf16 rounding, within 1% here, its scales
    converted from the float16 forms); the compile cache key of a packed weight says which."""
    w = _weights(100, 128)[kind]
    x = torch.randn(kernels.NATIVE_MAX_ROWS + 1, 128)
    want = x @ w.dequantize().t()
    assert not kernels.native_int4_applies(x, w) and kernels.native_int4_applies(x[:-1], w)
    assert _kernel_calls(lambda: torch.nn.functional.linear(x, w)) == 0
    assert (torch.nn.functional.linear(x, w) - want).abs().max() < 0.01 * want.abs().max()
    key = w._stable_hash_for_caching()
    monkeypatch.setenv("LLMSPLIT_INT4_KERNEL", "0")
    kernels.forget_native_int4()
    request.addfinalizer(kernels.forget_native_int4)
    assert not kernels.native_int4_available() and not kernels.native_int4_applies(x[:1], w)
    got = []
    assert _kernel_calls(lambda: got.append(torch.nn.functional.linear(x[:1], w))) == 0
    got = got[0]
    assert (got - want[:1]).abs().max() < 0.01 * want.abs().max()
    assert w._stable_hash_for_caching() != key


def test_without_a_compiler_pytorchs_kernel_runs(monkeypatch, tmp_path, request, caplog):
    """A C++ compiler that fails (here `false`) leaves the kernel unbuilt, says so in the log,
    and every kind runs PyTorch's kernels (few rows) and tiles (many): what a CPU without
    AVX-512 VNNI/VBMI runs, checked on every machine."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    kernels.forget_native_int4()
    request.addfinalizer(kernels.forget_native_int4)
    weights = _weights(100, 512)
    assert not kernels.native_int4_available() and "did not compile" in caplog.text
    assert sorted(weights) == ["int4", "q4_0", "q4_1", "q4_k", "q8_0"]
    for m in (1, 3, kernels.KERNEL_MAX_ROWS + 1):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        for kind, w in weights.items():
            assert w.scales.dtype == torch.bfloat16, kind  # PyTorch's form, packed without the kernel
            want = x @ w.dequantize().t()
            got = []
            assert _kernel_calls(lambda: got.append(torch.nn.functional.linear(x, w))) == 0
            # x rounded to bfloat16 by PyTorch's kernel: within 1% of the largest output
            assert (got[0] - want).abs().max() < 0.01 * want.abs().max(), (kind, m)
