"""A plain PyTorch Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, SmolLM).

What the families add to Llama are fields of the one `LlamaConfig` (q/k biases, a head size
of their own, q/k norms, Gemma 2/3's scalings, caps, sliding windows and local rotary base); how a family lays its
tensors out in a file is the readers' business.

Nothing here knows about ranks, meshes or stages: parallelism is applied from outside
(`llmsplit.parallel`). Layers live in a `ModuleDict` keyed by their index so that a
pipeline stage can drop the layers it does not own and keep the original names, which
keeps checkpoints layout-independent. Rotary embeddings use the Hugging Face
"rotate half" layout so that Hugging Face weights load without permuting q/k.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention, RMSNorm
from .moe import MoE
from .rope import dynamic_rope_limit, model_rope_tables, rope_for_heads, rope_table_placeholders, rope_tables


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
    # Gemma 2: embeddings times sqrt(dim), norms after attention and MLP as well as before
    # ("sandwich"), GeGLU, a query scale of its own, and tanh caps on attention scores and logits.
    embed_scale: float = 1.0
    sandwich_norm: bool = False
    mlp_act: str = "silu"  # | "gelu_tanh"
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar ** -0.5
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # Keys within sliding_window positions only, on every layer (sliding_pattern 0, Mistral) or
    # on all but every sliding_pattern-th layer (Gemma 2: 2, layers 1, 3, ... attend globally).
    sliding_window: int | None = None
    sliding_pattern: int = 0
    rope_local_theta: float | None = None  # Gemma 3: the rotary base of the sliding layers
    # Mixture of experts (models/moe.py) in every layer's MLP when n_experts > 0: top-k of
    # n_experts SwiGLU experts of moe_ffn_dim (None: ffn_dim), softmax or sigmoid router scores,
    # the k weights renormalised or not (Mixtral yes, Qwen3-MoE as norm_topk_prob says), plus
    # n_shared_experts experts every token passes through.
    n_experts: int = 0
    experts_per_token: int = 2
    moe_ffn_dim: int | None = None
    n_shared_experts: int = 0
    router_score: str = "softmax"  # | "sigmoid"
    router_renorm: bool = True
    # A per-expert bias added to the scores for choosing the top k only (the weights stay the
    # scores): DeepSeek-V3's loss-free balancing, which training adjusts (train.moe_bias_rate).
    router_bias: bool = False

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads
        if self.moe_ffn_dim is None:
            self.moe_ffn_dim = self.ffn_dim

    def to_dict(self) -> dict:
        return asdict(self)

    def sliding(self, layer_id: int) -> bool:
        """Whether layer `layer_id` attends within the sliding window only."""
        return self.sliding_window is not None and not (self.sliding_pattern and
                                                        (layer_id + 1) % self.sliding_pattern == 0)

    def kv_params(self) -> int:
        """Parameters of one layer's key and value projections (with their biases)."""
        return 2 * self.head_dim * self.n_kv_heads * (self.dim + (1 if self.qkv_bias else 0))

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down): its FLOPs per token / 2."""
        hd = self.head_dim
        return self.dim * hd * (2 * self.n_heads + 2 * self.n_kv_heads) + 3 * self.dim * self.active_ffn_dim()

    def active_ffn_dim(self) -> int:
        """The MLP hidden width one token computes: ffn_dim, or for MoE its k routed and the
        shared experts' widths together (the router's dim x n_experts is left out: it is small)."""
        if not self.n_experts:
            return self.ffn_dim
        return (self.experts_per_token + self.n_shared_experts) * self.moe_ffn_dim

    def moe_params(self) -> int:
        """Parameters of one layer's experts and router beyond `layer_matmul_params` (0 if dense):
        the experts no token of the layer's average computes, i.e. total - active."""
        if not self.n_experts:
            return 0
        return 3 * self.dim * self.moe_ffn_dim * (self.n_experts - self.experts_per_token) + self.dim * self.n_experts

    def routed_expert_params(self) -> int:
        """One MoE layer's routed experts (gate, up and down of each), whole; 0 if dense."""
        return 3 * self.dim * self.moe_ffn_dim * self.n_experts if self.n_experts else 0

    def layer_params(self) -> int:
        """Parameters of one decoder layer: the matmuls, the q/k/v biases and the norms."""
        bias = self.head_dim * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0
        qk_norm = 2 * self.head_dim if self.qk_norm else 0
        norms = (4 if self.sandwich_norm else 2) * self.dim
        return self.layer_matmul_params() + self.moe_params() + bias + qk_norm + norms

    def active_params(self) -> int:
        """Parameters one token computes with: all of them, less the experts it is not routed to."""
        return self.num_params() - self.n_layers * self.moe_params()

    def num_params(self) -> int:
        """Parameter count, computed from the sizes alone (no model is built)."""
        embed = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * self.layer_params() + embed + head + self.dim


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig, hidden: int | None = None):
        super().__init__()
        hidden = hidden or cfg.ffn_dim
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)  # down

        self.act = F.silu if cfg.mlp_act == "silu" else functools.partial(F.gelu, approximate="tanh")

    gate_up: torch.Tensor | None = None  # set by `fuse_projections`: [w1; w3] as one weight

    def forward(self, x):
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.w2(self.act(gate) * up)
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, cfg.sliding(layer_id))
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if cfg.n_experts else FeedForward(cfg)
        self.post_attention_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norm else None
        self.post_ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.sandwich_norm else None

    def forward(self, x, cos, sin, kv_cache=None, start_pos: int = 0, mask=None, doc_ids=None):
        a = self.attention(self.attention_norm(x), cos, sin, kv_cache, self.layer_id, start_pos, mask=mask,
                           doc_ids=doc_ids)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        # On the meta device (how every layout builds it) nothing is drawn: init_weights or a
        # loader fills the weights and tables. nn.Embedding's own normal_ and the tables' arange
        # have no C++ meta kernels there; PyTorch's Python ones import torch._dynamo and sympy
        # (1.3 s and 74 MiB a process, which an eager generate never needs otherwise).
        on_meta = torch.get_default_device().type == "meta"
        weight = torch.empty(cfg.vocab_size, cfg.dim) if on_meta else None
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=weight)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_table_placeholders(cfg, cfg.max_seq_len) if on_meta else model_rope_tables(cfg, cfg.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # Set by context parallel (parallel/context_parallel.apply_context_parallel): each row holds
    # this rank's share of its sequence at the global `positions`, and every layer's attention
    # (`Attention.context`) keeps packed documents apart by `doc_ids` across the shares; a mask
    # over one share would be wrong, so none is built.
    sequence_sharded: bool = False

    def forward(self, tokens: torch.Tensor, kv_cache=None, start_pos: int | torch.Tensor = 0,
                last_only: bool = False, positions: torch.Tensor | None = None,
                pick: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [b, s] -> logits [b, s, vocab]. With a `kv_cache`, `start_pos` is the
        position of tokens[:, 0] (an int, or a LongTensor [b] when the sequences of the batch
        are at different positions) and the cache is extended in place. `last_only` computes
        logits for the last position only (all that generation needs). `positions` [b, s]
        (training on packed rows): each token's position in its document, 0 where one starts;
        attention then stays within documents (`document_mask`); with a `kv_cache` (several
        sequences packed in one row, the cache's `PackedStep`), each token's position in its
        sequence. `pick` [n]: the positions of the row whose logits are wanted (the last token
        of each packed sequence). `doc_ids` [b, s] (`sequence_sharded` packed rows): each token's
        document, numbered over the whole row."""
        s = tokens.shape[1]
        mask = None
        if positions is not None:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
            mask = document_mask(positions) if kv_cache is None and not self.sequence_sharded else None
        elif isinstance(start_pos, torch.Tensor):
            pos = start_pos[:, None] + torch.arange(s, device=start_pos.device)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # the caller keeps pos inside the table
        else:
            if start_pos + s > self.rope_cos.shape[0]:
                self._extend_rope(start_pos + s)
            cos = self.rope_cos[start_pos:]
            sin = self.rope_sin[start_pos:]
        # Looked up only when scaled: the lookup is lru_cached, which torch.compile warns about.
        limit = (dynamic_rope_limit(self.cfg.rope_scaling)
                 if self.cfg.rope_scaling and (positions is None or kv_cache is not None) else None)
        if limit is not None:
            cos, sin = self._dynamic_rope(start_pos if positions is None else positions, s, limit, cos, sin)
        if kv_cache is not None:  # generation: shaped once for all layers (training shards the sequence)
            cos, sin = rope_for_heads(cos, sin, s)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.tok_embeddings is not None and self.cfg.embed_scale != 1.0:
            h = h * self.cfg.embed_scale
        hd, local = self.cfg.head_dim, self.cfg.rope_local_theta is not None
        for layer in self.layers.values():
            if local:  # the global and local tables side by side (`model_rope_tables`)
                half = slice(hd, None) if self.cfg.sliding(layer.layer_id) else slice(None, hd)
                h = layer(h, cos[..., half], sin[..., half], kv_cache, start_pos, mask=mask, doc_ids=doc_ids)
            else:
                h = layer(h, cos, sin, kv_cache, start_pos, mask=mask, doc_ids=doc_ids)
        if pick is not None and self.output is not None:
            h = h[:, pick]
        elif last_only and self.output is not None:
            h = h[:, -1:]
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits, cap = self.output(h), self.cfg.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _extend_rope(self, length: int):
        self.rope_cos, self.rope_sin = model_rope_tables(self.cfg, length, self.rope_cos.device)

    def _dynamic_rope(self, start_pos, s: int, limit: int, cos, sin):
        """Dynamic NTK scaling as transformers applies it: a call whose longest sequence ends
        past `limit` uses frequencies recomputed for that length (cached keys keep theirs)."""
        packed = isinstance(start_pos, torch.Tensor) and start_pos.dim() == 2  # positions [1, T] of packed sequences
        end = (int(start_pos.max()) + (1 if packed else s)) if isinstance(start_pos, torch.Tensor) else start_pos + s
        if end <= limit:
            return cos, sin
        cos_t, sin_t = rope_tables(self.cfg.head_dim, end, self.cfg.rope_theta, device=self.rope_cos.device,
                                   scaling=self.cfg.rope_scaling, seq_len=end)
        if packed:
            return cos_t[start_pos], sin_t[start_pos]
        if isinstance(start_pos, torch.Tensor):
            pos = start_pos[:, None] + torch.arange(s, device=start_pos.device)
            return cos_t[pos], sin_t[pos]
        return cos_t[start_pos:], sin_t[start_pos:]

    def tie_weights(self) -> None:
        """Share the head's weight with the embedding again where the config ties them:
        `Module.to_empty` gives every module a new parameter of its own, which unties them
        (then the head was initialised and trained apart, and layouts disagreed)."""
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None,
                     only: Callable[[str], bool] | None = None):
        """Initialise every parameter (or those whose name `only` accepts) from (seed, parameter
        name) alone.

        Each tensor is drawn whole on the CPU from its own generator, so the weights are
        the same whatever the world size or layout; a sharded (DTensor) parameter keeps
        only its own slice of the same full tensor.
        """
        device = buffer_device or next(iter(self.buffers())).device
        if device.type == "meta":
            device = torch.device("cpu")
        self.rope_cos, self.rope_sin = model_rope_tables(self.cfg, self.cfg.max_seq_len, device)
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in _unique_named_parameters(self):
            if only is not None and not only(name):
                continue
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape)
            else:
                std = out_std if name.endswith(("wo.weight", "w2.weight", "feed_forward.w2")) else 0.02
                g = torch.Generator().manual_seed(_name_seed(seed, name))
                full = torch.empty(p.shape).normal_(0.0, std, generator=g).clamp_(-3 * std, 3 * std)
            assign_full_tensor(p, full)
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # built on the meta device like the weights: no values yet
                self.get_submodule(name.rpartition(".")[0]).expert_bias = torch.zeros(buffer.shape, device=device)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions within documents (0 starts one) -> [b, 1, s, s] boolean mask: causal,
    and never across a document boundary. A dense mask for SDPA rather than FlexAttention's
    BlockMask: FlexAttention has no backward on CPU in torch 2.13, so it cannot train there,
    and its eager forward was 4-12x slower than SDPA's (benchmarks/doc_attention.py); SDPA
    with a mask runs under every layout (TP, pipeline stages, checkpointing) as it is."""
    doc = document_ids(positions)
    s = positions.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[b, s] positions within documents -> [b, s] the document of each token: 0 starts one."""
    return (positions == 0).cumsum(1)


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
