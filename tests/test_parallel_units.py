"""Tensor-parallel modules and pipeline stage splitting, below the command line."""


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmsplit.models import LlamaConfig, Transformer
from llmsplit.parallel.pipeline import split_layers, stage_ids_of_rank

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, max_seq_len=32)


def _reference(x):
    m = Transformer(CFG)
    m.init_weights(0)
    loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}


def _tp_worker(rank, world, store_path, sp, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from llmsplit.parallel.tensor_parallel import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            m = Transformer(CFG)
        apply_tp(m, mesh, sp)
        m.to_empty(device="cpu")
        m.init_weights(0)
        x = torch.randint(0, 96, (3, 17), generator=torch.Generator().manual_seed(1))
        with loss_parallel():
            loss = F.cross_entropy(m(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten(), reduction="sum")
            loss.backward()
        ref_loss, ref_grads = _reference(x)
        diffs = {n: (p.grad.full_tensor() - ref_grads[n]).abs().max().item() for n, p in m.named_parameters()}
        shards = {n: tuple(p.to_local().shape) for n, p in m.named_parameters()}
        if rank == 0:
            out.put((loss.full_tensor().item(), ref_loss, diffs, shards))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
# tp 4 has more ranks than CFG's 2 kv heads: each kv head is replicated on 2 ranks.
@pytest.mark.parametrize("tp, sp", [(2, True), (4, False)])
def test_every_tensor_parallel_module_matches_the_unsharded_one(tmp_path, tp, sp):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_tp_worker, args=(tp, str(tmp_path / "store"), sp, out), nprocs=tp, start_method="spawn")
    loss, ref_loss, diffs, shards = out.get()
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss
    assert max(diffs.values()) < 1e-5, diffs  # the backward of every module's parameters
    assert shards["layers.0.attention.wq.weight"] == (64 // tp, 64)    # column parallel: output rows split
    assert shards["layers.0.attention.wo.weight"] == (64, 64 // tp)    # row parallel: input columns split
    assert shards["layers.0.feed_forward.w2.weight"] == (64, 128 // tp)
    # kv heads split while tp divides them, whole (replicated) on every rank beyond that
    assert shards["layers.0.attention.wk.weight"] == (32 // tp if tp <= 2 else 32, 64)
    assert shards["tok_embeddings.weight"] == (96 // tp, 64)           # vocabulary parallel
    assert shards["output.weight"] == (96 // tp, 64)
    assert shards["norm.weight"] == (64,)                              # norms stay whole


def test_stage_split_balances_cost_not_layer_count():
    big_head = LlamaConfig(dim=64, n_layers=8, n_heads=4, vocab_size=64 * 400, ffn_dim=128, max_seq_len=32)
    stages = split_layers(big_head, 2)
    assert [i for s in stages for i in s] == list(range(8))       # contiguous, every layer once
    assert len(stages[0]) > len(stages[1])                         # the head weighs on the last stage
    cheap_head = LlamaConfig(dim=64, n_layers=8, n_heads=4, vocab_size=8, ffn_dim=128, max_seq_len=32)
    assert [len(s) for s in split_layers(cheap_head, 4)] == [2, 2, 2, 2]
    assert all(len(s) >= 1 for s in split_layers(big_head, 8))


def test_stage_placement_per_schedule():
    assert stage_ids_of_rank("1f1b", 1, 4, 1) == [1]
    assert stage_ids_of_rank("interleaved_1f1b", 1, 4, 2) == [1, 5]
    assert stage_ids_of_rank("zbv", 0, 2, 1) == [0, 3]
    assert stage_ids_of_rank("dualpipev", 1, 2, 2) == [1, 2]
