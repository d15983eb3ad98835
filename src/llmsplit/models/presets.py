"""Named model sizes. Configs only: the large ones are built for real only on real hardware."""

from __future__ import annotations

from .llama import LlamaConfig

PRESETS: dict[str, dict] = {
    # A few million parameters: trains visibly in minutes on two CPU cores. The byte
    # tokenizer uses 258 ids; 264 rounds the table up to a multiple of 8 for tensor parallel.
    "tiny": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=264, ffn_dim=688,
                 max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    # Mixture of experts for tests, Mixtral-shaped (exports as Mixtral): 4 experts of which each
    # token uses 2, in each of 2 layers.
    "tiny-moe": dict(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=264, ffn_dim=128, max_seq_len=256,
                     rope_theta=10000.0, norm_eps=1e-5, n_experts=4, experts_per_token=2),
    "llama-3.2-1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                         ffn_dim=8192, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5,
                         tie_embeddings=True),
    "llama-2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                       ffn_dim=11008, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    "llama-3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       ffn_dim=14336, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5),
    "llama-2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                        ffn_dim=13824, max_seq_len=4096, rope_theta=10000.0, norm_eps=1e-5),
    "llama-3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                        ffn_dim=28672, max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5),
    "llama-3.1-405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                           ffn_dim=53248, max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5),
    # Mixtures of experts (configs as their config.json gives them): 46.7 B / 12.9 B active, 30.5 B / 3.3 B.
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000, ffn_dim=14336,
                         max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5, n_experts=8, experts_per_token=2),
    "qwen3-30b-a3b": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, vocab_size=151936,
                          ffn_dim=6144, moe_ffn_dim=768, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                          qk_norm=True, n_experts=128, experts_per_token=8, router_renorm=True, tie_embeddings=False),
}


def preset_config(name: str, **overrides) -> LlamaConfig:
    if name not in PRESETS:
        raise KeyError(name)
    return LlamaConfig(**{**PRESETS[name], **overrides})
