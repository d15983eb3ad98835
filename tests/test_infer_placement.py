"""Placement as a pure function, on fake budgets of several GPUs."""

from dataclasses import replace

import pytest

from llmsplit.errors import ConfigError
from llmsplit.plan.placement import (PlacementError, Sizes, kv_bytes_per_layer, parse_max_memory, parse_size,
                                      place, units)
from llmsplit.models.llama import LlamaConfig

GiB = 1 << 30
CFG = LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                  max_seq_len=8192)  # Llama-3-8B
BF16 = Sizes(batch=4, context=4096, dtype_bytes=2, kv_dtype_bytes=2, reserve={"cuda": GiB, "cpu": 0})


def test_every_budget_is_respected_and_units_stay_in_order():
    budgets = {"cuda:0": 6 * GiB, "cuda:1": 5 * GiB, "cpu": 4 * GiB, "disk": None}
    p = place(CFG, budgets, "auto", BF16)
    for dev, u in p.usage.items():
        assert budgets[dev] is None or u["total"] <= budgets[dev], (dev, u)
    order = ["cuda:0", "cuda:1", "cpu", "disk"]
    ranks = [order.index(d) for u, d in p.device_map.items() if u not in ("norm", "output")]
    assert ranks == sorted(ranks) and set(p.device_map.values()) == set(order)
    assert list(p.device_map) == [u for u, _ in units(CFG, 2)]
    # The 1 GiB head stays on a GPU while middle layers stream: fewer bytes copied per token.
    assert p.device_map["output"] in ("cuda:0", "cuda:1") and p.device_map["layers.31"] == "disk"


def test_units_weigh_what_the_modules_hold():
    import torch

    from llmsplit.models.llama import Transformer

    with torch.device("meta"):
        model = Transformer(CFG).to(torch.bfloat16)
    for unit, size in units(CFG, 2):
        assert size == sum(p.numel() * p.element_size() for p in model.get_submodule(unit).parameters()), unit


def test_the_kv_cache_is_counted():
    import torch

    from llmsplit.infer.runner.kv_cache import PagedKVCache

    kv = kv_bytes_per_layer(CFG, BF16)
    # The engine's paged cache for one layer, 4 sequences of 4096 tokens in blocks of 16 (meta: no memory).
    one_layer = PagedKVCache(4 * 4096 // 16, 16, CFG.n_kv_heads, CFG.head_dim, {0: torch.device("meta")},
                             torch.bfloat16)
    assert kv == one_layer.nbytes()
    p = place(CFG, {"cuda:0": 80 * GiB}, "auto", BF16)
    assert p.usage["cuda:0"]["kv_cache"] == 32 * kv
    weights = p.usage["cuda:0"]["weights"]
    # A budget that holds the weights but not the weights + KV cache is refused.
    with pytest.raises(PlacementError, match=r"needs \d+ bytes"):
        place(CFG, {"cuda:0": weights + GiB + 16 * kv}, "auto", BF16)
    # More context means fewer layers on the GPU.
    long = Sizes(batch=16, context=8192, dtype_bytes=2, kv_dtype_bytes=2)
    short_map = place(CFG, {"cuda:0": 20 * GiB, "cpu": 64 * GiB}, "auto", BF16).device_map
    long_map = place(CFG, {"cuda:0": 20 * GiB, "cpu": 64 * GiB}, "auto", long).device_map
    assert list(long_map.values()).count("cuda:0") < list(short_map.values()).count("cuda:0")


def test_offloaded_layers_charge_the_execution_device():
    p = place(CFG, {"cuda:0": 8 * GiB, "cpu": 100 * GiB}, "auto", BF16)
    gpu = p.usage["cuda:0"]
    assert "cpu" in p.device_map.values() and p.exec_device == "cuda:0"
    sizes = dict(units(CFG, 2))
    offloaded = [u for u, d in p.device_map.items() if d == "cpu"]
    assert gpu["staging"] == 2 * max(sizes[u] for u in offloaded)  # the largest offloaded unit, twice
    assert gpu["kv_cache"] == 32 * kv_bytes_per_layer(CFG, BF16)  # every layer's cache lives where it runs
    assert p.usage["cpu"]["kv_cache"] == 0


def test_a_large_tied_head_stays_resident_while_middle_layers_stream():
    # SmolLM2-135M: a 113 MB tied head next to 14 MB layers. Streaming the head would cost
    # two head-sized staging buffers and a second copy of the embedding, so the budget that
    # holds half of the layers with the head resident holds just one layer with it streamed.
    smol = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536,
                       max_seq_len=2048, tie_embeddings=True)
    fp32 = Sizes(batch=4, context=128)
    half = {f"layers.{i}": "disk" for i in range(15, 30)}
    budget = place(smol, {"cpu": None, "disk": None}, {**half, "": "cpu"}, fp32).usage["cpu"]["total"]
    p = place(smol, {"cpu": budget, "disk": None}, "auto", fp32)
    assert p.device_map == {u: half.get(u, "cpu") for u, _ in units(smol, 4)}
    assert p.usage["cpu"]["total"] <= budget and p.usage["cpu"]["staging"] == 2 * dict(units(smol, 4))["layers.0"]


