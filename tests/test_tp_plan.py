"""The one tensor-parallel plan (layout/tp_plan.py): inference's slices match the rules it
replaced, every weight of a layer has an entry, and int4's groups are checked by `layout.check`."""

import pytest
import torch

from llmsplit.errors import ConfigError
from llmsplit.layout import (BUFFERS, INFER_EXPERT_DIMS, INT4_GROUP, LAYER_PLAN, Layout, Workload, check, layer_plan,
                             rank_layer_shapes, tp_shard)
from llmsplit.models.llama import LlamaConfig, Transformer
from llmsplit.models.presets import preset_config

# infer/runner.py's rules before the table, copied as they were: substrings and suffixes.
_OLD_COLWISE = ("attention.wq.", "attention.wk.", "attention.wv.", "feed_forward.w1.", "feed_forward.w3.",
                "shared.w1.", "shared.w3.")
_OLD_ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight", "shared.w2.weight")
_OLD_EXPERTS = {"feed_forward.w1": 1, "feed_forward.w3": 1, "feed_forward.w2": 2}


def _old_tp_shard(name: str, rank: int, size: int):
    if size == 1:
        return None
    expert = next((dim for suffix, dim in _OLD_EXPERTS.items() if name.endswith(suffix)), None)
    if expert is not None:
        return (expert, rank, size)
    if any(p in name for p in _OLD_COLWISE):
        return (0, rank, size)
    if name.endswith(_OLD_ROWWISE):
        return (1, rank, size)
    return None


_CONFIGS = {
    "tiny": preset_config("tiny"),
    "tiny-moe": preset_config("tiny-moe"),
    "tiny-moe, shared experts, router bias": preset_config("tiny-moe", n_shared_experts=1, router_bias=True),
    "biases, q/k norms, sandwich norms": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96,
                                                     ffn_dim=160, qkv_bias=True, qk_norm=True, sandwich_norm=True),
}


def _model(cfg):
    with torch.device("meta"):
        return Transformer(cfg)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_tp_shard_slices_every_weight_as_the_old_rules_did(name):
    model = _model(_CONFIGS[name])
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    for size in (1, 2, 4):
        for rank in range(size):
            for n in names:
                assert tp_shard(n, rank, size) == _old_tp_shard(n, rank, size), (n, rank, size)
    # The names LoRA adapters are looked up by (the layer's name + ".weight") are parameter names too.
    assert tp_shard("layers.1.attention.wo.weight", 1, 2) == (1, 1, 2)
    assert tp_shard("layers.1.attention.wq.bias", 1, 2) == (0, 1, 2)


@pytest.mark.parametrize("name", list(_CONFIGS))
def test_every_tensor_of_a_layer_has_an_entry_and_the_shapes_are_the_models(name):
    cfg = _CONFIGS[name]
    block = _model(cfg).layers["0"]
    tensors = dict(block.named_parameters()) | dict(block.named_buffers())
    for n in tensors:
        assert n.rpartition(".")[0] in LAYER_PLAN or n in INFER_EXPERT_DIMS or n in BUFFERS, n
    assert set(layer_plan(cfg)) == {n.rpartition(".")[0] for n in tensors if n.rpartition(".")[0] in LAYER_PLAN}
    whole = rank_layer_shapes(cfg, 1, experts_over_tp=True)
    assert whole == {n: tuple(p.shape) for n, p in block.named_parameters()}
    # Training keeps routed experts whole on every tp rank (ep splits them); inference splits them.
    halves = rank_layer_shapes(cfg, 2, experts_over_tp=True)
    kept = rank_layer_shapes(cfg, 2, experts_over_tp=False)
    for n, dim in INFER_EXPERT_DIMS.items():
        if n in whole:
            assert halves[n][dim] * 2 == whole[n][dim] and kept[n] == whole[n]


def test_kv_projections_stay_whole_when_tp_exceeds_the_kv_heads():
    cfg = preset_config("tiny")  # 4 kv heads
    assert rank_layer_shapes(cfg, 8, False)["attention.wk.weight"] == (4 * cfg.head_dim, cfg.dim)
    assert rank_layer_shapes(cfg, 4, False)["attention.wk.weight"] == (cfg.head_dim, cfg.dim)


def test_the_int4_group_is_the_kernels():
    from llmsplit.quant.sizes import INT4_GROUP as kernel_group

    assert INT4_GROUP == kernel_group


_CUT = ("--quantize int4 under --tp 2 splits feed_forward.w2's 672 inputs into 336 per rank, not whole groups "
        "of 32; use --tp 1 or --quantize int8")


def test_check_refuses_an_int4_split_that_cuts_groups():
    cfg = preset_config("tiny", ffn_dim=672)  # 21 groups of 32: whole on one rank, 10.5 on each of two
    work = Workload(seq_len=64, global_batch=1, mode="infer", quantize="int4")
    check(cfg, Layout(), work)
    check(cfg, Layout(tp=2), Workload(seq_len=64, global_batch=1, mode="infer", quantize="int8"))
    with pytest.raises(ConfigError) as e:
        check(cfg, Layout(tp=2), work)
    assert str(e.value) == _CUT
    with pytest.raises(ConfigError, match="feed_forward.w2 has 688 inputs; use --quantize int8"):
        check(preset_config("tiny"), Layout(), work)


def test_the_planner_refuses_it_with_the_same_sentence():
    import llmsplit

    cfg = preset_config("tiny", ffn_dim=672)
    with pytest.raises(ConfigError) as e:
        llmsplit.plan(model=cfg, gpus=2, gpu="H100-80GB", mode="infer", quantize="int4", layout="tp=2")
    assert str(e.value) == _CUT
    report = llmsplit.plan(model=cfg, gpus=2, gpu="H100-80GB", mode="infer", quantize="int4")
    assert report["layouts"] and all(d["layout"]["tp"] == 1 for d in report["layouts"])
