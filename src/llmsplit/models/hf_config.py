"""Hugging Face `config.json` ↔ `LlamaConfig`: the one key table, read by every entry point
(`llmsplit plan --model FOLDER`, `train --set model.hf=FOLDER`, `generate --model FOLDER`)
and written by export; and the one tensor-name table, with which `read_hf_config` checks
config.json against the tensor shapes the folder's safetensors headers declare before
anything is built (read from the headers alone, so the planner can check without torch).

What llmsplit's decoder cannot compute (another architecture, a rope scaling kind it does
not implement, a head_dim that is not hidden_size / num_attention_heads, biases where it has
none) is refused by name rather than loaded with silently different maths. This module
imports nothing else of llmsplit, so it raises `UnsupportedHFConfig` (a ValueError); each
entry layer turns that into its own user error in one place.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .llama import LlamaConfig
from .rope import rope_params
from .weight_shapes import Shape, shape_mismatch, structure_problem


class UnsupportedHFConfig(ValueError):
    """A config.json that llmsplit cannot represent; the message names the key and what is allowed."""


SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
# Families whose files hold q/k/v as one tensor and gate/up as another (read split, written fused).
FUSED = ("phi3",)

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
    if raw.get("hidden_act", "silu") != "silu":
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
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = raw.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise UnsupportedHFConfig(f"{where}: {rope_key} is {rope!r}; it must be a JSON object with a rope_type key")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise UnsupportedHFConfig(f"{where}: rope_theta is {theta!r}; it must be a positive number")
    cfg = LlamaConfig(**sizes, rope_theta=float(theta), qkv_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                      rope_scaling=_rope_scaling(rope, rope_key, raw, where),
                      family=model_type if model_type in FUSED else None)
    problem = structure_problem(cfg, _HF_KEY.get)
    if problem:
        raise UnsupportedHFConfig(f"{where}: {problem}")
    return cfg


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
    family = cfg.family or ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama")
    if cfg.qk_norm and cfg.qkv_bias:
        raise UnsupportedHFConfig("model.qk_norm and model.qkv_bias together have no config.json form (Qwen3 has "
                                  "q/k norms and no biases, Qwen2 the reverse); set one of them false")
    return {
        "architectures": [SUPPORTED[family]],
        "model_type": family,
        **{key: getattr(cfg, field) for key, field, _, _ in _KEYS},
        "rope_theta": cfg.rope_theta,
        **({"rope_scaling": _rope_scaling_to_hf(cfg.rope_scaling)} if cfg.rope_scaling else {}),
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": None,  # Phi3Config's default (32000) lies outside most vocabularies
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _rope_scaling_to_hf(scaling: str) -> dict:
    params = dict(rope_params(scaling))
    if params["rope_type"] not in _ROPE_KEYS:
        raise UnsupportedHFConfig(f"model.rope_scaling {params['rope_type']!r} (llama.cpp's rope_freqs) has no "
                                  f"config.json form; transformers computes {', '.join(map(repr, _ROPE_KEYS))}")
    if params["rope_type"] == "dynamic":
        params.pop("original_max_position_embeddings")  # transformers scales from max_position_embeddings
    return params


# (our pattern, Hugging Face pattern); {i} is a layer index.
_NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attention.wq.{p}", "model.layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attention.wk.{p}", "model.layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attention.wv.{p}", "model.layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
]


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in _NAMES]
_TO_OURS = [(_compile(hf), ours) for ours, hf in _NAMES]


def _translate(name: str, table) -> str | None:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.format(**m.groupdict())
    return None


def to_hf_name(name: str, cfg: LlamaConfig | None = None) -> str:
    """The Hugging Face name of our tensor `name`; for a family of FUSED, the fused tensor it is
    rows of (writers concatenate the parts in our parameter order)."""
    if cfg is not None and cfg.family in FUSED:
        for pattern, fused in _FUSED_TO_HF:
            m = pattern.match(name)
            if m:
                return fused.format(**m.groupdict())
    hf = _translate(name, _TO_HF)
    assert hf is not None, f"no Hugging Face name for {name}"
    return hf


# A FUSED family's tensors: (Hugging Face pattern, our tensors that are its rows, in order).
_FUSED_NAMES = [
    ("model.layers.{i}.self_attn.qkv_proj.weight",
     ("layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight", "layers.{i}.attention.wv.weight")),
    ("model.layers.{i}.mlp.gate_up_proj.weight", ("layers.{i}.feed_forward.w1.weight", "layers.{i}.feed_forward.w3.weight")),
]
_FUSED_TO_HF = [(_compile(ours), hf) for hf, parts in _FUSED_NAMES for ours in parts]
_FUSED_TO_OURS = [(_compile(hf), parts) for hf, parts in _FUSED_NAMES]


def fused_parts(cfg: LlamaConfig, hf_name: str) -> list[tuple[str, int, int]] | None:
    """For a fused tensor of `cfg`'s family: (our name, first row, rows) of each part; else None."""
    if cfg.family not in FUSED:
        return None
    for pattern, parts in _FUSED_TO_OURS:
        m = pattern.match(hf_name)
        if m:
            q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            rows = (q, kv, kv) if len(parts) == 3 else (cfg.ffn_dim, cfg.ffn_dim)
            starts = [sum(rows[:j]) for j in range(len(rows))]
            return [(p.format(**m.groupdict()), start, n) for p, start, n in zip(parts, starts, rows)]
    return None


