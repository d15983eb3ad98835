"""GGUF files written here with the gguf writer load with the source's logits (F32) or the
logits of the quantized-then-dequantized weights (Q8_0, Q4_0), and their tokenizer metadata
gives the tokenizer.json's tokens."""

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import MOE, hf_model, make_hf_folder, merge_peft_adapter  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.io.gguf import GGUFWeights, to_gguf_name  # noqa: E402
from llmsplit.io.hf import HFWeights  # noqa: E402
from llmsplit.models.llama import Transformer  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("gguf") / "llama", num_hidden_layers=2)


def permute_for_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (io/gguf.py's unpermute_from_gguf undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(folder, path, qtype, extra=lambda writer: None, arch="llama"):
    src = HFWeights(folder)
    cfg = src.config
    w = gguf.GGUFWriter(str(path), arch)
    extra(w)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    tj = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tj["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tj["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    expected = {}
    for name in src.names():
        t = src.read(name).float()
        if name.endswith("wq.weight") and arch == "llama":  # Qwen3's converter keeps the rows
            t = permute_for_gguf(t, cfg.n_heads)
        elif name.endswith("wk.weight") and arch == "llama":
            t = permute_for_gguf(t, cfg.n_kv_heads)
        arr = t.numpy()
        if t.dim() >= 2 and qtype != gguf.GGMLQuantizationType.F32:  # experts: 3-D, quantized by rows
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(to_gguf_name(name), q, raw_dtype=qtype)
            arr = gguf.quants.dequantize(q, qtype).reshape(arr.shape)
        else:
            w.add_tensor(to_gguf_name(name), np.ascontiguousarray(arr))
        expected[name] = torch.from_numpy(np.array(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def reference_logits(cfg, weights, ids):
    """Our model with the given weights, q/k permuted back by hand (not by the loader)."""
    from llmsplit.io.gguf import unpermute_from_gguf

    m = Transformer(cfg).eval()
    state = dict(weights)
    for name in state:
        if name.endswith("wq.weight"):
            state[name] = unpermute_from_gguf(state[name], cfg.n_heads)
        elif name.endswith("wk.weight"):
            state[name] = unpermute_from_gguf(state[name], cfg.n_kv_heads)
    m.load_state_dict(state, strict=False)
    with torch.no_grad():
        return m(ids)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_gguf_logits_match_the_source(folder, tmp_path, qtype):
    path = tmp_path / f"model.{qtype}.gguf"
    expected = write_gguf(folder, path, gguf.GGMLQuantizationType[qtype])
    m = llmsplit.load(path, quantize="none")  # widened: the packed path is tests/test_quant.py's
    ids = torch.randint(0, m.config.vocab_size, (2, 12))
    got = m.logits(ids)
    torch.testing.assert_close(got, reference_logits(m.config, expected, ids), atol=1e-4, rtol=0)
    with torch.no_grad():
        source = hf_model(folder)(ids).logits
    if qtype == "F32":
        torch.testing.assert_close(got, source, atol=1e-4, rtol=0)
    else:  # the quantization error, and no more than it
        err = (got - source).abs().max().item()
        assert 1e-6 < err < (0.05 if qtype == "Q8_0" else 0.5) * source.abs().max().item(), err


def test_gguf_rope_scaling_matches_transformers(tmp_path):
    """Llama 3.1 scaling as llama.cpp's converter stores it: a rope_freqs tensor of divisors."""
    import math

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 1e4}
    folder = make_hf_folder(tmp_path / "llama3", num_hidden_layers=2, rope_parameters=rope)

    def rope_freqs(w):  # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors, in short
        factors = []
        for freq in 1.0 / (1e4 ** (np.arange(0, 16, 2, dtype=np.float32) / 16)):
            wavelen = 2 * math.pi / freq
            if wavelen < 64 / 4.0:
                factors.append(1.0)
            elif wavelen > 64 / 1.0:
                factors.append(8.0)
            else:
                smooth = (64 / wavelen - 1.0) / (4.0 - 1.0)
                factors.append(1 / ((1 - smooth) / 8.0 + smooth))
        w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))

    write_gguf(folder, tmp_path / "m.gguf", gguf.GGMLQuantizationType.F32, rope_freqs)
    m = llmsplit.load(tmp_path / "m.gguf")
    assert json.loads(m.config.rope_scaling)["rope_type"] == "factors"
    ids = torch.randint(0, m.config.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), hf_model(folder)(ids).logits, atol=1e-4, rtol=0)


