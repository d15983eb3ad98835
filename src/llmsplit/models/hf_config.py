"""Hugging Face `config.json` ↔ `LlamaConfig`: the one key table, read by every entry point
(`llmsplit plan --model FOLDER`, `train --set model.hf=FOLDER`, `generate --model FOLDER`)
and written by export; with the tensor-name table (`hf_names.py`), `read_hf_config` checks
config.json against the tensor shapes the folder's safetensors headers declare before
anything is built (read from the headers alone, so the planner can check without torch).

What llmsplit's decoder cannot compute (another architecture, a rope scaling kind it does
not implement, biases where it has none, layer types without a fixed period) is refused by
name rather than loaded with silently different maths. This module
imports nothing else of llmsplit, so it raises `UnsupportedHFConfig` (a ValueError); each
entry layer turns that into its own user error in one place.
"""

from __future__ import annotations

import json
from pathlib import Path

from .hf_names import FUSED, MOE_FAMILIES, UnsupportedHFConfig, to_hf_name, weight_files, weight_shapes
from .llama import LlamaConfig
from .rope import rope_params
from .weight_shapes import shape_mismatch, structure_problem

__all__ = ["UnsupportedHFConfig", "config_from_hf", "config_to_hf", "eos_ids_from_hf", "is_hf_folder", "read_hf_config"]


SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
             "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
# Families whose config.json may name a sliding window (Qwen2/3 only with use_sliding_window, refused).
_SLIDING = ("mistral", "phi3", "mixtral", *GEMMA)

_REQUIRED = object()
# (config.json key, LlamaConfig field, kind, value when absent) — both directions read this.
# The defaults are transformers' LlamaConfig defaults, so an absent key means what it means there.
_KEYS = (
    ("hidden_size", "dim", int, _REQUIRED),
    ("num_hidden_layers", "n_layers", int, _REQUIRED),
    ("num_attention_heads", "n_heads", int, _REQUIRED),
    ("num_key_value_heads", "n_kv_heads", int, None),  # None: as many as attention heads
    ("vocab_size", "vocab_size", int, _REQUIRED),
    ("intermediate_size", "ffn_dim", int, _REQUIRED),
    ("max_position_embeddings", "max_seq_len", int, 2048),
    ("rms_norm_eps", "norm_eps", float, 1e-6),
    ("tie_word_embeddings", "tie_embeddings", bool, False),
    ("head_dim", "head_dim", int, None),  # None: hidden_size // num_attention_heads
)

_HF_KEY = {field: key for key, field, _, _ in _KEYS}

