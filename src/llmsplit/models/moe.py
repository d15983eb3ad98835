"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE), plain PyTorch like the rest of `models/`.

A router scores every expert for every token (softmax or sigmoid), each token goes to its top-k
experts, optionally with the k weights renormalised to sum to 1; the experts are SwiGLU MLPs whose
weights are stacked ([experts, out, in], the layout of an nn.Linear per expert), optionally beside
shared experts every token passes through. Dropless: every token reaches its k experts, no
capacity limit. Tokens are sorted by expert and the experts run as one grouped matmul over the
contiguous rows of each (torch.nn.functional.grouped_mm, torch's grouped GEMM, which has a CPU
kernel in torch 2.13), not a Python loop over experts or tokens.

Expert parallel (parallel/expert_parallel.py) sets `dispatch` from outside: a callable that takes
the place of `experts`, sends the sorted rows to the rank holding their expert and brings the
results back; the plain model leaves it None and holds every expert.

Balancing: `aux_loss` (the Switch/Mixtral load-balancing loss) and `tokens_per_expert` of the last
forward are kept on the module for a training loop to read; with `router_bias`, `expert_bias` is
added to the scores for choosing experts, and the loop moves it towards balance between steps
(DeepSeek-V3's auxiliary-loss-free balancing, train/moe_stats.py).
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .llama import LlamaConfig


class MoE(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        e, d, f = cfg.n_experts, cfg.dim, cfg.moe_ffn_dim
        self.k, self.score, self.renorm = cfg.experts_per_token, cfg.router_score, cfg.router_renorm
        self.router = nn.Linear(d, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, d))  # gate, per expert as nn.Linear holds it
        self.w3 = nn.Parameter(torch.empty(e, f, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, f))  # down
        self.shared = None
        if cfg.n_shared_experts:
            from .llama import FeedForward

            self.shared = FeedForward(cfg, cfg.n_shared_experts * f)
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        if cfg.router_bias:
            # Persistent, so checkpoints keep it; a buffer, not a parameter: no gradient, no
            # optimizer state. Zeroed by Transformer.init_weights after meta-device construction.
            self.register_buffer("expert_bias", torch.zeros(e))
        self.dispatch = None  # set by parallel.ep; (moe, rows sorted by expert, counts) -> expert outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, x.shape[-1])
        logits = self.router(t).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        bias = getattr(self, "expert_bias", None)
        chosen = (scores if bias is None else scores + bias).topk(self.k, dim=-1).indices  # [tokens, k]
        weights = scores.gather(1, chosen)
        if self.renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=scores.shape[1])
        self.tokens_per_expert = counts.detach()
        # Switch/Mixtral: experts * sum_e(share of routed tokens_e * mean score_e), 1 when balanced.
        self.aux_loss = scores.shape[1] * (counts.float() / chosen.numel() * scores.mean(0)).sum()
        order = chosen.flatten().argsort(stable=True)  # routed copies sorted by expert
        rows = order // self.k  # the token each sorted copy came from
        run = self.experts if self.dispatch is None else partial(self.dispatch, self)
        y = run(t[rows], counts) * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(t).index_add_(0, rows, y)
        if self.shared is not None:
            out = out + self.shared(t)
        return out.view(x.shape)

    def experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """SwiGLU of each expert over its rows of `x` ([sum(counts), dim], sorted by expert)."""
        return grouped_swiglu(x, counts, self.w1, self.w3, self.w2)


def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU (weights w1[e], w3[e], w2[e]) over its `counts[e]` consecutive rows of `x`."""
    offs = counts.cumsum(0).to(torch.int32)
    gate = F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    up = F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
    return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
