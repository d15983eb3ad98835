"""Each memory term of the planner against hand-computed numbers and against what
autograd really saves for our decoder layer."""

import pytest
import torch

from llmsplit.models.llama import LlamaConfig, TransformerBlock, rope_tables
from llmsplit.models.presets import preset_config
from llmsplit.plan.hardware import get_device
from llmsplit.plan.layout import Layout, Workload
from llmsplit.plan.memory import (in_flight, inference_memory, layer_activation_bytes, layer_params,
                                  model_state_bytes, training_memory, zero_paper_bytes)


def test_zero_paper_check():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N = 64.
    psi, n = 7.5e9, 64
    got = [zero_paper_bytes(psi, z, n) / 1e9 for z in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)


def test_llmsplit_model_states_are_16_bytes_replicated_and_16_over_n_sharded():
    psi, n = 1_000_000, 8
    assert sum(model_state_bytes(psi, 0, n).values()) == 16 * psi
    assert sum(model_state_bytes(psi, 3, n).values()) == 16 * psi // n
    # zero 1 shards only the two fp32 moments; zero 2 shards all three (FSDP2).
    assert model_state_bytes(psi, 1, n) == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi // n}
    assert sum(model_state_bytes(psi, 2, n).values()) == 16 * psi // n


def test_layer_params_add_up_to_the_model():
    for name in ("tiny", "llama-3-8b", "llama-3.2-1b"):
        cfg = preset_config(name)
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
        assert cfg.n_layers * layer_params(cfg) + cfg.vocab_size * cfg.dim + head + cfg.dim == cfg.num_params()
    cfg = preset_config("llama-3-70b")
    assert layer_params(cfg, 8) == (layer_params(cfg) - 2 * cfg.dim) // 8 + 2 * cfg.dim


def _saved_bytes(cfg, b, s, autocast):
    """Bytes of distinct storages one block saves for backward, without weights and rope tables."""
    torch.manual_seed(0)
    blk = TransformerBlock(cfg, 0)
    cos, sin = rope_tables(cfg.head_dim, s, 1e4)
    x = torch.randn(b, s, cfg.dim, requires_grad=True)
    # Autocast's weight copies are saved as the weight or its transpose (mm's mat2).
    weight_shapes = {tuple(p.shape) for p in blk.parameters()} | {tuple(p.shape)[::-1] for p in blk.parameters()}
    skip = {t.untyped_storage().data_ptr() for t in (*blk.parameters(), cos, sin)}
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            blk(x, cos, sin)
    acts = sum(n for ptr, (n, shape) in seen.items() if ptr not in skip and shape not in weight_shapes)
    weights = sum(n for ptr, (n, shape) in seen.items() if ptr not in skip and shape in weight_shapes)
    return acts, weights


@pytest.mark.parametrize("sizes", [dict(dim=128, n_heads=8, n_kv_heads=2, ffn_dim=352),
                                   dict(dim=96, n_heads=4, n_kv_heads=4, ffn_dim=256)])
@pytest.mark.parametrize("b,s", [(1, 48), (2, 40)])
def test_layer_activations_match_autograd(sizes, b, s):
    cfg = LlamaConfig(n_layers=1, vocab_size=64, max_seq_len=s, **sizes)
    for autocast, pattern in ((False, "fp32"), (True, "autocast")):
        acts, weights = _saved_bytes(cfg, b, s, autocast)
        assert layer_activation_bytes(cfg, b, s, Layout(), pattern) == acts
        if autocast:  # the bf16 weight copies the planner counts separately
            assert weights == 2 * (layer_params(cfg) - 2 * cfg.dim)


def test_checkpointing_and_tensor_parallel_shrink_activations():
    cfg = preset_config("llama-3-8b")
    none = layer_activation_bytes(cfg, 1, 4096, Layout(), "autocast")
    sel = layer_activation_bytes(cfg, 1, 4096, Layout(), "autocast", "selective")
    full = layer_activation_bytes(cfg, 1, 4096, Layout(), "autocast", "full")
    assert full == 4096 * cfg.dim * 4  # only the fp32 block input
    assert full < sel < none
    tp = layer_activation_bytes(cfg, 1, 4096, Layout(tp=4, dp=1, sequence_parallel=False), "autocast")
    tp_sp = layer_activation_bytes(cfg, 1, 4096, Layout(tp=4, dp=1), "autocast")
    assert tp_sp < tp < none


def test_pipeline_in_flight_microbatches():
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 0, 8) == 4
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 3, 8) == 1
    assert in_flight(Layout(pp=4, pp_schedule="gpipe"), 0, 8) == 8
    # Interleaved, v = 2: (p-1)·2 + (v-1)·p + 1 = 11 chunk-micro-batches of half the layers.
    assert in_flight(Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 0, 8) == 5.5
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 0, 2) == 2  # never more than exist


def test_loss_upcast_over_the_vocabulary_is_counted():
    cfg = preset_config("llama-3.2-1b")
    dev = get_device("H100-80GB")
    work = Workload(seq_len=2048, global_batch=8, precision="bf16")
    bd = training_memory(cfg, Layout(dp=8, zero=3, micro_batch=1, activation_checkpoint="full"), work, dev)
    # bf16 logits + fp32 log-probs, their gradient and log_softmax's backward result.
    assert bd.detail["loss_peak"] == 2048 * cfg.vocab_size * (2 + 12)


def test_inference_kv_cache():
    cfg = preset_config("llama-3-70b")
    bd = inference_memory(cfg, Layout(), Workload(seq_len=8192, global_batch=1, mode="infer"),
                          get_device("H200-141GB"))
    assert bd.detail["kv_cache"] == 2 * 80 * 8 * 128 * 2 * 8192  # 2.68 GB
    assert bd.params == 2 * cfg.num_params()


def test_uneven_pipeline_split_is_the_one_training_uses():
    """pp not dividing the layers: the planner counts the layers parallel/pipeline.py gives
    each rank (balanced by cost), and the fullest rank decides the memory."""
    from llmsplit.config import stage_ids_of_rank
    from llmsplit.models.stages import split_layers
    from llmsplit.plan.layout import rank_layers
    from llmsplit.plan.memory import stage_params

    cfg = preset_config("llama-3-8b")  # 32 layers
    for layout in (Layout(pp=6), Layout(pp=3, pp_schedule="zbv"), Layout(pp=5, pp_schedule="interleaved_1f1b",
                                                                            pp_virtual_stages=2)):
        per_stage = split_layers(cfg, layout.pp * layout.chunks)
        expected = [sum(len(per_stage[s]) for s in stage_ids_of_rank(layout.pp_schedule, r, layout.pp, layout.chunks))
                    for r in range(layout.pp)]
        assert list(rank_layers(cfg, layout)) == expected and sum(expected) == 32
        assert len(set(expected)) > 1  # really uneven
        held = [stage_params(cfg, layout, r)["layers"] for r in range(layout.pp)]
        assert held == [n * layer_params(cfg) for n in expected]
    from llmsplit.plan.memory import _training_stage

    work, device = Workload(seq_len=1024, global_batch=12), get_device("H100-80GB")
    per_rank = [_training_stage(cfg, Layout(pp=6), work, device, r) for r in range(6)]
    bd = training_memory(cfg, Layout(pp=6), work, device)
    assert bd.total == max(r.total for r in per_rank) and len({r.total for r in per_rank}) > 2
