"""The decoder's attention and its RMSNorm, plain PyTorch like the rest of `models/`.

Grouped-query attention through SDPA, with what the families add as config fields: q/k norms
(Qwen3), a sliding window on some layers (Mistral, Gemma), a query scale of its own and
tanh-capped scores (Gemma 2), for which SDPA has no option and the scores are computed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .rope import apply_rope

if TYPE_CHECKING:
    from .llama import LlamaConfig


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
    def __init__(self, cfg: LlamaConfig, sliding: bool = False):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window if sliding else None  # keys within this many positions
        self.softcap = cfg.attn_softcap
        self.scale = cfg.query_pre_attn_scalar ** -0.5 if cfg.query_pre_attn_scalar else None
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    # Set by `fuse_projections` for inference: [wq; wk; wv] as one weight (and bias), and the
    # head counts of q and k in it. None: three matmuls (training, offloaded layers).
    qkv: tuple | None = None
    # Set by context parallel (parallel/context_parallel.apply_context_parallel) for training:
    # (q, k, v, doc_ids=) -> out, attention over a sequence whose rows this rank holds a share of,
    # the other shares on other ranks; documents kept apart by `doc_ids`. None: `_attend` alone.
    context: Callable | None = None

    def forward(self, x, cos, sin, kv_cache=None, layer_id: int = 0, start_pos: int = 0, mask=None, doc_ids=None):
        """`mask` (training on packed rows, no cache): [b, 1, s, s], True where a query may
        attend to a key (`llama.document_mask`). `doc_ids` [b, s] (packed rows under `context`):
        each token's document."""
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
            # The cache stores the new keys and attends each sequence to its own: through
            # `_attend` on keys it gathers, or for one-token queries with a kernel of its own
            # over its pool, which follows the same scores rule. Under a fused prefill + decode
            # step (several sequences' tokens in one row) each part attends to its own keys.
            rule = (self.scale or self.head_dim ** -0.5, self.softcap, self.window)
            out = kv_cache.attend(layer_id, q, k, v, self._attend, rule)
        else:
            out = self._attend(q, k, v, mask, start_pos, doc_ids).transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)

    def _attend(self, q, k, v, mask, start_pos, doc_ids=None):
        if self.context is not None:
            return self.context(q, k, v, doc_ids=doc_ids)
        s, total = q.shape[2], k.shape[2]
        causal = False
        if self.window is not None and total > self.window:
            # Sliding window (Mistral, Gemma's local layers): position p sees keys p-window+1..p.
            start = start_pos[:, None, None, None] if isinstance(start_pos, torch.Tensor) else start_pos
            qpos = start + torch.arange(s, device=q.device)[:, None]
            kpos = torch.arange(total, device=q.device)
            near = (kpos <= qpos) & (kpos > qpos - self.window)
            mask = near if mask is None else mask & near
        elif mask is not None:
            pass
        elif total == s:
            causal = True  # nothing cached before these tokens
        elif s > 1:
            # A chunk appended after cached tokens: position i sees cache + chunk[:i+1].
            mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(total - s)
        # (else one new token attends to everything cached)
        n_rep = q.shape[1] // k.shape[1]
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=n_rep > 1)
        # Gemma 2 caps the scores with tanh before the softmax, which SDPA has no option for.
        if causal:
            mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril()
        k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
        scores = (q @ k.transpose(-2, -1)) * (self.scale or self.head_dim ** -0.5)
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
