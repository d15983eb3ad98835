"""Paged KV cache: blocks come back, little is wasted, and sequences of different lengths
decoded together match the full forward."""

import random

import pytest
import torch

from llmsplit.infer.engine.block_manager import BlockPool, CacheFull
from llmsplit.infer.runner.kv_cache import PagedKVCache
from llmsplit.models.llama import LlamaConfig, Transformer

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=128, max_seq_len=64)


def test_blocks_are_returned_and_waste_is_small():
    rng = random.Random(0)
    pool = BlockPool(num_blocks=4000, block_size=16)
    lengths = {i: rng.randint(200, 1500) for i in range(40)}
    for i, n in lengths.items():
        pool.append(i, rng.randint(1, 100))  # a prompt, then token by token
        while pool.lengths[i] < n:
            pool.append(i, 1)
    allocated, used = pool.usage()
    assert used == sum(lengths.values())
    # Each sequence holds whole blocks of 16 and no more: at most 15 slots of waste each
    # (40 · 15 = 600 of the 36,530 tokens here, under 2%).
    assert allocated == sum(-(-n // 16) * 16 for n in lengths.values())
    assert (allocated - used) / allocated < 0.02, (allocated, used)
    for i in lengths:
        pool.free(i)
    assert pool.free_blocks == pool.num_blocks and pool.usage() == (0, 0)
    with pytest.raises(CacheFull):
        pool.append(99, 4000 * 16 + 1)


@pytest.mark.parametrize("kv_dtype,atol", [(None, 1e-5), ("int8", 3e-3), ("bfloat16", 3e-3)])
def test_sequences_of_different_lengths_decode_together(kv_dtype, atol):
    """Also with the int8 pool (a scale per token and head) and the bfloat16 one under float32
    compute: the full forward's logits to the rounding of the keys and values it reads back."""
    torch.manual_seed(0)
    model = Transformer(CFG).eval()
    model.init_weights(1)
    pool = BlockPool(num_blocks=16, block_size=4)
    cache = PagedKVCache(16, 4, CFG.n_kv_heads, CFG.head_dim, {0: torch.device("cpu"), 1: torch.device("cpu")},
                         torch.float32, kv_dtype)
    seqs = {i: torch.randint(0, 100, (12,)) for i in range(3)}
    with torch.no_grad():
        full = {i: model(t[None])[0] for i, t in seqs.items()}
        prompt = 3
        for i, t in seqs.items():  # prefill the first 3 tokens of each
            pool.append(i, prompt)
            cache.set_step(pool.step([i], prompt))
            model(t[None, :prompt], kv_cache=cache, start_pos=0)
        for pos in range(prompt, 5):  # then decode the three together; they share positions here
            ids = list(seqs)
            for i in ids:
                pool.append(i, 1)
            step = pool.step(ids, 1)
            cache.set_step(step)
            out = model(torch.stack([seqs[i][pos] for i in ids])[:, None], kv_cache=cache, start_pos=step.start)
            for row, i in enumerate(ids):
                torch.testing.assert_close(out[row, 0], full[i][pos], atol=atol, rtol=0)
        for i in (0, 2):  # push 0 and 2 ahead so that the lengths differ: the mask path
            for pos in range(5, 7 if i == 2 else 9):
                pool.append(i, 1)
                cache.set_step(pool.step([i], 1))
                model(seqs[i][None, pos:pos + 1], kv_cache=cache, start_pos=pos)
        ids = [0, 1, 2]
        for i in ids:
            pool.append(i, 1)
        step = pool.step(ids, 1)
        assert step.mask is not None and step.start.tolist() == [9, 5, 7]
        cache.set_step(step)
        out = model(torch.stack([seqs[i][p] for i, p in zip(ids, (9, 5, 7))])[:, None], kv_cache=cache,
                    start_pos=step.start)
    for row, (i, p) in enumerate(zip(ids, (9, 5, 7))):
        torch.testing.assert_close(out[row, 0], full[i][p], atol=atol, rtol=0)
    if kv_dtype == "int8":  # 16 int8 values and a float32 scale a (token, head) against 16 float32 values
        assert cache.nbytes() == 2 * CFG.n_layers * 16 * 4 * CFG.n_kv_heads * (CFG.head_dim + 4)
    if kv_dtype == "bfloat16":
        assert {p.dtype for p in cache.pools()} == {torch.bfloat16}
        assert cache.nbytes() == 2 * CFG.n_layers * 16 * 4 * CFG.n_kv_heads * CFG.head_dim * 2


def test_decodes_are_grouped_by_length_to_read_the_fewest_key_slots():
    pool = BlockPool(num_blocks=512, block_size=16)
    lengths = {1: 1000, 2: 990, 3: 20, 4: 10, 5: 1000}
    pool.lengths.update(lengths)  # all by_length reads
    # One part would read 5 x 1000 slots; two parts 3 x 1000 + 2 x 20 + one part's cost.
    assert pool.by_length([3, 1, 4, 2, 5]) == [[1, 5, 2], [3, 4]]
    assert pool.by_length([3, 4]) == [[3, 4]]  # 20 slots saved would not pay for a second part
    assert pool.by_length([2]) == [[2]]
    assert pool.by_length([]) == []
