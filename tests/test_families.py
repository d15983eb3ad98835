"""The dense families beyond Llama: Qwen3 (q/k norms, a head size of its own), Phi-3 (q/k/v and
gate/up fused in its files), Gemma 2 (norms of 1 + w before and after attention and MLP, scaled
embeddings, GeGLU, a query scale, capped attention scores and logits, sliding-window layers) and
Gemma 3 (Gemma 2 without the caps, with q/k norms and a rotary base of its own on sliding layers). Each loads from a folder transformers wrote with its logits, greedy
tokens the same whole and split over worker processes, fine-tunes from transformers' loss, and
exports back to a folder transformers loads with the same logits."""

import json

import pytest
import torch

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from helpers import assert_close_losses, losses, run_cli, train  # noqa: E402
from hf_models import greedy_tokens, hf_model, make_hf_folder, transformers_loss  # noqa: E402
from llmsplit.io.hf import HFWeights  # noqa: E402

# Qwen3's head_dim (24) is not hidden / heads (16), as in the real ones (1024 / 16 heads of 128).
# Gemma 2's window (5) is shorter than the prompts plus their continuations; its caps and query
# scale are small enough to change these random weights' logits (test_gemma_features_change_the_logits).
FAMILIES = {"qwen3": {"head_dim": 24}, "phi3": {"pad_token_id": None},
            "gemma2": {"head_dim": 24, "sliding_window": 5, "query_pre_attn_scalar": 1, "attn_logit_softcapping": 0.5,
                       "final_logit_softcapping": 0.5, "pad_token_id": None},
            # Global layers 2 and 5 of 6 with linear rope scaling, sliding ones with a base of 10.
            "gemma3_text": {"head_dim": 24, "sliding_window": 5, "query_pre_attn_scalar": 1, "pad_token_id": None,
                            "num_hidden_layers": 6, "layer_types": (["sliding_attention"] * 2 + ["full_attention"]) * 2,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                                "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                   "rope_theta": 1e4}}}}
EXPECT = {"qwen3": {"qk_norm": True, "family": None, "head_dim": 24}, "phi3": {"family": "phi3", "head_dim": 16},
          "gemma2": {"family": "gemma2", "sandwich_norm": True, "embed_scale": 8.0, "sliding_window": 5,
                     "sliding_pattern": 2, "attn_softcap": 0.5, "logit_softcap": 0.5, "query_pre_attn_scalar": 1.0,
                     "mlp_act": "gelu_tanh"},
          "gemma3_text": {"family": "gemma3_text", "qk_norm": True, "sandwich_norm": True, "sliding_pattern": 3,
                          "rope_local_theta": 10.0, "attn_softcap": None, "rope_scaling": '{"factor": 4.0, '
                          '"rope_type": "linear"}'}}
# The slow checks run where a family's risks are: Gemma 3 (local rope tables in pipeline stages,
# q/k norm gradients over tp ranks, 1 + w written back) and Phi-3 (fused reads and writes).
SPLIT, TRAIN = ("gemma3_text",), ("gemma3_text", "phi3")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    arch = request.param
    return arch, make_hf_folder(tmp_path_factory.mktemp(arch) / arch, arch=arch, vocab_size=321,
                                **FAMILIES[arch])


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(2, vocab, (2, 13), generator=torch.Generator().manual_seed(0))


def test_logits_and_tokens_match_transformers(family):
    arch, folder = family
    ref, m = hf_model(folder), llmsplit.load(folder)
    assert {k: getattr(m.config, k) for k in EXPECT[arch]} == EXPECT[arch]
    ids = _ids(m.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(m.logits(ids), ref(ids).logits, atol=1e-4, rtol=0)
        want = ref.generate(ids[:1], max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 13:]
    assert greedy_tokens(m, ids[0].tolist()) == want.tolist()  # through the fused decode path and the KV cache


def test_gemma_features_change_the_logits(family, tmp_path):
    arch, folder = family
    if arch == "gemma2":
        changes = ({"layer_types": ["full_attention"] * 4}, {"attn_logit_softcapping": None},
                   {"final_logit_softcapping": None}, {"query_pre_attn_scalar": 24})
    elif arch == "gemma3_text":  # the sliding layers' own rotary base
        local = {"rope_type": "default", "rope_theta": 1e4}
        changes = ({"rope_parameters": {**FAMILIES[arch]["rope_parameters"], "sliding_attention": local}},)
    else:
        changes = None
    if changes is None:
        pytest.skip("Gemma only")
    plain = tmp_path / "plain"  # the same weights, every layer global and nothing capped
    plain.mkdir()
    for f in ("model.safetensors", "tokenizer.json"):
        (plain / f).symlink_to(folder / f)
    raw = json.loads((folder / "config.json").read_text())
    ids = _ids(raw["vocab_size"])
    got = llmsplit.load(folder).logits(ids)
    for change in changes:
        (plain / "config.json").write_text(json.dumps({**raw, **change}))
        with torch.no_grad():
            want = hf_model(plain)(ids).logits
        other = llmsplit.load(plain).logits(ids)
        torch.testing.assert_close(other, want, atol=1e-4, rtol=0)
        assert (other - got).abs().max() > 1e-3, change


def test_fused_tensors_read_as_parts(tmp_path):
    folder = make_hf_folder(tmp_path / "phi3", arch="phi3", num_hidden_layers=1, pad_token_id=None)
    w = HFWeights(folder)
    from safetensors.torch import load_file

    qkv = load_file(folder / "model.safetensors")["model.layers.0.self_attn.qkv_proj.weight"]
    wk = w.read("layers.0.attention.wk.weight")
    assert w.shape("layers.0.attention.wk.weight") == (32, 64) and torch.equal(wk, qkv[64:96])
    assert torch.equal(w.read("layers.0.attention.wk.weight", shard=(0, 1, 2)), qkv[80:96])
    assert torch.equal(w.read_region("layers.0.attention.wv.weight", (8, 4), (4, 8)), qkv[104:108, 4:12])
    raw = json.loads((folder / "config.json").read_text())  # a fused tensor whose rows do not add up
    (folder / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 4}))
    with pytest.raises(llmsplit.config.ConfigError, match="qkv_proj.weight is \\[128, 64\\] in the file"):
        HFWeights(folder)


@pytest.mark.slow
def test_split_over_workers_fine_tuned_and_exported(family, tmp_path):
    arch, folder = family
    if arch not in SPLIT + TRAIN:
        pytest.skip("covered by the families that share its features")
    whole = llmsplit.load(folder, device_map="cpu")
    ids = _ids(whole.config.vocab_size)
    want = whole.logits(ids), [greedy_tokens(whole, p) for p in ([5, 17, 42, 99], [12, 8, 300])]
    if arch in SPLIT:
        split = llmsplit.load(folder, tp=2, pp=2)  # tensor and pipeline workers at once
        try:
            torch.testing.assert_close(split.logits(ids), want[0], atol=1e-5, rtol=0)
            assert [greedy_tokens(split, p) for p in ([5, 17, 42, 99], [12, 8, 300])] == want[1]
        finally:
            split.close()
    # Fine-tuning with tensor-parallel loads (rows of q/k/v and gate/up, columns of o and down).
    run = tmp_path / "run"
    sets = ["data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=2", "train.warmup_steps=1",
            "train.lr=3e-3"]
    train(run, f"model.hf={folder}", *sets, "parallel.tp=2", nproc=2)
    got = losses(run)
    assert abs(got[0] - transformers_loss(folder)) <= 1e-5 * got[0] and got[1] < got[0]
    if whole.config.qk_norm:  # the q/k norms' gradients summed over the tp ranks' heads: step 2 as one process
        train(tmp_path / "one", f"model.hf={folder}", *sets)
        one = losses(tmp_path / "one")
        # Losses to 1e-5 and step 1's gradient norm; step 2's norm is 1.8e-3 off for gemma3_text under
        # tp=2 (10.667 vs 10.686). Measured 2026-12-06 over 3 steps: at lr 3e-3 the norms part 3e-6, 2e-5,
        # 2e-3; at lr 3e-5 3e-6, 2e-7, 2e-6: rounding that AdamW's near-sign first updates amplify with
        # the lr (a gradient off by a factor would not shrink with it), so step 1 is the gradient check.
        assert_close_losses(list(got), list(one))
        assert_close_losses(got[:1], one[:1])
    out = tmp_path / "hf"
    run_cli("export", "--checkpoint", str(run), "--to", "hf", str(out))
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == arch and raw["head_dim"] == whole.config.head_dim
    tuned = llmsplit.load(run)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(out)(ids).logits, tuned.logits(ids), atol=1e-5, rtol=0)
    assert (tuned.logits(ids) - want[0]).abs().max() > 1e-3  # the export holds the fine-tuned weights
