"""The tensor-parallel plan: which weights of the decoder split over the tp ranks by column
(their output features, weight dim 0), by row (their input features, dim 1), or stay whole.

One table, read by training's DTensor plan (parallel/tensor_parallel.py), inference's weight
slicing (`tp_shard`, infer/runner) and the planner's per-rank sizes (plan/memory.py,
plan/states.py), so what a rank holds cannot differ between them. Pure: names and shapes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import lru_cache
from types import MappingProxyType

from ..models.llama import LlamaConfig
from ..models.weight_shapes import Shape, parameter_shapes

COLWISE, ROWWISE, REPLICATE, VOCAB = "colwise", "rowwise", "replicate", "vocab"

# Modules of a decoder layer (names within the layer) -> how their weights divide over tp.
# A column split divides a bias with its rows; a row split leaves the bias whole, because it
# is added once, after the ranks' partial outputs are summed. Norms and the router are small
# and run on activations every rank holds whole.
LAYER_PLAN: dict[str, str] = {
    "attention.wq": COLWISE, "attention.wk": COLWISE, "attention.wv": COLWISE, "attention.wo": ROWWISE,
    "feed_forward.w1": COLWISE, "feed_forward.w3": COLWISE, "feed_forward.w2": ROWWISE,
    "feed_forward.shared.w1": COLWISE, "feed_forward.shared.w3": COLWISE, "feed_forward.shared.w2": ROWWISE,
    "feed_forward.router": REPLICATE,
    "attention_norm": REPLICATE, "ffn_norm": REPLICATE, "post_attention_norm": REPLICATE, "post_ffn_norm": REPLICATE,
    "attention.q_norm": REPLICATE, "attention.k_norm": REPLICATE,
}
# With more tp ranks than key/value heads (training allows tp a multiple of n_kv_heads) a
# column split would cut a head into pieces, so these stay whole on every rank and each rank
# uses the head its query heads read (parallel.tensor_parallel.KVHeadReplicate). Inference
# refuses that layout (layout/rules.py): its KV cache is sharded by whole heads.
KV_PROJECTIONS = ("attention.wk", "attention.wv")
# Qwen3's per-head q/k norms: whole weights, run on this rank's heads (the sharded dim).
HEAD_NORMS = ("attention.q_norm", "attention.k_norm")

# A MoE layer's stacked routed experts ([experts, out, in], tensors of feed_forward itself) ->
# the dim INFERENCE splits over tp: each expert split like a dense MLP (its hidden width over
# the tp ranks), so every rank computes 1/tp of every routed token whatever the routing, and
# the layer's routed and shared outputs are summed by one all-reduce, as a dense MLP's.
# Keeping whole experts per rank instead would be expert parallel: tokens sent between ranks
# (all-to-all) and ranks idle or overloaded as the router chooses. TRAINING does keep them
# whole on every tp rank and splits them over ep (parallel/expert_parallel.py): with ep's
# all-to-all already there, a tp split as well would add a second all-reduce per layer.
INFER_EXPERT_DIMS: dict[str, int] = {"feed_forward.w1": 1, "feed_forward.w3": 1, "feed_forward.w2": 2}
# The router's bias (model.router_bias): a buffer, whole on every rank, with no gradient.
BUFFERS = ("feed_forward.expert_bias",)

# Outside the layers: the embedding and the head split over the vocabulary (weight dim 0);
# training computes the loss on the vocabulary shards (loss parallel), inference reads its
# shards apart and pads the last one (infer/runner/vocab_parallel.py). The final norm is whole.
TOP_PLAN: dict[str, str] = {"tok_embeddings": VOCAB, "output": VOCAB, "norm": REPLICATE}


def layer_plan(cfg: LlamaConfig) -> dict[str, str]:
    """The modules of a decoder layer of `cfg` that hold weights, with their split, in the
    model's order (a MoE layer's routed experts are not modules: `INFER_EXPERT_DIMS`)."""
    modules = (name.rpartition(".")[0] for name, _ in layer_shapes(cfg))
    return {m: LAYER_PLAN[m] for m in modules if m in LAYER_PLAN}


def split_dim(name: str, experts_over_tp: bool = True) -> int | None:
    """The dim of tensor `name` (within a layer: "attention.wq.bias") that tp divides, or None
    when every rank holds it whole; routed experts by inference's split, or whole with
    `experts_over_tp` False (training)."""
    if name in INFER_EXPERT_DIMS:
        return INFER_EXPERT_DIMS[name] if experts_over_tp else None
    module, _, kind = name.rpartition(".")
    split = LAYER_PLAN.get(module)
    if split == COLWISE:
        return 0
    return 1 if split == ROWWISE and kind == "weight" else None


def tp_shard(name: str, rank: int, size: int) -> tuple[int, int, int] | None:
    """(dim, rank, size): inference's slice of parameter `name` ("layers.3.attention.wq.weight")
    on tp rank `rank` of `size`, or None when the rank reads it whole. The embedding and head
    are None too: their vocabulary shards are read apart (infer/runner/vocab_parallel.py)."""
    if size == 1:
        return None
    parts = name.split(".", 2)
    within = parts[2] if parts[0] == "layers" and len(parts) == 3 else name
    dim = split_dim(within)
    return None if dim is None else (dim, rank, size)


def layer_shapes(cfg: LlamaConfig) -> Iterator[tuple[str, Shape]]:
    """(name within the layer, whole shape) of every tensor of one decoder layer of `cfg`
    (all layers have the same), buffers included."""
    prefix = "layers.0."
    for name, shape in parameter_shapes(cfg):
        if name.startswith(prefix):
            yield name[len(prefix):], shape
        elif name.startswith("layers."):
            return  # parameter_shapes is lazy: stop before the other layers


def rank_layer_shapes(cfg: LlamaConfig, tp: int, experts_over_tp: bool) -> Mapping[str, Shape]:
    """The shape of every parameter of a decoder layer on one of `tp` ranks (buffers left out):
    the table's split, with the kv projections whole when tp does not divide the kv heads."""
    # Cached by the config's values: the planner asks for the same few layers ~10⁵ times a plan.
    return _rank_layer_shapes(tuple(vars(cfg).items()), tp, experts_over_tp)


@lru_cache(maxsize=256)
def _rank_layer_shapes(fields: tuple, tp: int, experts_over_tp: bool) -> Mapping[str, Shape]:
    cfg = LlamaConfig(**dict(fields))
    out = {}
    for name, shape in layer_shapes(cfg):
        if name in BUFFERS:
            continue
        dim = split_dim(name, experts_over_tp)
        if name.rpartition(".")[0] in KV_PROJECTIONS and cfg.n_kv_heads % tp:
            dim = None
        out[name] = shape if dim is None else (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])
    return MappingProxyType(out)  # shared by every caller: read-only
