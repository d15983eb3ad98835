"""Loaded layers run q/k/v and gate/up as one matmul each (`runner.fuse_projections`): the
same logits, one copy of the weights, the same parameter names."""

import copy

import torch

from llmsplit.infer.runner.runner import fuse_projections
from llmsplit.models.llama import LlamaConfig, Transformer

# Grouped kv heads and q/k/v biases (Qwen2), the two things the fused split must get right.
CFG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=96, max_seq_len=32,
                  qkv_bias=True)


def test_fused_layers_compute_the_same_from_one_copy_of_the_weights():
    model = Transformer(CFG).eval()
    model.init_weights(3)
    with torch.no_grad():
        for layer in model.layers.values():  # init_weights zeroes biases; make them count
            for m in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                m.bias.normal_()
    fused = copy.deepcopy(model)
    fuse_projections(fused.layers.values())
    tokens = torch.randint(0, CFG.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(fused(tokens), model(tokens), atol=1e-6, rtol=0)
    assert fused.state_dict().keys() == model.state_dict().keys()
    for name, t in model.state_dict().items():
        assert torch.equal(fused.state_dict()[name], t), name
    att, ff = fused.layers["1"].attention, fused.layers["1"].feed_forward
    qkv, bias = att.qkv[0], att.qkv[1]
    assert att.wv.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    assert att.wk.bias.untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()
    assert ff.w3.weight.untyped_storage().data_ptr() == ff.gate_up.untyped_storage().data_ptr()
    assert att.qkv[2:] == (CFG.n_heads, CFG.n_kv_heads)