def test_gguf_tokenizer_matches_tokenizer_json(folder, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(folder, path, gguf.GGMLQuantizationType.F32)
    from llmsplit.io.tokenizer import HFTokenizer

    ours, ref = GGUFWeights(path).tokenizer, HFTokenizer(folder / "tokenizer.json")
    for text in ("The def statement defines a function.", "x = [1, 2, 3]\n\tpass  # done", "</s> naïve"):
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text.replace("</s>", "")
    assert ours.eos_id == 1


def test_unsupported_gguf_is_named(tmp_path, folder):
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'falcon' is not supported"):
        GGUFWeights(path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        GGUFWeights(tmp_path / "junk.gguf")


@pytest.mark.slow
def test_qlora_fine_tunes_on_top_of_a_gguf_file(folder, tmp_path):
    """model.gguf: a Q8_0 file is the base (its blocks dequantized as read, its tokenizer and
    sizes from its metadata), here under lora.base=nf4 on 2 workers with ZeRO-3. It logs the
    losses of one process on a Hugging Face folder holding the file's weights, and
    `llmsplit.load(RUN)` merges the adapters onto the file's weights (its PEFT export applied to
    them in transformers gives the same logits)."""
    from helpers import assert_close_losses, losses, train
    from safetensors.torch import save_file
    from test_qlora import QL, _dequantized_copy

    from llmsplit.io.gguf import unpermute_from_gguf
    from llmsplit.models.hf_names import to_hf_name

    path = tmp_path / "model.gguf"
    expected = write_gguf(folder, path, gguf.GGMLQuantizationType.Q8_0)  # q and k in GGUF's row order
    cfg = HFWeights(folder).config
    for name, heads in (("wq", cfg.n_heads), ("wk", cfg.n_kv_heads)):
        for i in range(cfg.n_layers):
            key = f"layers.{i}.attention.{name}.weight"
            expected[key] = unpermute_from_gguf(expected[key], heads)
    same = tmp_path / "same"
    same.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (same / f).write_bytes((folder / f).read_bytes())
    save_file({to_hf_name(k): v.contiguous() for k, v in expected.items()}, same / "model.safetensors",
              metadata={"format": "pt"})
    reference = _dequantized_copy(same, tmp_path / "nf4", "nf4")
    train(tmp_path / "ref", f"model.hf={reference}", *QL, nproc=1)
    train(tmp_path / "run", f"model.gguf={path}", "lora.base=nf4", "parallel.zero=3", *QL, nproc=2)
    assert_close_losses(losses(tmp_path / "run"), losses(tmp_path / "ref"))
    # The run's PEFT export applied to the file's weights (in `same`) the way PEFT merges it.
    from helpers import run_cli

    run_cli("export", "--checkpoint", str(tmp_path / "run"), "--to", "peft", str(tmp_path / "adapter"))
    model = merge_peft_adapter(hf_model(same), tmp_path / "adapter", scale=8 / 4)
    ids = torch.randint(0, 300, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(llmsplit.load(str(tmp_path / "run"), device_map="cpu").logits(ids),
                                   model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_gguf_matches_the_folder(tmp_path, arch):
    """llama.cpp's MoE tensors (ffn_gate_inp, ffn_{gate,up,down}_exps stacked 3-D) and metadata
    (expert_count, expert_used_count, expert_feed_forward_length, expert_weights_norm): the
    logits of the Hugging Face folder they were written from (Qwen3-MoE, F32), or of the
    dequantized weights (Mixtral, Q8_0: llama's permuted q/k rows)."""
    folder = make_hf_folder(tmp_path / arch, arch=arch, num_hidden_layers=2, **MOE[arch])
    cfg = HFWeights(folder).config

    def moe(w):
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        w.add_expert_weights_norm(cfg.router_renorm)
        if arch == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_ffn_dim)
            w.add_key_length(cfg.head_dim)
            w.add_value_length(cfg.head_dim)

    path = tmp_path / "moe.gguf"
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    if arch == "mixtral":  # Q8_0 experts (3-D, quantized by rows) and router: the dequantized weights' logits
        expected = write_gguf(folder, path, gguf.GGMLQuantizationType.Q8_0, moe)
        m = llmsplit.load(path, quantize="none")
        want = reference_logits(m.config, expected, ids)
        packed = llmsplit.load(path)  # the router kept packed, the experts widened
        torch.testing.assert_close(packed.logits(ids), want, atol=2e-2, rtol=0)
    else:  # F32: the folder's own logits
        write_gguf(folder, path, gguf.GGMLQuantizationType.F32, moe, arch="qwen3moe")
        m = llmsplit.load(path)
        with torch.no_grad():
            want = hf_model(folder)(ids).logits
    c = m.config
    assert (c.n_experts, c.experts_per_token, c.moe_ffn_dim, c.router_renorm, c.qk_norm, c.head_dim) == (
        cfg.n_experts, cfg.experts_per_token, cfg.moe_ffn_dim, cfg.router_renorm, cfg.qk_norm, cfg.head_dim)
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)
