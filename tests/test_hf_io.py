"""Hugging Face folders in: same logits and greedy tokens as transformers, every family."""

import json

import pytest
import torch

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import hf_model, make_hf_folder  # noqa: E402
from llmsplit.errors import ConfigError  # noqa: E402
from llmsplit.infer.engine import SamplingParams  # noqa: E402
from llmsplit.io.hf import HFWeights, from_hf_name, to_hf_name  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("hf") / "llama")


def greedy_tokens(m, ids, n):
    seq = m.engine.new_sequence(ids, SamplingParams(n, ignore_eos=True))
    m.engine.generate([seq])
    return seq.tokens


def test_llama_folder_matches_transformers(llama):
    ref = hf_model(llama)
    m = llmsplit.load(llama)
    assert m.config.n_kv_heads == 2 and m.config.n_heads == 4  # grouped-query attention
    ids = torch.tensor([m.tokenizer.encode("The def statement defines a function object")[:10],
                        m.tokenizer.encode("Assignment statements are used to (re)bind names")[:10]])
    with torch.no_grad():
        want = ref(ids).logits
    torch.testing.assert_close(m.logits(ids), want, atol=1e-4, rtol=0)
    prompt = ids[0].tolist()
    hf_out = ref.generate(ids[:1], max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(prompt):]
    assert greedy_tokens(m, prompt, 16) == hf_out.tolist()
    assert m.generate("The def statement", max_new_tokens=5) == m.tokenizer.decode(
        greedy_tokens(m, m.tokenizer.encode("The def statement"), 5))


@pytest.mark.parametrize("arch,extra", [("qwen2", {}), ("mistral", {"sliding_window": 5}),
                                         ("llama", {"tie_word_embeddings": True})])
def test_other_families_match_transformers(tmp_path, arch, extra):
    tie = extra.pop("tie_word_embeddings", False)
    folder = make_hf_folder(tmp_path / arch, arch=arch, tie=tie, num_hidden_layers=2, **extra)
    ref = hf_model(folder)
    m = llmsplit.load(folder)
    assert m.config.qkv_bias == (arch == "qwen2") and m.config.tie_embeddings == tie
    ids = torch.randint(0, m.config.vocab_size, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), ref(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},  # head_dim 16: long, blended and kept wavelengths
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 8.0}])  # max_position_embeddings 8 < 11 tokens: rescaled
def test_rope_scaling_matches_transformers(tmp_path, rope):
    short = rope["rope_type"] == "dynamic"
    folder = make_hf_folder(tmp_path / "rope", num_hidden_layers=2, rope_parameters={**rope, "rope_theta": 1e4},
                            **({"max_position_embeddings": 8} if short else {}))
    ref = hf_model(folder)
    m = llmsplit.load(folder, max_context=64)
    assert json.loads(m.config.rope_scaling)["rope_type"] == rope["rope_type"]
    ids = torch.randint(2, m.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    plain = tmp_path / "plain"  # the same weights without the scaling
    plain.mkdir()
    for f in ("model.safetensors", "tokenizer.json"):
        (plain / f).symlink_to(folder / f)
    raw = json.loads((folder / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**raw, "rope_parameters": {"rope_type": "default",
                                                                              "rope_theta": 1e4}}))
    with torch.no_grad():
        want = ref(ids).logits
    got = m.logits(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (got - llmsplit.load(plain).logits(ids)).abs().max() > 1e-3  # the scaling changed the maths
    # Through the KV cache, one token at a time (dynamic rescales at every step past 8).
    hf_out = ref.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 11:]
    assert greedy_tokens(m, ids[0].tolist(), 8) == hf_out.tolist()


def test_sharded_folder_and_slices(tmp_path):
    folder = make_hf_folder(tmp_path / "sharded", num_hidden_layers=2)
    model = hf_model(folder)
    model.save_pretrained(tmp_path / "s2", max_shard_size="40KB")
    (tmp_path / "s2" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    assert (tmp_path / "s2" / "model.safetensors.index.json").is_file()
    whole, sharded = HFWeights(folder), HFWeights(tmp_path / "s2")
    for name in whole.names():
        assert torch.equal(whole.read(name), sharded.read(name)), name
    w = whole.read("layers.1.attention.wk.weight")
    assert torch.equal(sharded.read("layers.1.attention.wk.weight", shard=(0, 1, 2)), w.chunk(2, 0)[1])
    assert torch.equal(sharded.read("layers.0.feed_forward.w2.weight", shard=(1, 0, 2)),
                       whole.read("layers.0.feed_forward.w2.weight").chunk(2, 1)[0])


def test_names_round_trip():
    for ours in ("tok_embeddings.weight", "layers.3.attention.wq.bias", "layers.12.feed_forward.w2.weight",
                 "layers.0.ffn_norm.weight", "output.weight", "norm.weight"):
        assert from_hf_name(to_hf_name(ours)) == ours
    assert to_hf_name("layers.2.feed_forward.w1.weight") == "model.layers.2.mlp.gate_proj.weight"
    assert from_hf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None


def test_bad_folders_are_named(tmp_path, llama):
    raw = json.loads((llama / "config.json").read_text())
    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="'GPT2LMHeadModel'.*not supported"):
        HFWeights(bad)  # every other refusal of config.json: tests/test_hf_config.py
    (bad / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json' is not a readable JSON config"):
        HFWeights(bad)
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        HFWeights(empty)
