"""The tensors a model config makes, and the check of a model file's tensors against them.

Every reader (Hugging Face folders, GGUF files, training checkpoints) runs `shape_mismatch`
on the shapes its file's own metadata declares (safetensors headers, GGUF tensor infos, DCP
metadata) before anything is built or read, so a config that disagrees with its weights is
refused by name instead of crashing at the first forward (or, for a layer count of 10⁹,
listing names until memory runs out). The check walks the config's tensors lazily and stops
at the first one the file lacks: each step past that matches a distinct tensor of the file,
so its time and memory are bounded by the file, not by what the config claims.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

from .llama import LlamaConfig

Shape = tuple[int, ...]
# The most decoder layers a config may name. The largest published models have under 200; the
# bound is what keeps a config read without weights (`plan --model FOLDER` on a config.json
# alone) from making per-layer lists of whatever length it claims.
MAX_LAYERS = 1024
VALUE_CHOICES = {"router_score": ("softmax", "sigmoid"), "mlp_act": ("silu", "gelu_tanh")}  # the string fields' values


def model_params(cfg: LlamaConfig) -> int:
    """The parameters of `Transformer(cfg)` held whole in one process, a tied head once."""
    total = sum(math.prod(shape) for _, shape in parameter_shapes(cfg))
    return total - (cfg.vocab_size * cfg.dim if cfg.tie_embeddings else 0)


def parameter_shapes(cfg: LlamaConfig) -> Iterator[tuple[str, Shape]]:
    """(name, shape) of every parameter of `Transformer(cfg)`, in its order, computed from the
    sizes alone; a tied head is listed (as output.weight) although files may omit it. A MoE
    router's `expert_bias` (model.router_bias), a buffer, is listed too: checkpoints hold it."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    yield "tok_embeddings.weight", (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        yield f"layers.{i}.attention_norm.weight", (cfg.dim,)
        yield f"layers.{i}.ffn_norm.weight", (cfg.dim,)
        if cfg.sandwich_norm:
            yield f"layers.{i}.post_attention_norm.weight", (cfg.dim,)
            yield f"layers.{i}.post_ffn_norm.weight", (cfg.dim,)
        for w, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            yield f"layers.{i}.attention.{w}.weight", (rows, cfg.dim)
            if cfg.qkv_bias:
                yield f"layers.{i}.attention.{w}.bias", (rows,)
        yield f"layers.{i}.attention.wo.weight", (cfg.dim, q)
        if cfg.qk_norm:
            yield f"layers.{i}.attention.q_norm.weight", (cfg.head_dim,)
            yield f"layers.{i}.attention.k_norm.weight", (cfg.head_dim,)
        yield from _mlp_shapes(cfg, f"layers.{i}.feed_forward")
    yield "norm.weight", (cfg.dim,)
    yield "output.weight", (cfg.vocab_size, cfg.dim)


def _mlp_shapes(cfg: LlamaConfig, prefix: str) -> Iterator[tuple[str, Shape]]:
    if not cfg.n_experts:
        yield from ((f"{prefix}.{w}.weight", shape) for w, shape in
                    (("w1", (cfg.ffn_dim, cfg.dim)), ("w3", (cfg.ffn_dim, cfg.dim)), ("w2", (cfg.dim, cfg.ffn_dim))))
        return
    e, f = cfg.n_experts, cfg.moe_ffn_dim
    yield f"{prefix}.router.weight", (e, cfg.dim)
    if cfg.router_bias:
        yield f"{prefix}.expert_bias", (e,)
    yield from ((f"{prefix}.{w}", (e, *shape)) for w, shape in (("w1", (f, cfg.dim)), ("w3", (f, cfg.dim)),
                                                               ("w2", (cfg.dim, f))))
    if cfg.n_shared_experts:
        s = cfg.n_shared_experts * f
        yield from ((f"{prefix}.shared.{w}.weight", shape) for w, shape in
                    (("w1", (s, cfg.dim)), ("w3", (s, cfg.dim)), ("w2", (cfg.dim, s))))


