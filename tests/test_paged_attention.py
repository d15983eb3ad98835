"""The paged decode kernel (infer/paged_attention.cpp, the operator llmsplit::paged_decode)
against the path it replaces: keys and values gathered out of the pool, then the model's own
attention (SDPA, or the explicit scores of a soft-capped model), for every pool dtype,
grouped-query heads, a sliding window and sequences of different lengths scattered over the pool."""

import pytest
import torch

from llmsplit.infer.runner import paged_attention
from llmsplit.infer.engine.block_manager import BlockPool
from llmsplit.infer.runner.kv_cache import PagedKVCache
from llmsplit.models.attention import Attention
from llmsplit.models.llama import LlamaConfig

pytestmark = pytest.mark.skipif(not paged_attention.available(), reason="no C++ compiler to build the kernel")


def _layer(window=None, softcap=None, heads=6, kv_heads=2, head_dim=16):
    cfg = LlamaConfig(vocab_size=32, dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                      ffn_dim=32, max_seq_len=256, sliding_window=window, attn_softcap=softcap)
    return Attention(cfg, sliding=window is not None)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0)])
@pytest.mark.parametrize("batch", [1, 7])  # 1: the work split by kv head; 7: by sequence
@pytest.mark.parametrize("dim", [16, 64, 128])  # 64 and 128: the AVX-512 rows (paged_decode.h), 16 the loops
def test_kernel_matches_gathered_attention(kv_dtype, window, softcap, batch, dim, monkeypatch):
    torch.manual_seed(0)
    attn = _layer(window, softcap, head_dim=dim)
    heads, kv_heads = 6, 2
    pool = BlockPool(num_blocks=64, block_size=4)
    cache = PagedKVCache(64, 4, kv_heads, dim, {0: torch.device("cpu")}, torch.float32, kv_dtype)
    lengths = [3 + 9 * i % 37 for i in range(batch)]
    for t in range(max(lengths)):  # a token at a time, so the sequences' blocks interleave in the pool
        for i, n in enumerate(lengths):
            if t < n:
                pool.append(i, 1)
    ids = list(range(batch))
    step = pool.step(ids, 1)
    cache.set_step(step)
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, 1, dim), torch.randn(batch, kv_heads, 1, dim)
    # Every slot random, then the step writes the newest keys.
    cache.k[0].copy_(torch.randn(cache.k[0].shape).to(cache.k[0].dtype) if kv_dtype != "int8" else
                     torch.randint(-127, 128, cache.k[0].shape, dtype=torch.int8))
    cache.v[0].copy_(torch.randn(cache.v[0].shape).to(cache.v[0].dtype) if kv_dtype != "int8" else
                     torch.randint(-127, 128, cache.v[0].shape, dtype=torch.int8))
    if kv_dtype == "int8":
        cache.k_scale[0].uniform_(0.005, 0.02)
        cache.v_scale[0].uniform_(0.005, 0.02)
    rule = (attn.head_dim ** -0.5, attn.softcap, attn.window)
    assert paged_attention.applies(q, cache.k[0])
    got = cache.attend(0, q, k, v, attn._attend, rule)
    # The same step on the gather path (the stored keys are rewritten alike).
    monkeypatch.setattr(paged_attention, "applies", lambda *a: False)
    cache.set_step(step)
    want = cache.attend(0, q, k, v, attn._attend, rule)
    assert got.shape == (batch, 1, heads * dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_packed_step_decodes_through_the_kernel_and_chunks_through_sdpa(monkeypatch):
    """A fused step (decodes of two sequences, a prefill chunk of a third): the one-token part
    goes to the kernel, the chunk to the model's attention, and the rows come back in order."""
    from llmsplit.infer.engine.step import PackedStep

    calls = []
    real = paged_attention.decode
    monkeypatch.setattr(paged_attention, "decode", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    torch.manual_seed(1)
    attn = _layer()
    pool = BlockPool(num_blocks=32, block_size=4)
    cache = PagedKVCache(32, 4, 2, 16, {0: torch.device("cpu")}, torch.float32)
    cache.k[0].normal_()
    cache.v[0].normal_()
    for i, n in ((0, 9), (1, 4)):
        pool.append(i, n)
    pool.append(2, 6)
    step = PackedStep.pack([pool.step([0, 1], 1), pool.chunk(2, 0, 6)])
    q, k, v = torch.randn(1, 6, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    cache.set_step(step)
    got = cache.attend(0, q, k, v, attn._attend, (0.25, None, None))
    assert calls == [(2, 6, 16)]
    monkeypatch.setattr(paged_attention, "applies", lambda *a: False)
    cache.set_step(step)
    torch.testing.assert_close(got, cache.attend(0, q, k, v, attn._attend, (0.25, None, None)), atol=2e-5, rtol=1e-4)


def test_without_a_compiler_decodes_gather_their_keys(monkeypatch, tmp_path, caplog, request):
    """A compiler that fails (here `false`) leaves the kernel unbuilt, says so once in the log,
    and the cache attends on the gather path with the same result."""
    torch.manual_seed(2)
    attn = _layer()
    pool = BlockPool(num_blocks=16, block_size=4)
    cache = PagedKVCache(16, 4, 2, 16, {0: torch.device("cpu")}, torch.float32)
    cache.k[0].normal_()
    cache.v[0].normal_()
    for i, n in enumerate((7, 3)):
        pool.append(i, n)
    step = pool.step([0, 1], 1)
    q, k, v = torch.randn(2, 6, 1, 16), torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
    cache.set_step(step)
    built = cache.attend(0, q, k, v, attn._attend, (0.25, None, None))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    paged_attention.forget()
    # Asked again (the library stays loaded) by whichever test uses it next.
    request.addfinalizer(paged_attention.forget)
    assert not paged_attention.available() and not cache.reads_in_place()
    assert "did not compile" in caplog.text
    cache.set_step(step)
    torch.testing.assert_close(cache.attend(0, q, k, v, attn._attend, (0.25, None, None)), built, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 4, 4)])
@pytest.mark.parametrize("start,n", [(0, 70), (37, 1 + 64 * 2), (130, 5)])
def test_prefill_kernel_matches_gathered_attention(kv_dtype, head_dim, heads, kv_heads, start, n, monkeypatch):
    """A chunk of one sequence after `start` cached tokens (blocks scattered over the pool), on
    the causal prefill kernel and on the gather + SDPA path: query rows that leave a partial
    row block, key counts off the 64-key blocks, both head sizes it has code for."""
    if not paged_attention.prefill_available():
        pytest.skip("the prefill kernel needs AVX-512")
    torch.manual_seed(start + n)
    attn = _layer(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    pool = BlockPool(num_blocks=96, block_size=4)
    cache = PagedKVCache(96, 4, kv_heads, head_dim, {0: torch.device("cpu")}, torch.float32, kv_dtype)
    for t in range(start):  # the cached tokens, interleaved with another sequence's
        pool.append(0, 1)
        pool.append(1, 1)
    pool.append(0, n)
    step = pool.chunk(0, start, n)
    for pools in (cache.k[0], cache.v[0]):
        pools.copy_(torch.randn(pools.shape).to(pools.dtype) if kv_dtype != "int8" else
                    torch.randint(-127, 128, pools.shape, dtype=torch.int8))
    if kv_dtype == "int8":
        cache.k_scale[0].uniform_(0.005, 0.02)
        cache.v_scale[0].uniform_(0.005, 0.02)
    q = torch.randn(1, n, heads, head_dim).transpose(1, 2)  # strided, as the model hands it over
    k, v = torch.randn(1, kv_heads, n, head_dim), torch.randn(1, kv_heads, n, head_dim)
    rule = (attn.head_dim ** -0.5, None, None)
    cache.set_step(step)
    with torch.no_grad():
        assert paged_attention.applies_prefill(q, cache.k[0], None)
        got = cache.attend(0, q, k, v, attn._attend, rule)
        monkeypatch.setattr(paged_attention, "applies_prefill", lambda *a: False)
        cache.set_step(step)
        want = cache.attend(0, q, k, v, attn._attend, rule)
    assert got.shape == (1, n, heads * head_dim)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_the_kernel_cache_key_holds_the_compilers_version(tmp_path, monkeypatch):
    """A compiler upgraded in place (same path) builds anew: its --version line is in the key."""
    from llmsplit import native

    fake = tmp_path / "c++"  # says its version; "builds" by writing an empty file where -o says
    fake.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "c++ (Fake) $FAKE_VERSION"; exit 0; fi\n'
                    'while [ "$1" != -o ]; do shift; done; : > "$2"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(native, "cache_dir", lambda: tmp_path / "cache")
    built = []
    for version in ("14.2.0", "15.1.0", "14.2.0"):
        monkeypatch.setenv("FAKE_VERSION", version)
        native._compiler_version.cache_clear()
        built.append(native._compile(paged_attention.SOURCE, "fallback").name)
    native._compiler_version.cache_clear()
    assert built[0] != built[1] and built[0] == built[2], built