# Rotary scaling kinds transformers' Llama computes, and the keys each one reads.
_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def is_hf_folder(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def read_hf_config(folder: str | Path) -> tuple[LlamaConfig, dict]:
    """The model config of a Hugging Face folder, and its config.json as parsed (for the
    keys that are not sizes: eos ids, dtype). A folder with weights has them checked against
    the config first: the layer count, then every tensor's shape. One whose index names files
    not downloaded yet (to plan before fetching gigabytes) is read as a config alone; the
    loader names the missing file."""
    where = str(Path(folder) / "config.json")
    try:
        raw = json.loads(Path(where).read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedHFConfig(f"{where!r} is not a readable JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise UnsupportedHFConfig(f"{where!r} holds {type(raw).__name__}, not the JSON object of a model config")
    cfg = config_from_hf(raw, where)
    files = weight_files(folder)
    if files and all((Path(folder) / f).is_file() for f in files):
        problem = shape_mismatch(cfg, weight_shapes(folder, files, cfg), lambda n: to_hf_name(n, cfg),
                                 "num_hidden_layers")
        if problem:
            raise UnsupportedHFConfig(f"{str(folder)!r}: config.json does not match the safetensors weights: "
                                      f"{problem}; use the config.json saved with these weights")
    return cfg, raw


def config_from_hf(raw: dict, where: str = "config.json") -> LlamaConfig:
    """Our model config from a parsed Hugging Face `config.json` (`where` names it in errors)."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or [SUPPORTED.get(model_type, model_type)]
    if model_type not in SUPPORTED or archs[0] not in SUPPORTED.values():
        raise UnsupportedHFConfig(f"{where}: architectures {archs[0]!r} (model_type {model_type!r}) is not "
                                  f"supported; llmsplit loads {', '.join(sorted(SUPPORTED.values()))}")
    if raw.get("hidden_act", "silu") != "silu" and model_type not in GEMMA:
        raise UnsupportedHFConfig(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; "
                                  f"the Llama family uses 'silu'")
    if raw.get("mlp_bias"):
        raise UnsupportedHFConfig(f"{where}: mlp_bias true is not supported; llmsplit's MLP has no biases")
    if raw.get("use_sliding_window"):
        raise UnsupportedHFConfig(f"{where}: use_sliding_window true is not supported; llmsplit's {model_type} "
                                  f"attends to the whole context (set it to false)")
    if model_type != "qwen2" and raw.get("attention_bias"):
        raise UnsupportedHFConfig(f"{where}: attention_bias true is not supported for model_type {model_type!r}; "
                                  f"llmsplit has q/k/v biases (as Qwen2) but none on the attention output")
    sizes = _sizes(raw, where)
    raw, local_theta = _local_rope(raw, where) if model_type == "gemma3_text" else (raw, None)
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = raw.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise UnsupportedHFConfig(f"{where}: {rope_key} is {rope!r}; it must be a JSON object with a rope_type key")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise UnsupportedHFConfig(f"{where}: rope_theta is {theta!r}; it must be a positive number")
    cfg = LlamaConfig(**sizes, rope_theta=float(theta), qkv_bias=model_type == "qwen2",
                      qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
                      rope_scaling=_rope_scaling(rope, rope_key, raw, where),
                      family=model_type if model_type in (*FUSED, *GEMMA, *MOE_FAMILIES) else None,
                      rope_local_theta=local_theta, **(_moe(raw, model_type, where) if model_type in MOE_FAMILIES else {}),
                      **(_sliding(raw, sizes["n_layers"], where) if model_type in _SLIDING else {}),
                      **(_gemma(raw, sizes["dim"], where) if model_type in GEMMA else {}))
    if local_theta is not None and cfg.rope_scaling and json.loads(cfg.rope_scaling)["rope_type"] == "dynamic":
        raise UnsupportedHFConfig(f"{where}: dynamic rope scaling with Gemma 3's local rotary base is not supported")
    problem = structure_problem(cfg, _HF_KEY.get)
    if problem:
        raise UnsupportedHFConfig(f"{where}: {problem}")
    return cfg


def _gemma(raw: dict, dim: int, where: str) -> dict:
    """Gemma 2's fields of LlamaConfig (its norms' 1 + w is the readers' business)."""
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise UnsupportedHFConfig(f"{where}: hidden_activation {act!r} is not supported; Gemma uses 'gelu_pytorch_tanh'")
    fields = {}
    for key, field in (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "logit_softcap")):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise UnsupportedHFConfig(f"{where}: {key} is {value!r}; it must be a positive number or null")
        fields[field] = None if value is None else float(value)
    return {**fields, "embed_scale": dim ** 0.5, "sandwich_norm": True, "mlp_act": "gelu_tanh"}


def _moe(raw: dict, model_type: str, where: str) -> dict:
    """The mixture-of-experts fields of Mixtral's and Qwen3-MoE's config.json."""
    qwen = model_type == "qwen3_moe"
    if qwen and (raw.get("decoder_sparse_step", 1) != 1 or raw.get("mlp_only_layers")):
        raise UnsupportedHFConfig(f"{where}: decoder_sparse_step {raw.get('decoder_sparse_step')} / mlp_only_layers "
                                  f"{raw.get('mlp_only_layers')} is not supported; llmsplit's MoE models have experts "
                                  f"in every layer (1 and [])")
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, as Mixtral's.
    keys = {"n_experts": "num_experts" if qwen and "num_experts" in raw else "num_local_experts",
            "experts_per_token": "num_experts_per_tok",
            "moe_ffn_dim": "moe_intermediate_size" if qwen else "intermediate_size"}
    out = {}
    for field, key in keys.items():
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedHFConfig(f"{where}: {key} is {value!r}; it must be a positive int")
        out[field] = value
    return {**out, "router_renorm": bool(raw.get("norm_topk_prob", False)) if qwen else True}


def _local_rope(raw: dict, where: str) -> tuple[dict, float]:
    """Gemma 3's two rotary bases: config.json with only the global layers' rope left in it
    (parsed as any family's), and the sliding layers' base."""
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict) and "full_attention" in rope:
        local = rope.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default":
            raise UnsupportedHFConfig(f"{where}: rope_parameters.sliding_attention {local!r} is not supported; "
                                      f"llmsplit rotates Gemma 3's sliding layers with rope_type 'default'")
        theta, raw = local.get("rope_theta", 10000.0), {**raw, "rope_parameters": rope["full_attention"]}
    else:
        theta = raw.get("rope_local_base_freq", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise UnsupportedHFConfig(f"{where}: the sliding layers' rope_theta is {theta!r}; it must be a positive number")
    return raw, float(theta)


def _sliding(raw: dict, n_layers: int, where: str) -> dict:
    """sliding_window and sliding_pattern from config.json's sliding_window and layer_types."""
    window, types = raw.get("sliding_window"), raw.get("layer_types")
    if window is None:
        return {}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedHFConfig(f"{where}: sliding_window is {window!r}; it must be a positive integer or null")
    if types is None:
        return {"sliding_window": window}  # every layer (Mistral, Phi-3)
    if not isinstance(types, list) or len(types) != n_layers or \
            not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedHFConfig(f"{where}: layer_types must list 'sliding_attention' or 'full_attention' for "
                                  f"each of the {n_layers} layers")
    full = [t == "full_attention" for t in types]
    if all(full):
        return {}
    for period in (0, *range(2, n_layers + 1)):
        if full == [bool(period) and (i + 1) % period == 0 for i in range(n_layers)]:
            return {"sliding_window": window, "sliding_pattern": period}
    raise UnsupportedHFConfig(f"{where}: layer_types {types} is not supported; llmsplit's global layers come at a "
                              f"fixed period (every Nth layer, the rest sliding)")


def _sizes(raw: dict, where: str) -> dict:
    """LlamaConfig's size fields from the key table, each checked for its kind."""
    missing = [key for key, _, _, default in _KEYS if default is _REQUIRED and raw.get(key) is None]
    if missing:
        raise UnsupportedHFConfig(f"{where} lacks {', '.join(missing)}; a Llama-family config.json names "
                                  f"{', '.join(k for k, _, _, d in _KEYS if d is _REQUIRED)}")
    sizes = {}
    for key, field, kind, default in _KEYS:
        value = raw.get(key)
        if value is None:
            sizes[field] = default
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        else:  # a positive number; an integer where a count is meant
            ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool) \
                and value > 0
        if not ok:
            raise UnsupportedHFConfig(f"{where}: {key} is {value!r}; it must be "
                                      f"{'true or false' if kind is bool else f'a positive {kind.__name__}'}")
        sizes[field] = kind(value)
    return sizes


def _rope_scaling(rope: dict, rope_key: str, raw: dict, where: str) -> str | None:
    """`LlamaConfig.rope_scaling` (JSON text) from config.json's rope_parameters / rope_scaling."""
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedHFConfig(f"{where}: partial_rotary_factor {partial} is not supported; "
                                  f"the Llama family rotates whole heads (1.0)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise UnsupportedHFConfig(f"{where}: {rope_key}: rope scaling {rope_type!r} is not supported; "
                                  f"llmsplit computes rope_type {', '.join(map(repr, _ROPE_KEYS))} and 'default'")
    params = dict(rope)
    # As transformers does: the pretraining length defaults to max_position_embeddings, which is
    # also what "dynamic" always scales from (kept explicitly because inference resizes max_seq_len).
    max_pos = raw.get("max_position_embeddings", 2048)
    params.setdefault("original_max_position_embeddings", max_pos)
    if rope_type == "dynamic":
        params["original_max_position_embeddings"] = max_pos
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in params]
    if missing:
        raise UnsupportedHFConfig(f"{where}: {rope_key}: {rope_type} rope scaling lacks {', '.join(missing)}; "
                                  f"add {'it' if len(missing) == 1 else 'them'}")
    keep = {k: float(params[k]) for k in _ROPE_KEYS[rope_type]}
    if rope_type != "linear":
        keep["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return json.dumps({"rope_type": rope_type, **keep}, sort_keys=True)


def eos_ids_from_hf(raw: dict) -> set[int]:
    eos = raw.get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def config_to_hf(cfg: LlamaConfig, bos_id: int | None, eos_id: int | None, dtype) -> dict:
    """The config.json that makes transformers build `cfg` (`dtype`: a torch dtype or its name)."""
    family = cfg.family or (("qwen3_moe" if cfg.qk_norm else "mixtral") if cfg.n_experts else
                            "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else
                            "mistral" if cfg.sliding_window else "llama")
    raw = {
        "architectures": [SUPPORTED[family]],
        "model_type": family,
        **{key: getattr(cfg, field) for key, field, _, _ in _KEYS},
        "rope_theta": cfg.rope_theta,
        **({"rope_scaling": _rope_scaling_to_hf(cfg.rope_scaling)} if cfg.rope_scaling else {}),
        **({"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar),
            "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.logit_softcap}
           if family in GEMMA else {"hidden_act": "silu"}),
        **({"rope_local_base_freq": cfg.rope_local_theta} if cfg.rope_local_theta is not None else {}),
        **_moe_to_hf(cfg, family),
        **({"sliding_window": cfg.sliding_window, "layer_types": [
            "sliding_attention" if cfg.sliding(i) else "full_attention" for i in range(cfg.n_layers)]}
           if cfg.sliding_window else {}),
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,  # Phi3Config's default (32000) lies outside most vocabularies
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    # What the family's config.json cannot say (q/k norms with biases, Gemma's caps on a Llama)
    # would come back different: refused by name rather than exported as another model.
    back = config_from_hf(json.loads(json.dumps(raw)), "the exported config.json")
    same = {"rope_scaling": lambda a, b: rope_params(a) == rope_params(b),
            "family": lambda a, b: b is None or a == b}  # None: export chose the family
    changed = next((f for f in cfg.to_dict() if not same.get(f, lambda a, b: a == b)(getattr(back, f), getattr(cfg, f))),
                   None)
    if changed is not None:
        raise UnsupportedHFConfig(f"model.{changed} = {getattr(cfg, changed)!r} has no config.json form for "
                                  f"model_type {family!r} (it would load as {getattr(back, changed)!r}); export "
                                  f"writes the families transformers builds")
    return raw


def _moe_to_hf(cfg: LlamaConfig, family: str) -> dict:
    if family == "mixtral":
        return {"num_local_experts": cfg.n_experts, "num_experts_per_tok": cfg.experts_per_token}
    if family == "qwen3_moe":
        return {"num_experts": cfg.n_experts, "num_local_experts": cfg.n_experts,
                "num_experts_per_tok": cfg.experts_per_token,
                "moe_intermediate_size": cfg.moe_ffn_dim, "norm_topk_prob": cfg.router_renorm,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {}


def _int_if_whole(x: float | None):
    return int(x) if x is not None and float(x).is_integer() else x  # Gemma2Config checks for an int


def _rope_scaling_to_hf(scaling: str) -> dict:
    params = dict(rope_params(scaling))
    if params["rope_type"] not in _ROPE_KEYS:
        raise UnsupportedHFConfig(f"model.rope_scaling {params['rope_type']!r} (llama.cpp's rope_freqs) has no "
                                  f"config.json form; transformers computes {', '.join(map(repr, _ROPE_KEYS))}")
    if params["rope_type"] == "dynamic":
        params.pop("original_max_position_embeddings")  # transformers scales from max_position_embeddings
    return params