def structure_problem(cfg: LlamaConfig, key: Callable[[str], str] = str) -> str | None:
    """What makes sizes that are each positive still impossible for the decoder, or None.
    `key` turns a LlamaConfig field into the name the file uses for it."""
    if cfg.n_layers > MAX_LAYERS:
        return (f"{key('n_layers')} is {cfg.n_layers}, more layers than llmsplit builds ({MAX_LAYERS}; the largest "
                f"published models have under 200)")
    if cfg.head_dim == cfg.dim // cfg.n_heads and cfg.dim % cfg.n_heads:
        return f"{key('dim')} {cfg.dim} is not a multiple of {key('n_heads')} {cfg.n_heads} (every head is as wide)"
    if cfg.n_kv_heads > cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        return (f"{key('n_heads')} {cfg.n_heads} is not a multiple of {key('n_kv_heads')} {cfg.n_kv_heads} "
                f"(each key/value head serves a whole group of query heads)")
    for field, allowed in VALUE_CHOICES.items():
        if getattr(cfg, field) not in allowed:
            return f"{key(field)} is {getattr(cfg, field)!r}; it must be one of {', '.join(map(repr, allowed))}"
    if cfg.n_experts and not 1 <= cfg.experts_per_token <= cfg.n_experts:
        return (f"{key('experts_per_token')} is {cfg.experts_per_token}; each token goes to between 1 and "
                f"{key('n_experts')} {cfg.n_experts} experts")
    if cfg.n_experts and (cfg.dim % 8 or cfg.moe_ffn_dim % 8):
        return (f"{key('dim')} {cfg.dim} and {key('moe_ffn_dim')} {cfg.moe_ffn_dim} must be multiples of 8 for "
                f"mixture-of-experts layers (the grouped matmul's alignment)")
    if cfg.head_dim < 2 or cfg.head_dim % 2:
        return (f"{key('head_dim')} is {cfg.head_dim} ({key('dim')} {cfg.dim} / {key('n_heads')} {cfg.n_heads} "
                f"unless set); rotary embeddings need an even head size of at least 2")
    return None


def layers_in(found: Mapping[str, Shape]) -> int:
    """How many decoder layers a file's tensors (under our names) reach: the highest index + 1."""
    indices = [int(part) for part in (name.split(".", 2)[1] for name in found if name.startswith("layers."))
               if part.isdigit()]
    return max(indices) + 1 if indices else 0


def shape_mismatch(cfg: LlamaConfig, found: Mapping[str, Shape], file_name: Callable[[str], str] = str,
                   layers_key: str = "n_layers") -> str | None:
    """The first disagreement between `cfg` and a file's tensors, or None.

    `found`: our name -> shape of every tensor of the file that llmsplit uses (names it does
    not know left out); `file_name` spells our name as the file does, for the message;
    `layers_key` is the file's name for the layer count."""
    layers = layers_in(found)
    if layers != cfg.n_layers:
        return f"{layers_key} is {cfg.n_layers} but the file holds the tensors of {layers} layers"
    matched = 0
    for name, shape in parameter_shapes(cfg):  # lazily: n_layers may still lie about the middle
        if name not in found:
            if name == "output.weight" and cfg.tie_embeddings:
                continue  # a tied head is the embedding; files usually leave it out
            return f"it lacks the tensor {file_name(name)} {list(shape)} that the config's sizes make"
        if tuple(found[name]) != shape:
            return (f"tensor {file_name(name)} is {list(found[name])} in the file but the config's sizes "
                    f"make it {list(shape)}")
        matched += 1
    if matched < len(found):
        expected = {name for name, _ in parameter_shapes(cfg)}  # bounded now: every layer matched
        extra = next(name for name in found if name not in expected)
        return f"tensor {file_name(extra)} of the file has no place in a model of the config's sizes"
    return None
