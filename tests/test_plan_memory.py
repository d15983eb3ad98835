"""Each memory term of the planner against what torch really allocates for our model
(parameters, optimizer state, saved activations, the loss, the KV cache) and against
cases worked by hand."""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmsplit.models.llama import LlamaConfig, Transformer, TransformerBlock
from llmsplit.models.rope import rope_tables
from llmsplit.models.presets import preset_config
from llmsplit.plan.hardware import get_device
from llmsplit.layout import Layout, Workload
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


def test_model_states_are_what_fused_adamw_allocates():
    """One real optimizer step (the fused AdamW the trainer uses): the bytes of the
    parameters, their gradients and the optimizer's moments as torch holds them."""
    model = Transformer(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128,
                                    max_seq_len=16))
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randint(0, 96, (2, 8))).float().logsumexp(-1).mean().backward()
    opt.step()
    params = list(model.parameters())
    measured = {"params": sum(p.numel() * p.element_size() for p in params),
                "grads": sum(p.grad.numel() * p.grad.element_size() for p in params),
                "optimizer": sum(t.numel() * t.element_size() for p in params
                                 for key, t in opt.state[p].items() if key != "step")}
    assert model_state_bytes(sum(p.numel() for p in params), 0, 1) == measured


def _block_params(cfg) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TransformerBlock(cfg, 0).parameters())


def test_layer_params_are_what_a_block_holds():
    for name in ("tiny", "llama-3-8b", "llama-3.2-1b", "llama-3-70b"):
        assert layer_params(preset_config(name)) == _block_params(preset_config(name)), name
    biased = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=160, qkv_bias=True)
    assert layer_params(biased) == _block_params(biased)
    # One tensor-parallel rank of Llama-3-70B (h 8192, 64 heads, 8 kv heads of 128, ffn 28672).
    # tp 8: wq + wo 2·8192·8192/8 = 16,777,216; wk + wv 2·1024·8192/8 = 2,097,152;
    # w1, w2, w3 3·8192·28672/8 = 88,080,384; both norms whole, 2·8192 = 16,384.
    assert layer_params(preset_config("llama-3-70b"), 8) == 16_777_216 + 2_097_152 + 88_080_384 + 16_384
    # tp 16 > 8 kv heads: wk and wv stay whole (2·1024·8192 = 16,777,216), the rest halves again.
    assert layer_params(preset_config("llama-3-70b"), 16) == 8_388_608 + 16_777_216 + 44_040_192 + 16_384


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
        if autocast:  # the bf16 weight copies the planner counts separately: every matrix, once
            with torch.device("meta"):
                matrices = [p for p in TransformerBlock(cfg, 0).parameters() if p.dim() == 2]
            assert weights == sum(2 * p.numel() for p in matrices)


class _Allocations(TorchDispatchMode):
    """Every storage an op creates (or views), held weakly: which are still alive later, and
    the peak of their sum after each op, leaving out the storages in `given`."""

    def __init__(self, given=()):
        super().__init__()
        self.made, self.peak, self.given = {}, 0, {t.untyped_storage().data_ptr() for t in given}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.made[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), tuple(t.shape))
        self.peak = max(self.peak, self.alive())
        return out

    def alive(self) -> int:
        return sum(n for ptr, (ref, n, _) in self.made.items() if not ref.expired() and ptr not in self.given)


