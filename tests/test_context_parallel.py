"""Context parallel attention (ring and all-to-all) against single-process SDPA, on gloo."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from llmsplit.parallel.context_parallel import (context_attention, gather_sequence, shard_positions,
                                                shard_sequence, unshard_sequence)

BATCH, HEAD_DIM = 2, 16
# name: (q heads, kv heads, sequence, scale, packed documents)
CASES = {
    "causal": (4, 4, 32, None, False),
    "gqa": (4, 2, 64, None, False),      # alltoall at cp 4 must widen the 2 kv heads
    "scale": (4, 4, 32, 0.3, False),
    "documents": (4, 2, 64, 0.2, True),
}
MODES = ("ring", "alltoall")
WORLD = 4


def _doc_ids(seq: int) -> torch.Tensor:
    # Documents that start mid-chunk and cross shard boundaries, and one a token long.
    assert seq == 64
    starts = ([0, 5, 25, 26, 56], [0, 40, 43])
    first = torch.zeros(BATCH, seq, dtype=torch.long)
    for row, s in enumerate(starts):
        first[row, s] = 1
    return first.cumsum(1)


def _reference(q, k, v, dout, scale, docs):
    """Out and the q, k, v gradients of one process's SDPA over the whole sequence."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    mask = None
    if docs is not None:
        causal = torch.ones(docs.shape[1], docs.shape[1], dtype=torch.bool).tril()
        mask = ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, is_causal=mask is None, scale=scale)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def _run_case(case, mode, group):
    hq, hkv, seq, scale, packed = case
    g = torch.Generator().manual_seed(seq + hkv)
    q, dout = (torch.randn(BATCH, hq, seq, HEAD_DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(BATCH, hkv, seq, HEAD_DIM, generator=g) for _ in range(2))
    docs = _doc_ids(seq) if packed else None
    cp, rank = group.size(), group.rank()
    local = [shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, group, mode=mode, scale=scale,
                            doc_ids=None if docs is None else shard_sequence(docs, cp, rank, dim=1))
    out.backward(shard_sequence(dout, cp, rank, dim=2))
    got = [gather_sequence(t, group, dim=2) for t in (out.detach(), *(t.grad for t in local))]
    return got, _reference(q, k, v, dout, scale, docs)


def _worker(rank, world, store_path, result_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=dist.FileStore(store_path, world))
    # One launch for every degree: cp 4 over the world; cp 2 over {0, 2} and {1, 3}, whose
    # group ranks differ from the global ones; cp 1 alone (no message at all).
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(world)]
    groups = {4: dist.group.WORLD, 2: pairs[rank % 2], 1: singles[rank]}
    results = {(cp, mode, name): _run_case(case, mode, group)
               for cp, group in groups.items() for mode in MODES for name, case in CASES.items()}
    if rank == 0:
        torch.save(results, result_path)
    dist.destroy_process_group()
    os._exit(0)  # as in test_parallel_units: no gloo teardown racing the interpreter's exit


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cp")
    mp.start_processes(_worker, args=(WORLD, str(tmp / "store"), str(tmp / "results.pt")), nprocs=WORLD,
                       start_method="spawn")
    return torch.load(tmp / "results.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_context_attention_equals_one_process(distributed, cp, mode, name):
    got, want = distributed[(cp, mode, name)]
    # Values are of order 1 and entries near zero carry fp32 rounding of sums over up to 64
    # keys (about 1e-6 measured), hence an absolute 1e-5 beside the relative one.
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_and_unshard_round_trip(cp):
    x = torch.randn(2, 6 * cp, 4 * cp, 3)
    for dim in (1, 2):
        shards = [shard_sequence(x, cp, r, dim) for r in range(cp)]
        assert all(s.shape[dim] == x.shape[dim] // cp for s in shards)
        assert torch.equal(unshard_sequence(shards, dim), x)


def test_shards_hold_a_front_and_a_back_chunk_at_global_positions():
    assert shard_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert shard_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert torch.equal(shard_positions(16, 1, 0), torch.arange(16))
    for cp in (2, 4):
        positions = [shard_positions(64, cp, r) for r in range(cp)]
        assert torch.equal(unshard_sequence(positions, dim=0), torch.arange(64))
        # Causal work: a query at position p sees p + 1 keys; every rank gets the same total.
        assert len({int((p + 1).sum()) for p in positions}) == 1
