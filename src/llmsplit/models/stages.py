"""How the decoder's layers are cut into pipeline stages: a pure function of the model's
shape, shared by the pipeline (which cuts) and the planner (which predicts what each
stage holds), so that both always agree."""

from __future__ import annotations

from .llama import LlamaConfig


def layer_costs(cfg: LlamaConfig) -> tuple[list[float], float, float]:
    """Relative forward cost of each layer, of the embedding and of norm + output head,
    in units of one layer's matmul FLOPs per token."""
    hd = cfg.head_dim
    layer = cfg.dim * hd * (cfg.n_heads + 2 * cfg.n_kv_heads) + cfg.n_heads * hd * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    head = cfg.vocab_size * cfg.dim / layer
    embed = 0.05 * head  # a lookup, not a matmul; still memory traffic
    return [1.0] * cfg.n_layers, embed, head


def split_layers(cfg: LlamaConfig, n_stages: int) -> list[list[int]]:
    """Contiguous layers per stage, minimising the cost of the most expensive stage
    (embedding counted on the first stage, the head on the last). Every stage gets a layer."""
    costs, embed, head = layer_costs(cfg)
    n = len(costs)
    assert 1 <= n_stages <= n, (n_stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (embed if stage == 0 else 0.0) + (head if stage == n_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: minimal max-cost of placing layers [0, i) into stages [0, s).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n - (n_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], cost(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(n_stages, 0, -1):
        j = cut[s][i]
        bounds.append(list(range(j, i)))
        i = j
    return bounds[::-1]
