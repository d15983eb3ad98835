"""Hugging Face config.json ↔ LlamaConfig: one parser, the same refusals for plan, train and generate."""

import json

import pytest

from helpers import run_cli
from llmsplit.errors import ConfigError
from llmsplit.models.hf_config import UnsupportedHFConfig, config_from_hf, config_to_hf
from llmsplit.models.llama import LlamaConfig

# HuggingFaceTB/SmolLM2-135M's config.json as published (transformers 4.42).
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True,
    "vocab_size": 49152,
}
# meta-llama/Llama-3.1-8B's rope_scaling.
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_smollm2_config():
    cfg = config_from_hf(SMOLLM2_135M)
    assert cfg == LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536,
                              max_seq_len=8192, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
                              qkv_bias=False, rope_scaling=None)
    assert cfg.head_dim == 64
    assert cfg.num_params() == 134_515_008  # the model card's 135M, counted by transformers


def test_qwen2_has_qkv_bias_and_kv_heads_default_to_heads():
    raw = {**SMOLLM2_135M, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    del raw["num_key_value_heads"]
    cfg = config_from_hf(raw)
    assert cfg.qkv_bias and cfg.n_kv_heads == 9


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])  # transformers 4 / 5 spellings
def test_llama3_rope_scaling_accepted(key):
    rope = {**LLAMA31_ROPE, "rope_theta": 500000.0} if key == "rope_parameters" else LLAMA31_ROPE
    raw = {**SMOLLM2_135M, "rope_theta": 500000.0, "rope_scaling": None, key: rope}
    cfg = config_from_hf(raw)
    assert cfg.rope_theta == 500000.0
    assert json.loads(cfg.rope_scaling) == LLAMA31_ROPE


def test_dynamic_scales_from_max_position_embeddings():
    cfg = config_from_hf({**SMOLLM2_135M, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0,
                                                           "original_max_position_embeddings": 1024}})
    assert json.loads(cfg.rope_scaling) == {"rope_type": "dynamic", "factor": 2.0,
                                            "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("change,fragment", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling: rope scaling 'yarn' is not supported; llmsplit computes rope_type 'linear', 'dynamic', 'llama3'"),
    ({"rope_scaling": {"type": "longrope"}}, "rope scaling 'longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "llama3 rope scaling lacks low_freq_factor, high_freq_factor; add them"),
    ({"head_dim": 7}, "head_dim is 7 (hidden_size 576 / num_attention_heads 9 unless set); rotary embeddings"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True},
     "use_sliding_window true is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "'GemmaForCausalLM' (model_type 'gemma')"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias true is not supported for model_type 'llama'"),
    ({"num_hidden_layers": "30"}, "num_hidden_layers is '30'; it must be a positive int"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings is 1; it must be true or false"),
    ({"hidden_size": None, "vocab_size": None}, "lacks hidden_size, vocab_size; a Llama-family config.json names"),
])
def test_unrepresentable_configs_refused(change, fragment):
    with pytest.raises(UnsupportedHFConfig) as e:
        config_from_hf({**SMOLLM2_135M, **change}, "m/config.json")
    assert fragment in str(e.value) and str(e.value).startswith("m/config.json")


@pytest.mark.parametrize("cfg", [
    LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, ffn_dim=128, max_seq_len=512,
                rope_theta=5e5, norm_eps=1e-5, rope_scaling=json.dumps(LLAMA31_ROPE, sort_keys=True)),
    LlamaConfig(dim=64, n_layers=3, n_heads=8, vocab_size=300, ffn_dim=96, tie_embeddings=True, qkv_bias=True),
    LlamaConfig(dim=64, n_heads=4, head_dim=32, qk_norm=True),  # Qwen3
    LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, family="phi3"),
    LlamaConfig(dim=64, n_heads=4, n_experts=4, experts_per_token=2, family="mixtral"),
    LlamaConfig(dim=64, n_heads=4, head_dim=32, qk_norm=True, n_experts=4, moe_ffn_dim=48, router_renorm=False,
                family="qwen3_moe"),
    LlamaConfig(dim=64, n_heads=4, head_dim=32, family="gemma3_text", qk_norm=True, embed_scale=8.0,
                sandwich_norm=True, mlp_act="gelu_tanh", query_pre_attn_scalar=32.0, sliding_window=8,
                sliding_pattern=3, n_layers=6, rope_local_theta=10.0),
    LlamaConfig(max_seq_len=4096, rope_scaling=json.dumps({"rope_type": "dynamic", "factor": 2.0,
                                                          "original_max_position_embeddings": 4096}, sort_keys=True)),
])
def test_export_mapping_reads_back(cfg):
    raw = json.loads(json.dumps(config_to_hf(cfg, 0, 1, "float32")))
    assert config_from_hf(raw) == cfg


def test_what_a_family_cannot_express_is_refused_on_export():
    with pytest.raises(UnsupportedHFConfig, match="model.moe_ffn_dim = 48 has no config.json form for model_type "
                                                  "'mixtral' \\(it would load as 688\\)"):
        config_to_hf(LlamaConfig(n_experts=4, moe_ffn_dim=48), 0, 1, "float32")


def test_rope_freqs_have_no_config_json_form():
    cfg = LlamaConfig(dim=16, n_heads=2, rope_scaling=json.dumps({"rope_type": "factors", "factors": [1.0] * 4}))
    with pytest.raises(UnsupportedHFConfig, match="'factors'.*no config.json form"):
        config_to_hf(cfg, 0, 1, "float32")


def test_plan_train_and_generate_refuse_a_folder_alike(tmp_path):
    import llmsplit

    folder = tmp_path / "yarn"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**SMOLLM2_135M, "rope_scaling": {"rope_type": "yarn",
                                                                                     "factor": 4.0}}))
    want = f"llmsplit: error: {folder / 'config.json'}: rope_scaling: rope scaling 'yarn' is not supported"
    plan = run_cli("plan", "--model", str(folder), "--gpus", "1", "--gpu", "cpu", check=False)
    train = run_cli("train", "--run-dir", str(tmp_path / "run"), "--set", f"model.hf={folder}", check=False)
    assert (plan.returncode, train.returncode) == (2, 2)
    assert plan.stderr.strip().startswith(want), plan.stderr
    assert train.stderr.strip() == plan.stderr.strip()
    with pytest.raises(ConfigError) as e:
        llmsplit.load(folder)
    assert f"llmsplit: error: {e.value}" == plan.stderr.strip()


def test_plan_from_a_config_with_model_hf_uses_the_folders_sizes(tmp_path):
    from llmsplit.plan.api import resolve_model

    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\nhf = "{folder}"\n')
    cfg, _, source = resolve_model(toml)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (576, 30, 9, 3, 49152)
    assert source.model.dim == 576  # what the planner's runnable check and --emit-config see
