"""Packed int8/int4 weights: GGUF blocks kept packed give the dequantized model's logits and
greedy tokens, float models quantized at load hold the bytes the formats say, and what
cannot be kept packed is widened or refused in one sentence."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.io.gguf import GGUFWeights  # noqa: E402
from llmsplit.quant import PackedWeight, from_gguf_blocks, held_bytes, kernels, pack_groups, quantize  # noqa: E402
from test_gguf import write_gguf  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("quant") / "llama", num_hidden_layers=2, tie=True)


def _packed_names(m):
    return {n for n, p in m.runner.model.named_parameters() if isinstance(p, PackedWeight)}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_packed_gguf_matches_dequantized(folder, tmp_path, qtype):
    path = tmp_path / f"m.{qtype}.gguf"
    write_gguf(folder, path, gguf.GGMLQuantizationType[qtype])
    ref, packed = llmsplit.load(path, quantize="none"), llmsplit.load(path)
    assert "layers.0.attention.wq.weight" in _packed_names(packed) and "tok_embeddings.weight" in _packed_names(packed)
    torch.manual_seed(0)
    for shape in ((1, 20), (2, 40)):  # 20 rows run the int4 kernel (bf16 inputs), 80 dequantize-then-matmul
        ids = torch.randint(0, ref.config.vocab_size, shape)
        want, got = ref.logits(ids), packed.logits(ids)
        torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
    prompt = [5, 9, 30, 7]
    assert packed.generate(prompt, max_new_tokens=12, ignore_eos=True) == \
        ref.generate(prompt, max_new_tokens=12, ignore_eos=True)
    # The whole model's bytes: packed weights 4 or 8 bits plus their group scales, against float32.
    assert held_bytes(packed.runner.model) < held_bytes(ref.runner.model) / (2.5 if qtype == "Q8_0" else 4)


def test_gguf_blocks_give_the_dequantized_weights():
    """Every packed GGUF type against the gguf package's own dequantization (Q4_K from random
    blocks: the package has no Q4_K quantizer), and the packed form (bf16 scales) to rounding."""
    rng = np.random.default_rng(0)
    for kind in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        qt = gguf.GGMLQuantizationType[kind]
        if kind == "Q4_K":
            raw = rng.integers(0, 256, (64, 144), dtype=np.uint8)
            d = rng.uniform(0.001, 0.01, 128).astype(np.float16)  # d and dmin of each super-block
            raw[:, :4] = np.frombuffer(d.tobytes(), np.uint8).reshape(64, 4)
        else:
            raw = gguf.quants.quantize(rng.standard_normal((64, 256)).astype(np.float32), qt)
        want = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(64, 256).astype(np.float32))
        g = from_gguf_blocks(kind, raw, 64, 256)
        torch.testing.assert_close(g.dequantize(), want, atol=1e-6, rtol=1e-6)
        p = pack_groups(g)
        torch.testing.assert_close(p.dequantize(), want, atol=0.01 * want.abs().max().item(), rtol=0)
        assert torch.equal(p.groups().q, g.q)  # the repacked nibbles come back unchanged
        rows = torch.tensor([63, 0, 33, 31, 32, 5, 5])  # both halves of a block, unsorted, repeated (a lookup)
        picked = p.groups(rows)
        assert torch.equal(picked.q, g.q[rows]) and torch.equal(picked.scale, p.groups().scale[rows])
        fused = torch.cat([p, p])  # whole blocks of 64 rows: the bytes just follow
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize()] * 2))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantize_at_load_holds_the_packed_bytes(folder, mode):
    ref, m = llmsplit.load(folder), llmsplit.load(folder, quantize=mode)
    cfg = m.config
    expected, weights = 0, {}
    for name, p in m.runner.model.named_parameters():  # the tied head is the embedding: counted once
        if isinstance(p, PackedWeight):  # the fused q/k/v and gate/up weights, once for their views
            weights[p.packed.data_ptr()] = p if p.base is None else p.base
        else:
            expected += p.numel() * 4
    for p in weights.values():
        n, k = p.shape
        rows = -(-n // kernels.ROW_ALIGN) * kernels.ROW_ALIGN
        expected += n * k + 2 * n if p.kind == "int8" else rows * k // 2 + rows * (k // 32) * 2 * 2
    got = held_bytes(m.runner.model) - m.runner.model.rope_cos.nbytes - m.runner.model.rope_sin.nbytes
    assert got == expected, (got, expected)
    assert got < held_bytes(ref.runner.model) / (3 if mode == "int8" else 5)
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    want, out = ref.logits(ids), m.logits(ids)
    assert (out - want).abs().max() < (0.05 if mode == "int8" else 0.3) * want.abs().max()
    # Round trip: the packed weight holds exactly the values quantizing the float weight gives.
    w = ref.runner.model.layers["0"].feed_forward.w2.weight
    torch.testing.assert_close(m.runner.model.layers["0"].feed_forward.w2.weight.dequantize(),
                               quantize(w, mode).dequantize(), atol=0, rtol=0)
    assert m.runner.model.tok_embeddings.weight.kind == "int8"  # int4 keeps the embedding/head at int8


def test_what_cannot_stay_packed(folder, tmp_path):
    odd = make_hf_folder(tmp_path / "odd", num_hidden_layers=1, hidden_size=80, intermediate_size=160)
    with pytest.raises(ConfigError, match="group size of 32 does not divide the 80 inputs.*use --quantize int8"):
        llmsplit.load(odd, quantize="int4")
    with pytest.raises(ConfigError, match="quantize 'int3' is not one of: int8, int4, none"):
        llmsplit.load(folder, quantize="int3")
    # Q5_0 does not fit 4 bits: widened to float32, as documented, and the model still loads.
    path = tmp_path / "q5.gguf"
    write_gguf(folder, path, gguf.GGMLQuantizationType.Q5_0)
    assert not _packed_names(llmsplit.load(path))
    # A row-parallel shard must hold whole groups of 32 inputs.
    q4 = tmp_path / "q4.gguf"
    write_gguf(folder, q4, gguf.GGMLQuantizationType.Q4_0)
    src = GGUFWeights(q4)
    assert src.read_packed("layers.0.feed_forward.w2.weight", (1, 1, 4)).shape == (64, 32)
    with pytest.raises(ConfigError, match="cannot be split 8 ways packed.*whole groups of 32"):
        src.read_packed("layers.0.feed_forward.w2.weight", (1, 0, 8))


def test_generate_quantize_flag(folder, capsys):
    from llmsplit.cli import main

    assert main(["generate", "--model", str(folder), "--quantize", "int8", "--max-new-tokens", "4", "hi"]) == 0
    assert capsys.readouterr().out.strip()


def test_placement_counts_the_packed_bytes(folder, tmp_path):
    """--max-memory budgets the packed bytes: a budget the float model overflows holds the
    packed one resident, and the weights placement counted are those the model holds."""
    path = tmp_path / "m.gguf"
    write_gguf(folder, path, gguf.GGMLQuantizationType.Q4_0)
    m = llmsplit.load(path, max_context=32)
    held = held_bytes(m.runner.model) - m.runner.model.rope_cos.nbytes - m.runner.model.rope_sin.nbytes
    counted = m.placement.usage["cpu"]["weights"]
    assert held <= counted <= 1.3 * held, (held, counted)  # fused q/k/v pad fewer rows than each alone
    budget = m.placement.usage["cpu"]["total"]
    with pytest.raises(ConfigError):
        llmsplit.load(path, quantize="none", max_context=32, max_memory={"cpu": budget})
    assert set(llmsplit.load(path, max_context=32, max_memory={"cpu": budget}).device_map.values()) == {"cpu"}


@pytest.mark.slow
def test_compiled_packed_decode(folder):
    """compile=True keeps the weights packed (int4 layers, the int8 embedding/head: both
    kernels in the graph): the two decode graphs compile at load, give eager packed's tokens
    one at a time and batched, and other batch sizes and positions compile nothing more."""
    from torch._dynamo.utils import counters

    from llmsplit.infer.engine import SamplingParams

    counters.clear()
    compiled = llmsplit.load(folder, compile=True, quantize="int4", max_context=96, max_batch=3)
    assert counters["stats"]["unique_graphs"] == 2
    eager = llmsplit.load(folder, quantize="int4", max_context=96, max_batch=3)
    assert _packed_names(compiled) == _packed_names(eager) and "tok_embeddings.weight" in _packed_names(compiled)
    for requests in ([([5, 9, 30], 24)], [([7] * 40, 9), ([8, 2], 30)], [([3, 4], 5), ([9] * 20, 12), ([11], 25)]):
        got, want = ([s.tokens for s in m.engine.generate([m.engine.new_sequence(p, SamplingParams(n, ignore_eos=True))
                                                          for p, n in requests])] for m in (compiled, eager))
        assert got == want
    assert counters["stats"]["unique_graphs"] == 2, "a request compiled a graph after load"


@pytest.mark.slow
def test_packed_under_tp_pp_and_disk_offload(folder, tmp_path):
    """--tp 2 --pp 2 shards the packed weights (row-parallel ones along whole groups), here with
    --kv-dtype int8 too, and disk offload widens what it writes: the whole packed model's tokens
    either way."""
    path = tmp_path / "m.gguf"
    write_gguf(folder, path, gguf.GGMLQuantizationType.Q4_0)
    whole = llmsplit.load(path)
    prompt = [5, 9, 30, 7, 11]
    want = whole.generate(prompt, max_new_tokens=8, ignore_eos=True)
    ids = torch.randint(0, whole.config.vocab_size, (1, 12))
    split = llmsplit.load(path, tp=2, pp=2, kv_dtype="int8")  # and the int8 KV pool on every worker
    try:
        assert isinstance(split.runner.runner.model.layers["0"].attention.wo.weight, PackedWeight)
        torch.testing.assert_close(split.logits(ids), whole.logits(ids), atol=0.02, rtol=0.02)
        assert split.generate(prompt, max_new_tokens=8, ignore_eos=True) == want
    finally:
        split.close()
    off = llmsplit.load(path, device_map={"": "cpu", "layers.1": "disk"}, offload_dir=tmp_path / "off")
    assert off.device_map["layers.1"] == "disk" and "layers.1.attention.wq.weight" not in _packed_names(off)
    assert off.generate(prompt, max_new_tokens=8, ignore_eos=True) == want
    off.close()


def test_many_rows_widen_tile_by_tile(monkeypatch):
    """Above KERNEL_MAX_ROWS the weight is widened to bf16 a tile of output rows at a time:
    the int4, Q8_0 (two nibbles) and int8 forms give the dequantized weight's product, also
    over several tiles and a last tile of padded rows (100 rows: blocks of 64)."""
    rng = np.random.default_rng(1)
    w = torch.randn(100, 128)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    packed = {"int4": quantize(w, "int4"), "int8": quantize(w, "int8"),
              "q8_0": pack_groups(from_gguf_blocks("Q8_0", raw, 100, 128))}
    x = torch.from_numpy(rng.standard_normal((40, 128)).astype(np.float32))
    for tile in (kernels.TILE_ELEMS, 64 * 128):  # one tile; two (the second padded)
        monkeypatch.setattr(kernels, "TILE_ELEMS", tile)
        for kind, p in packed.items():
            want = x @ p.dequantize().t()
            got = torch.nn.functional.linear(x, p)
            assert got.shape == want.shape and (got - want).abs().max() < 0.01 * want.abs().max(), kind


def test_packing_in_row_chunks_gives_the_whole_packing(monkeypatch):
    """GGUF weights are packed PACK_ROWS rows at a time (bounded transient memory): the same
    bytes and scales as packing the whole weight at once, padded last chunk included."""
    from llmsplit.quant import packed as packed_module

    g = from_gguf_blocks("Q8_0", gguf.quants.quantize(np.random.default_rng(2).standard_normal((200, 64))
                                                       .astype(np.float32), gguf.GGMLQuantizationType.Q8_0), 200, 64)
    whole = pack_groups(g)
    monkeypatch.setattr(packed_module, "PACK_ROWS", 64)
    chunked = PackedWeight.from_row_chunks(200, g.rows)
    assert torch.equal(chunked.packed, whole.packed) and torch.equal(chunked.scales, whole.scales)
    assert chunked.shape == whole.shape and chunked.doubled
