import torch
import torch.nn.functional as F

from llmsplit.models import LlamaConfig, Transformer, preset_config
from llmsplit.models.rope import apply_rope, rope_tables

CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=96, max_seq_len=32)


def build(cfg=CFG, seed=0):
    m = Transformer(cfg)
    m.init_weights(seed)
    return m


def test_output_shape_and_param_count():
    m = build()
    assert m(torch.randint(0, 100, (3, 17))).shape == (3, 17, 100)
    assert sum(p.numel() for p in m.parameters()) == CFG.num_params()


def test_causal_later_tokens_never_change_earlier_logits():
    m = build()
    x = torch.randint(0, 100, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_gqa_with_all_kv_heads_equals_plain_multi_head_attention():
    cfg = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=50, ffn_dim=96, max_seq_len=16)
    m = build(cfg)
    attn = m.layers["0"].attention
    x = torch.randn(2, 10, 64)
    cos, sin = m.rope_cos[:10], m.rope_sin[:10]
    b, s = 2, 10
    q = apply_rope(attn.wq(x).view(b, s, 4, 16), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, s, 4, 16), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(b, s, 4, 16).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = attn.wo((F.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, s, 64))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin), ref, atol=1e-5, rtol=1e-5)


def test_gqa_equals_attention_with_repeated_kv_heads():
    m = build()  # 4 query heads share 2 kv heads
    wide_cfg = LlamaConfig(**{**CFG.to_dict(), "n_kv_heads": 4})
    wide = Transformer(wide_cfg)
    sd = m.state_dict()
    for i in range(2):
        for w in ("wk", "wv"):
            key = f"layers.{i}.attention.{w}.weight"
            sd[key] = sd[key].view(2, 16, 64).repeat_interleave(2, dim=0).reshape(64, 64)
    wide.load_state_dict(sd)
    x = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(m(x), wide(x), atol=1e-5, rtol=1e-5)


def test_init_is_independent_of_build_device_and_repeatable():
    a = build(seed=3)
    with torch.device("meta"):
        b = Transformer(CFG)
    b.to_empty(device="cpu")
    b.init_weights(3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = build(seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)


def test_a_tied_head_built_on_the_meta_device_stays_tied():
    """Module.to_empty gives each module a parameter of its own; tie_weights shares the head
    with the embedding again, as the plain model built on the CPU does."""
    tied = LlamaConfig(**{**CFG.__dict__, "tie_embeddings": True})
    a = build(tied, seed=3)
    with torch.device("meta"):
        b = Transformer(tied)
    b.to_empty(device="cpu")
    assert b.output.weight is not b.tok_embeddings.weight  # what torch does
    b.tie_weights()
    b.init_weights(3)
    assert b.output.weight is b.tok_embeddings.weight and len(list(b.parameters())) == len(list(a.parameters()))
    tokens = torch.randint(0, 100, (2, 8))
    assert torch.equal(a(tokens), b(tokens))


def test_init_under_a_sharded_layout_gives_the_same_weights(tmp_path):
    """A DTensor parameter sharded over a 1-rank mesh keeps exactly the full tensor's slice."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        mesh = init_device_mesh("cpu", (1,))
        m = build()
        sharded = Transformer(CFG)
        for name, p in list(sharded.named_parameters()):
            mod = sharded.get_submodule(name.rsplit(".", 1)[0])
            setattr(mod, name.rsplit(".", 1)[1], torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
        sharded.init_weights(0)
        for (n, p), (_, q) in zip(m.named_parameters(), sharded.named_parameters()):
            assert torch.equal(p, q.full_tensor()), n
    finally:
        dist.destroy_process_group()


def test_kv_cache_decoding_matches_full_forward():
    from llmsplit.infer.engine.block_manager import BlockPool
    from llmsplit.infer.runner.kv_cache import PagedKVCache

    m = build().eval()
    x = torch.randint(0, 100, (1, 14))
    pool = BlockPool(num_blocks=4, block_size=4)
    cache = PagedKVCache(4, 4, CFG.n_kv_heads, CFG.head_dim, {i: torch.device("cpu") for i in range(CFG.n_layers)},
                         torch.float32)

    def run(lo, hi):
        pool.append(0, hi - lo)
        step = pool.step([0], hi - lo)
        cache.set_step(step)
        return m(x[:, lo:hi], kv_cache=cache, start_pos=step.start)

    with torch.no_grad():
        full = m(x)
        pre = run(0, 8)
        chunk = run(8, 11)  # a multi-token chunk after the cache
        steps = [run(i, i + 1) for i in range(11, 14)]
    torch.testing.assert_close(pre, full[:, :8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunk, full[:, 8:11], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 11:], atol=1e-5, rtol=1e-5)


def test_rope_rotates_pairs_by_position():
    cos, sin = rope_tables(8, 4, 10000.0)
    x = torch.randn(1, 4, 1, 8)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is the identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # rotations keep the norm


def test_presets_have_the_published_sizes():
    assert abs(preset_config("llama-3-8b").num_params() / 1e9 - 8.03) < 0.01
    assert abs(preset_config("llama-2-7b").num_params() / 1e9 - 6.74) < 0.01
    assert abs(preset_config("llama-3-70b").num_params() / 1e9 - 70.55) < 0.01
    # tiny, by hand: a layer is wq 256·256 + wk, wv 2·256·128 + wo 256·256 + w1, w2, w3
    # 3·256·688 + 2 norms of 256 = 725,504; 4 of them, embedding and head 2·264·256, final norm 256.
    assert preset_config("tiny").num_params() == 4 * 725_504 + 2 * 264 * 256 + 256 == 3_037_440
    with torch.device("meta"):  # the big ones build on meta without memory
        m = Transformer(preset_config("llama-3-70b"))
    assert m.layers["0"].attention.wk.weight.shape == (1024, 8192)
