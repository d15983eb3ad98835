"""Hugging Face Llama-family folders in: `config.json` → `LlamaConfig`, `*.safetensors`
(one file or sharded with an index) → our parameter names, `tokenizer.json` → tokenizer.

Training and inference share this one reader. `read(name, shard=...)` returns only the
requested slice of a tensor through `safe_open(...).get_slice`, so a rank of a sharded or
tensor-parallel layout never materializes the whole model. Our rotary embedding uses the
Hugging Face "rotate half" layout, so q/k weights need no permutation.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import ConfigError
from ..models.llama import LlamaConfig

SUPPORTED = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

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


def to_hf_name(name: str) -> str:
    hf = _translate(name, _TO_HF)
    assert hf is not None, f"no Hugging Face name for {name}"
    return hf


def from_hf_name(name: str) -> str | None:
    """Our name for a Hugging Face tensor name; None for tensors we do not use
    (e.g. precomputed rotary tables some checkpoints carry)."""
    return _translate(name, _TO_OURS)


def config_from_hf(raw: dict, where: str = "config.json") -> LlamaConfig:
    """Our model config from a parsed Hugging Face `config.json`; unsupported variants are
    refused by name rather than loaded with silently different maths."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or [SUPPORTED.get(model_type, model_type)]
    if model_type not in SUPPORTED or archs[0] not in SUPPORTED.values():
        raise ConfigError(f"{where}: architecture {archs[0]!r} (model_type {model_type!r}) is not supported; "
                          f"llmsplit loads {', '.join(sorted(SUPPORTED.values()))}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    scaling = _rope_scaling(rope, raw, where)
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; the Llama family uses silu")
    if raw.get("mlp_bias") or (model_type != "qwen2" and raw.get("attention_bias")):
        raise ConfigError(f"{where}: biases on the MLP or attention output are not supported")
    try:
        n_heads = raw["num_attention_heads"]
        cfg = LlamaConfig(
            dim=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=n_heads,
            n_kv_heads=raw.get("num_key_value_heads") or n_heads, vocab_size=raw["vocab_size"],
            ffn_dim=raw["intermediate_size"], max_seq_len=raw.get("max_position_embeddings", 2048),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2", rope_scaling=scaling)
    except KeyError as e:
        raise ConfigError(f"{where} lacks the key {e.args[0]!r} that a Llama-family config has") from None
    if raw.get("head_dim") not in (None, cfg.head_dim):
        raise ConfigError(f"{where}: head_dim {raw['head_dim']} differs from hidden_size / num_attention_heads "
                          f"= {cfg.head_dim}, which llmsplit's model assumes")
    return cfg


# Rotary scaling types transformers' Llama computes, and the keys each one reads.
_ROPE_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def _rope_scaling(rope: dict, raw: dict, where: str) -> str | None:
    """`LlamaConfig.rope_scaling` (JSON text) from config.json's rope_scaling / rope_parameters."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise ConfigError(f"{where}: rope scaling {rope_type!r} is not supported; llmsplit computes "
                          f"{', '.join(_ROPE_KEYS)} and plain rotary embeddings")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor is not supported; the Llama family rotates whole heads")
    params = dict(rope)
    # As transformers does: the pretraining length defaults to max_position_embeddings, which is
    # also what "dynamic" scales from (kept here because inference resizes max_seq_len).
    params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    missing = [k for k in _ROPE_KEYS[rope_type] if k not in params]
    if missing:
        raise ConfigError(f"{where}: {rope_type} rope scaling lacks {', '.join(missing)}")
    if rope_type == "dynamic":
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings", 2048)
    keep = {k: float(params[k]) for k in _ROPE_KEYS[rope_type]}
    keep["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if rope_type == "linear":
        del keep["original_max_position_embeddings"]
    return json.dumps({"rope_type": rope_type, **keep}, sort_keys=True)


def eos_ids_from_hf(raw: dict) -> set[int]:
    eos = raw.get("eos_token_id")
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


class HFWeights:
    """A Hugging Face folder read tensor by tensor (or slice by slice) under our names."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.path = Path(folder)
        cfg_file = self.path / "config.json"
        try:
            raw = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(cfg_file)!r} is not a readable JSON config ({e})") from None
        self.config = config_from_hf(raw, str(cfg_file))
        self.eos_ids = eos_ids_from_hf(raw)
        self.dtype = _DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"), torch.float32)
        self._files = {}  # file name -> open safe_open handle (memory-mapped, opened once)
        self._where: dict[str, tuple[str, str]] = {}  # our name -> (file, HF name)
        for fname in self._weight_files():
            try:
                handle = safe_open(str(self.path / fname), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a damaged header
                raise ConfigError(f"{str(self.path / fname)!r} is not a readable safetensors file ({e})") from None
            self._files[fname] = handle
            for hf_name in handle.keys():
                ours = from_hf_name(hf_name)
                if ours is not None:
                    self._where[ours] = (fname, hf_name)
        missing = [n for n in expected_names(self.config) if n not in self._where
                   and not (n == "output.weight" and self.config.tie_embeddings)]
        if missing:
            raise ConfigError(f"{str(self.path)!r} lacks the weight {to_hf_name(missing[0])!r} "
                              f"({len(missing)} missing); the safetensors files do not match config.json")
        self.tokenizer = _folder_tokenizer(self.path)

    def _weight_files(self) -> list[str]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                return sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{str(index)!r} is not a safetensors index ({e})") from None
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{str(self.path)!r} holds no *.safetensors weights; llmsplit reads the safetensors "
                              f"format that transformers' save_pretrained writes")
        return files

    def names(self) -> list[str]:
        return expected_names(self.config)

    def shape(self, name: str) -> tuple[int, ...]:
        fname, hf_name = self._where[self._resolve(name)]
        return tuple(self._files[fname].get_slice(hf_name).get_shape())

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor `name` (our naming), or with shard=(dim, index, parts) only that
        contiguous part along `dim`, read from the memory-mapped file without the rest."""
        fname, hf_name = self._where[self._resolve(name)]
        sl = self._files[fname].get_slice(hf_name)
        if shard is None:
            return sl[:]
        dim, index, parts = shard
        size = sl.get_shape()[dim]
        assert size % parts == 0, (name, size, parts)
        step = size // parts
        key = [slice(None)] * len(sl.get_shape())
        key[dim] = slice(index * step, (index + 1) * step)
        return sl[tuple(key)]

    def read_region(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block [offsets, offsets + sizes) of tensor `name`, read without the rest (how
        a rank of a sharded training layout loads only its shard)."""
        fname, hf_name = self._where[self._resolve(name)]
        sl = self._files[fname].get_slice(hf_name)
        return sl[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]

    def _resolve(self, name: str) -> str:
        if name == "output.weight" and name not in self._where:
            return "tok_embeddings.weight"  # tied: the head is the embedding
        return name


def expected_names(cfg: LlamaConfig) -> list[str]:
    """Every parameter name of our model for `cfg` (tied heads included once, as output.weight)."""
    names = ["tok_embeddings.weight"]
    for i in range(cfg.n_layers):
        names += [f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"]
        for w in ("wq", "wk", "wv"):
            names.append(f"layers.{i}.attention.{w}.weight")
            if cfg.qkv_bias:
                names.append(f"layers.{i}.attention.{w}.bias")
        names.append(f"layers.{i}.attention.wo.weight")
        names += [f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w3", "w2")]
    return names + ["norm.weight", "output.weight"]


def _folder_tokenizer(folder: Path):
    from .tokenizer import load_tokenizer, read_chat_template

    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{str(folder)!r} has no tokenizer.json; save the tokenizer next to the weights "
                          f"(tokenizer.save_pretrained)")
    tok = load_tokenizer(str(folder / "tokenizer.json"), key="tokenizer")
    tok.chat_template = read_chat_template(folder)
    return tok


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