def from_hf_name(name: str) -> str | None:
    """Our name for a Hugging Face tensor name; None for tensors we do not use
    (e.g. precomputed rotary tables some checkpoints carry)."""
    return _translate(name, _TO_OURS)


INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def weight_files(folder: str | Path) -> list[str]:
    """The safetensors files of a folder, relative to it: those its index names, or every
    *.safetensors file; none for a folder that holds only config.json.

    The index is data from whoever made the folder: a name that leads out of it ("../x",
    "/etc/passwd") is refused. The check is on the name, not on where links point, because
    the Hugging Face cache's snapshot folders are links into ../../blobs by design."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if not index.is_file():
        return sorted(p.name for p in folder.glob("*.safetensors"))
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnsupportedHFConfig(f"{str(index)!r} is not a safetensors index ({type(e).__name__}: {e})") from None
    for name in names:
        norm = os.path.normpath(name) if isinstance(name, str) and name and "\0" not in name else os.pardir
        if os.path.isabs(norm) or norm in (os.curdir, os.pardir) or norm.startswith(os.pardir + os.sep):
            raise UnsupportedHFConfig(f"{str(index)!r} names the weight file {name!r}, which is not inside the "
                                      f"model folder; refusing to open it (an index names files in its own folder)")
    return sorted(names)


def weight_shapes(folder: str | Path, files: list[str], cfg: LlamaConfig) -> dict[str, Shape]:
    """Our name -> shape of every tensor llmsplit uses in `files`, from their headers alone. A
    fused tensor gives each part its rows; one whose rows do not add up gives its first part all
    of them, so the check names it."""
    shapes = {}
    for fname in files:
        for hf_name, shape in header_shapes(Path(folder) / fname).items():
            parts = fused_parts(cfg, hf_name)
            if parts is not None:
                whole = len(shape) == 2 and shape[0] == sum(n for _, _, n in parts)
                for ours, _, n in parts if whole else parts[:1]:
                    shapes[ours] = (n, shape[1]) if whole else tuple(shape)
                continue
            ours = from_hf_name(hf_name)
            if ours is not None:
                shapes[ours] = shape
    return shapes


def header_shapes(path: Path) -> dict[str, Shape]:
    """Tensor name -> shape from a safetensors file's header (8 bytes of length, then JSON),
    without reading any tensor data."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= min(_MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
                raise ValueError(f"its header length {size} does not fit the file")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (OSError, ValueError) as e:
        raise UnsupportedHFConfig(f"{str(path)!r} is not a readable safetensors file ({e})") from None
    shapes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        shape = info.get("shape") if isinstance(info, dict) else None
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise UnsupportedHFConfig(f"{str(path)!r}: tensor {name} has no valid shape in the safetensors header")
        shapes[name] = tuple(shape)
    return shapes