def _tp_rank_block(cfg, tp):
    """Rank 0's block under tensor parallel without sequence parallel: its share of the
    heads and of the ffn (the attention views its heads as -1, as under DTensor); the
    all-reduces after wo and w2 save nothing for backward."""
    blk = TransformerBlock(cfg, 0)
    attn, ffn = blk.attention, blk.feed_forward
    with torch.no_grad():
        for lin in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w3):  # column parallel: output rows
            lin.weight = torch.nn.Parameter(lin.weight[: lin.out_features // tp].clone())
        for lin in (attn.wo, ffn.w2):  # row parallel: input columns
            lin.weight = torch.nn.Parameter(lin.weight[:, : lin.in_features // tp].clone())
    return blk


def _alive_after_forward(cfg, b, s, checkpoint, pattern, tp=1):
    """Bytes a block's forward leaves alive for its backward (autograd's saved tensors or
    what checkpointing keeps), apart from weights, their autocast copies, the rope tables
    and the block output, which is the next block's input."""
    from llmsplit.parallel.memory import apply_activation_checkpointing

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.layers = torch.nn.ModuleDict({"0": _tp_rank_block(cfg, tp)})
    if pattern == "mixed_params":  # FSDP2's MixedPrecisionPolicy: bf16 weights and inputs
        holder.bfloat16()
    apply_activation_checkpointing(holder, checkpoint)
    cos, sin = rope_tables(cfg.head_dim, s, 1e4)
    leaf = torch.randn(b, s, cfg.dim, requires_grad=True,
                       dtype=torch.bfloat16 if pattern == "mixed_params" else torch.float32)
    mode = _Allocations()
    with mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=pattern == "autocast"):
        x = leaf * 1.0  # the block input as an op output: alive later only if something keeps it
        y = holder.layers["0"](x, cos, sin)
    del x
    gc.collect()
    params = list(holder.parameters())
    skip = {t.untyped_storage().data_ptr() for t in (*params, cos, sin, y)}
    # Autocast's bf16 weight copies (a separate term of the planner) have a weight's shape or
    # its transpose; no activation here does.
    weight_shapes = {tuple(p.shape) for p in params} | {tuple(p.shape)[::-1] for p in params}
    return sum(n for ptr, (ref, n, shape) in mode.made.items()
               if not ref.expired() and ptr not in skip and shape not in weight_shapes)


@pytest.mark.parametrize("checkpoint", ["none", "selective", "full"])
@pytest.mark.parametrize("pattern", ["fp32", "autocast", "mixed_params"])
def test_activations_are_the_bytes_a_forward_leaves_alive(checkpoint, pattern):
    cfg = LlamaConfig(n_layers=1, vocab_size=64, max_seq_len=40, dim=128, n_heads=8, n_kv_heads=2, ffn_dim=352)
    got = layer_activation_bytes(cfg, 2, 40, Layout(), pattern, checkpoint)
    assert got == _alive_after_forward(cfg, 2, 40, checkpoint, pattern)
    # Tensor parallel without sequence parallel: rank 0's share, measured the same way.
    tp = Layout(tp=2, sequence_parallel=False)
    assert layer_activation_bytes(cfg, 2, 40, tp, pattern, checkpoint) == \
        _alive_after_forward(cfg, 2, 40, checkpoint, pattern, tp=2)


def test_sequence_parallel_shrinks_the_norm_region():
    # Not measurable in one process (the norms run on a sequence shard between collectives):
    # with sequence parallel, the norms' saved tensors and the block input divide by tp.
    cfg = preset_config("llama-3-8b")
    tp = layer_activation_bytes(cfg, 1, 4096, Layout(tp=4, sequence_parallel=False), "autocast")
    tp_sp = layer_activation_bytes(cfg, 1, 4096, Layout(tp=4), "autocast")
    # Per token, without sp, the norm region is 2·8h (x and x·rsqrt in fp32, both norms) + 8
    # (two fp32 rsqrt) = 65,544 bytes at h 4096; sp keeps a quarter of it: 3/4 saved.
    assert tp - tp_sp == 4096 * 65_544 * 3 // 4


def test_pipeline_in_flight_microbatches():
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 0, 8) == 4
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 3, 8) == 1
    assert in_flight(Layout(pp=4, pp_schedule="gpipe"), 0, 8) == 8
    # Interleaved, v = 2: (p-1)·2 + (v-1)·p + 1 = 11 chunk-micro-batches of half the layers.
    assert in_flight(Layout(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), 0, 8) == 5.5
    assert in_flight(Layout(pp=4, pp_schedule="1f1b"), 0, 2) == 2  # never more than exist


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_loss_peak_is_what_the_trainers_loss_allocates(precision):
    """The trainer's own loss, forward and backward, on logits of one micro-batch: the
    highest sum of live tensors it creates, plus the logits it is given."""
    from llmsplit.train.objectives import token_loss

    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=1000, ffn_dim=128, max_seq_len=64)
    b, s = 2, 64
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    logits = torch.randn(b, s, cfg.vocab_size, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (b, s))
    mode = _Allocations(given=[logits])  # in fp32 the loss views the logits themselves
    with mode:
        token_loss(logits, targets, b * s).backward()
    measured = mode.peak + logits.numel() * logits.element_size()
    bd = training_memory(cfg, Layout(micro_batch=b), Workload(seq_len=s, global_batch=b, precision=precision),
                         get_device("H100-80GB"))
    # The loss's scalars and index tensors (about 1 KiB) are not counted.
    assert bd.detail["loss_peak"] == pytest.approx(measured, abs=2048)