def test_balanced_spreads_evenly():
    budgets = {f"cuda:{i}": 24 * GiB for i in range(4)}
    p = place(CFG, budgets, "balanced", BF16)
    loads = [p.usage[d]["weights"] + p.usage[d]["kv_cache"] for d in budgets]
    layer = dict(units(CFG, 2))["layers.0"] + kv_bytes_per_layer(CFG, BF16)
    assert max(loads) - min(loads) <= 2 * layer, loads
    seq = place(CFG, budgets, "sequential", BF16)
    assert "cuda:3" not in seq.device_map.values()  # filling in order leaves the last GPU empty


def test_explicit_maps_are_honoured():
    explicit = {"": "cuda:1", "layers.0": "cuda:0", "tok_embeddings": "cuda:0", "output": "cpu"}
    p = place(CFG, {"cuda:0": 80 * GiB, "cuda:1": 80 * GiB, "cpu": 80 * GiB}, explicit, BF16)
    assert p.device_map["layers.0"] == "cuda:0" and p.device_map["layers.1"] == "cuda:1"
    assert p.device_map["output"] == "cpu" and p.device_map["norm"] == "cuda:1"
    assert place(CFG, {"cuda:0": 80 * GiB, "cuda:1": 80 * GiB}, "cuda:1", BF16).device_map["layers.5"] == "cuda:1"
    with pytest.raises(PlacementError, match="cuda:0 by"):
        place(CFG, {"cuda:0": 4 * GiB, "cpu": 80 * GiB}, {"": "cuda:0"}, BF16)


def test_impossible_budgets_give_the_shortfall_in_bytes():
    with pytest.raises(PlacementError) as e:
        place(CFG, {"cuda:0": 2 * GiB, "cpu": 2 * GiB}, "auto", BF16)
    short = int(str(e.value).split("needs ")[1].split(" bytes")[0])
    # In llmsplit.load's terms (the command line explains the failure with its flags).
    assert short > 10 * GiB and str(e.value).endswith("raise max_memory, or lower max_batch or max_context, or pass "
                                                      "offload_dir (a folder for what fits in no budget)")
    # With disk but an execution device too small for even one layer's staging: still refused,
    # and the offload folder, given already, is not asked for.
    with pytest.raises(PlacementError) as e:
        place(CFG, {"cpu": 100 << 20, "disk": None}, "auto", BF16)
    assert str(e.value).endswith("raise max_memory, or lower max_batch or max_context") and "--" not in str(e.value)


def test_sizes_and_budgets_parse():
    assert parse_size("20GiB", "x") == 20 * GiB and parse_size("1.5GB", "x") == 1_500_000_000
    assert parse_max_memory("cuda:0=20GiB, cpu=64GiB") == {"cuda:0": 20 * GiB, "cpu": 64 * GiB}
    assert parse_max_memory({"cuda": "1GiB"}) == {"cuda:0": GiB}
    for bad in ("cuda:0:20GiB", "cuda:0=lots", "gpu0=1GiB"):
        with pytest.raises(ConfigError):
            parse_max_memory(bad)


def test_experts_kept_on_the_cpu_leave_attention_on_the_accelerator():
    """--n-cpu-moe: Qwen3-30B-A3B in bf16 (61 GB) and a 24 GiB GPU. Without it 31 of 48 layers
    stream from the CPU; with the experts of all 48 layers in CPU memory every layer is resident
    on the GPU, and the CPU is charged exactly the experts' bytes."""
    from llmsplit.models.presets import preset_config

    cfg = preset_config("qwen3-30b-a3b")
    budgets = {"cuda:0": 24 * GiB, "cpu": 128 * GiB}
    sizes = Sizes(dtype_bytes=2, kv_dtype_bytes=2, context=4096)
    plain = place(cfg, budgets, "auto", sizes)
    assert list(plain.device_map.values()).count("cpu") > 20 and plain.cpu_experts == []
    weights = dict(units(cfg, 2))
    for n in (4, 48):
        p = place(cfg, budgets, "auto", replace(sizes, cpu_moe_layers=n))
        assert p.cpu_experts == list(range(n))
        streamed = sum(weights[u] for u, d in p.device_map.items() if d == "cpu")  # whole layers offloaded
        assert p.usage["cpu"]["weights"] == n * cfg.routed_expert_params() * 2 + streamed
    assert set(p.device_map.values()) == {"cuda:0"} and "experts of layers.0 .. layers.47: cpu" in p.describe()
    assert p.usage["cuda:0"]["weights"] == sum(weights.values()) - 48 * cfg.routed_expert_params() * 2
