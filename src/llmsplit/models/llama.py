"""A plain PyTorch Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, SmolLM).

What the families add to Llama are fields of the one `LlamaConfig` (q/k biases, a head size
of their own, q/k norms); how a family lays its tensors out in a file is the readers' business.

Nothing here knows about ranks, meshes or stages: parallelism is applied from outside
(`llmsplit.parallel`). Layers live in a `ModuleDict` keyed by their index so that a
pipeline stage can drop the layers it does not own and keep the original names, which
keeps checkpoints layout-independent. Rotary embeddings use the Hugging Face
"rotate half" layout so that Hugging Face weights load without permuting q/k.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope, dynamic_rope_limit, rope_for_heads, rope_tables


@dataclass
class LlamaConfig:
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    vocab_size: int = 264
    ffn_dim: int = 688
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v
    # Rotary scaling as JSON text (see `rope_params`), None for plain rotary embeddings. Text
    # rather than a dict so that it round-trips through a run's config.toml like every size.
    rope_scaling: str | None = None
    head_dim: int | None = None  # None: dim // n_heads; Qwen3 and Gemma choose their own
    qk_norm: bool = False  # Qwen3: an RMSNorm over each q and k head before the rotation
    # The Hugging Face model_type to write back on export where the maths alone does not say
    # (Phi-3 is Llama's maths with q/k/v and gate/up fused in its files); None: from the fields.
    family: str | None = None

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def kv_params(self) -> int:
        """Parameters of one layer's key and value projections (with their biases)."""
        return 2 * self.head_dim * self.n_kv_heads * (self.dim + (1 if self.qkv_bias else 0))

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down): its FLOPs per token / 2."""
        hd = self.head_dim
        return self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * self.dim * self.ffn_dim

    def layer_params(self) -> int:
        """Parameters of one decoder layer: the matmuls, the q/k/v biases and the norms."""
        bias = self.head_dim * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        return self.layer_matmul_params() + bias + qk_norm + 2 * self.dim

    def num_params(self) -> int:
        """Parameter count, computed from the sizes alone (no model is built)."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * self.layer_params() + embed + head + self.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the compute dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    # Set by `fuse_projections` for inference: [wq; wk; wv] as one weight (and bias), and the
    # head counts of q and k in it. None: three matmuls (training, offloaded layers).
    qkv: tuple | None = None

    def forward(self, x, cos, sin, kv_cache=None, layer_id: int = 0, start_pos: int = 0, mask=None):
        """`mask` (training on packed rows, no cache): [b, 1, s, s], True where a query may
        attend to a key (`document_mask`)."""
        b, s, _ = x.shape
        if self.qkv is not None:
            # One matmul and one rotary pass over the q and k heads together: at batch 1 the
            # per-op overhead is a large share of a decode step's time.
            weight, bias, nq, nk = self.qkv
            qkv = F.linear(x, weight, bias).view(b, s, -1, self.head_dim)
            qk = qkv[:, :, :nq + nk]
            if self.q_norm is not None:
                qk = torch.cat([self.q_norm(qk[:, :, :nq]), self.k_norm(qk[:, :, nq:])], dim=2)
            qk = apply_rope(qk, cos, sin)
            q, k, v = qk[:, :, :nq], qk[:, :, nq:], qkv[:, :, nq + nk:]
        else:
            # -1 heads: under tensor parallel each rank sees only its share of the heads.
            q = self.wq(x).view(b, s, -1, self.head_dim)
            k = self.wk(x).view(b, s, -1, self.head_dim)
            v = self.wv(x).view(b, s, -1, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, hd]
        if kv_cache is not None:
            k, v = kv_cache.update(layer_id, start_pos, k, v)
            # A cache holding sequences of different lengths supplies the mask that hides
            # each sequence's padding; it is the same for every layer of a step.
            mask = kv_cache.attn_mask(x.device)
        n_rep = q.shape[1] // k.shape[1]
        total = k.shape[2]
        if mask is not None:
            causal = False
        elif total == s:
            causal = True  # nothing cached before these tokens
        elif s == 1:
            causal = False  # one new token attends to everything cached
        else:
            # A chunk appended after cached tokens: position i sees cache + chunk[:i+1].
            mask = torch.ones(s, total, dtype=torch.bool, device=x.device).tril(total - s)
            causal = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             enable_gqa=n_rep > 1)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    gate_up: torch.Tensor | None = None  # set by `fuse_projections`: [w1; w3] as one weight

    def forward(self, x):
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, kv_cache=None, start_pos: int = 0, mask=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, kv_cache, self.layer_id, start_pos, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, scaling=cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, kv_cache=None, start_pos: int | torch.Tensor = 0,
                last_only: bool = False, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab]. With a `kv_cache`, `start_pos` is the
        position of tokens[:, 0] (an int, or a LongTensor [b] when the sequences of the batch
        are at different positions) and the cache is extended in place. `last_only` computes
        logits for the last position only (all that generation needs). `positions` [b, s]
        (training on packed rows): each token's position in its document, 0 where one starts;
        attention then stays within documents (`document_mask`)."""
        s = tokens.shape[1]
        mask = None
        if positions is not None:
            assert kv_cache is None, "packed rows are for training, not generation"
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            mask = document_mask(positions)
        elif isinstance(start_pos, torch.Tensor):
            pos = start_pos[:, None] + torch.arange(s, device=start_pos.device)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # the caller keeps pos inside the table
        else:
            if start_pos + s > self.rope_cos.shape[0]:
                self._extend_rope(start_pos + s)
            cos = self.rope_cos[start_pos:]
            sin = self.rope_sin[start_pos:]
        # Looked up only when scaled: the lookup is lru_cached, which torch.compile warns about.
        limit = dynamic_rope_limit(self.cfg.rope_scaling) if self.cfg.rope_scaling and positions is None else None
        if limit is not None:
            cos, sin = self._dynamic_rope(start_pos, s, limit, cos, sin)
        if kv_cache is not None:  # generation: shaped once for all layers (training shards the sequence)
            cos, sin = rope_for_heads(cos, sin, s)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, cos, sin, kv_cache, start_pos, mask=mask)
        if last_only and self.output is not None:
            h = h[:, -1:]
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def _extend_rope(self, length: int):
        cos, sin = rope_tables(self.cfg.head_dim, length, self.cfg.rope_theta, device=self.rope_cos.device,
                               scaling=self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin

    def _dynamic_rope(self, start_pos, s: int, limit: int, cos, sin):
        """Dynamic NTK scaling as transformers applies it: a call whose longest sequence ends
        past `limit` uses frequencies recomputed for that length (cached keys keep theirs)."""
        end = (int(start_pos.max()) if isinstance(start_pos, torch.Tensor) else start_pos) + s
        if end <= limit:
            return cos, sin
        cos_t, sin_t = rope_tables(self.cfg.head_dim, end, self.cfg.rope_theta, device=self.rope_cos.device,
                                   scaling=self.cfg.rope_scaling, seq_len=end)
        if isinstance(start_pos, torch.Tensor):
            pos = start_pos[:, None] + torch.arange(s, device=start_pos.device)
            return cos_t[pos], sin_t[pos]
        return cos_t[start_pos:], sin_t[start_pos:]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None):
        """Initialise every parameter from (seed, parameter name) alone.

        Each tensor is drawn whole on the CPU from its own generator, so the weights are
        the same whatever the world size or layout; a sharded (DTensor) parameter keeps
        only its own slice of the same full tensor.
        """
        device = buffer_device or next(iter(self.buffers())).device
        if device.type == "meta":
            device = torch.device("cpu")
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=device,
                               scaling=self.cfg.rope_scaling)
        self.rope_cos, self.rope_sin = cos, sin
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in _unique_named_parameters(self):
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape)
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
                g = torch.Generator().manual_seed(_name_seed(seed, name))
                full = torch.empty(p.shape).normal_(0.0, std, generator=g).clamp_(-3 * std, 3 * std)
            assign_full_tensor(p, full)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions within documents (0 starts one) -> [b, 1, s, s] boolean mask: causal,
    and never across a document boundary. A dense mask for SDPA rather than FlexAttention's
    BlockMask: FlexAttention has no backward on CPU in torch 2.13, so it cannot train there,
    and its eager forward was 4-12x slower than SDPA's (benchmarks/doc_attention.py); SDPA
    with a mask runs under every layout (TP, pipeline stages, checkpointing) as it is."""
    doc = (positions == 0).cumsum(1)
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def assign_full_tensor(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a full (unsharded) tensor into `p`, keeping only p's shard if p is a DTensor."""
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(local.to_local())
    else:
        p.copy_(full.to(device=p.device, dtype=p.dtype))


def _unique_named_parameters(model: nn.Module):
    # Tied weights appear once, under their first name (the embedding).
    return model.named_parameters(remove_duplicate=True)


def _name_seed(seed: int, name: str) -> int:
    # Strip wrapper prefixes so that wrapped and plain models draw the same numbers.
    clean = plain_name(name)
    digest = hashlib.sha256(f"{seed}:{clean}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def plain_name(name: str) -> str:
    """A parameter's name in the plain model: without the prefixes that wrappers add
    (activation checkpointing, compile, DDP)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "").replace("module.", "")