@pytest.mark.parametrize("tp", [1, 8])
def test_inference_kv_cache_and_weights_are_what_the_engine_allocates(tp):
    """The paged KV cache the engine builds for 2 sequences of 8192 tokens on every layer of
    Llama-3-70B, and its bf16 weights, both built on the meta device (no memory)."""
    from llmsplit.infer.runner.kv_cache import PagedKVCache

    cfg = preset_config("llama-3-70b")
    bd = inference_memory(cfg, Layout(tp=tp), Workload(seq_len=8192, global_batch=2, mode="infer"),
                          get_device("H200-141GB"))
    block = 16
    cache = PagedKVCache(2 * 8192 // block, block, cfg.n_kv_heads // tp, cfg.head_dim,
                         {i: torch.device("meta") for i in range(cfg.n_layers)}, torch.bfloat16)
    assert bd.detail["kv_cache"] == cache.nbytes()
    if tp == 1:
        with torch.device("meta"):
            model = Transformer(cfg).to(torch.bfloat16)
        assert bd.params == sum(p.numel() * p.element_size() for p in model.parameters())


def test_uneven_pipeline_split_is_the_one_training_uses():
    """pp not dividing the layers: the planner counts the layers each rank holds under the
    cost-balanced split training and inference use, and the fullest rank decides the memory.

    Worked by hand for Llama-3-8B (32 layers): a layer's matmuls are 4096·128·(32 + 16) +
    32·128·4096 + 3·4096·14336 = 218,103,808 weights, the head's 128256·4096 = 2.41 layers,
    the embedding 5% of that, 0.12. The most expensive stage must cost at least the mean
    and a middle stage costs a whole number of layers:
    - 4 stages: mean 8.63, so 9: first ≤ 8 (8 + 0.12), middles 9, last ≤ 6 (6 + 2.41);
      8 + 9 + 9 + 6 = 32 uses every layer, the only split that does.
    - 6 stages: mean 5.76, so 6: [5, 6, 6, 6, 6, 3], again the only one (5 + 24 + 3 = 32).
    Per rank: zbv's V gives rank r stages r and 5 − r: 5 + 3, 6 + 6, 6 + 6; interleaved
    (v = 2) gives r and r + 3: 5 + 6, 6 + 6, 6 + 3.
    """
    from llmsplit.plan.memory import stage_params

    cfg = preset_config("llama-3-8b")
    with torch.device("meta"):
        per_layer = sum(p.numel() for p in TransformerBlock(cfg, 0).parameters())
    for layout, expected in ((Layout(pp=4), [8, 9, 9, 6]),
                             (Layout(pp=6), [5, 6, 6, 6, 6, 3]),
                             (Layout(pp=3, pp_schedule="zbv"), [8, 12, 12]),
                             (Layout(pp=3, pp_schedule="interleaved_1f1b", pp_virtual_stages=2), [11, 12, 9])):
        held = [stage_params(cfg, layout, r) for r in range(layout.pp)]
        assert [h["n_layers"] for h in held] == expected, layout
        assert [h["layers"] for h in held] == [n * per_layer for n in expected]
    from llmsplit.plan.memory import _training_stage

    work, device = Workload(seq_len=1024, global_batch=12), get_device("H100-80GB")
    per_rank = [_training_stage(cfg, Layout(pp=6), work, device, r) for r in range(6)]
    bd = training_memory(cfg, Layout(pp=6), work, device)
    assert bd.total == max(r.total for r in per_rank) and len({r.total for r in per_rank}) > 2
