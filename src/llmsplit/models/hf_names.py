"""Hugging Face tensor names <-> ours, and the shapes a folder's safetensors headers declare
(read from the headers alone, so the planner can check a folder without torch). One table for
every family; what a family lays out differently (Phi-3's fused q/k/v and gate/up) is a table of
its own beside it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from .llama import LlamaConfig
from .weight_shapes import Shape


class UnsupportedHFConfig(ValueError):
    """A config.json that llmsplit cannot represent; the message names the key and what is allowed."""


# Families whose files hold q/k/v as one tensor and gate/up as another (read split, written fused).
FUSED = ("phi3",)
# Families whose norms compute x·(1 + w): their files hold w, our RMSNorm weights hold 1 + w
# (readers add 1, writers take it off; llama.cpp's Gemma converter stores 1 + w the same way).
NORM_PLUS_ONE = ("gemma2", "gemma3_text")


def norm_offset(cfg: LlamaConfig, name: str) -> float:
    """What to add to the file's tensor `name` (ours) to get our weight (subtract when writing)."""
    return 1.0 if cfg.family in NORM_PLUS_ONE and name.endswith("norm.weight") else 0.0


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


# Families with norms after attention and after the MLP too (cfg.sandwich_norm, Gemma 2): their
# post_attention_layernorm is the norm after attention, pre_feedforward_layernorm the one before the MLP.
_SANDWICH_NAMES = [
    ("layers.{i}.post_attention_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
    ("layers.{i}.post_ffn_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
]


# Mixture-of-experts families: (ours, Hugging Face); {e} an expert, whose tensors we stack.
_MOE_NAMES = {
    "mixtral": [("layers.{i}.feed_forward.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
                *[(f"layers.{{i}}.feed_forward.{w}", f"model.layers.{{i}}.block_sparse_moe.experts.{{e}}.{w}.weight")
                  for w in ("w1", "w3", "w2")]],
    "qwen3_moe": [("layers.{i}.feed_forward.router.weight", "model.layers.{i}.mlp.gate.weight"),
                  *[(f"layers.{{i}}.feed_forward.{w}", f"model.layers.{{i}}.mlp.experts.{{e}}.{hf}.weight")
                    for w, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))]],
}
MOE_FAMILIES = tuple(_MOE_NAMES)


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\{e\}", r"(?P<e>\d+)").replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)") + "$")


_TO_HF = [(_compile(ours), hf) for ours, hf in _NAMES]
_TO_OURS = [(_compile(hf), ours) for ours, hf in _NAMES]
_MOE_TO_HF = {f: [(_compile(ours), hf) for ours, hf in names] for f, names in _MOE_NAMES.items()}
_MOE_TO_OURS = {f: [(_compile(hf), ours) for ours, hf in names] for f, names in _MOE_NAMES.items()}
_SANDWICH_TO_HF = [(_compile(ours), hf) for ours, hf in _SANDWICH_NAMES]
_SANDWICH_TO_OURS = [(_compile(hf), ours) for ours, hf in _SANDWICH_NAMES]


def _translate(name: str, table) -> str | None:
    for pattern, template in table:
        m = pattern.match(name)
        if m:  # an expert's {e} stays a placeholder where the match has none
            return template.format(**{"e": "{e}", **m.groupdict()})
    return None


def to_hf_name(name: str, cfg: LlamaConfig | None = None) -> str:
    """The Hugging Face name of our tensor `name`; for a family of FUSED, the fused tensor it is
    rows of (writers concatenate the parts in our parameter order)."""
    if cfg is not None and cfg.family in FUSED:
        for pattern, fused in _FUSED_TO_HF:
            m = pattern.match(name)
            if m:
                return fused.format(**m.groupdict())
    hf = _translate(name, _SANDWICH_TO_HF) if cfg is not None and cfg.sandwich_norm else None
    if cfg is not None and cfg.n_experts:
        hf = hf or _translate(name, _MOE_TO_HF[moe_family(cfg)])
    hf = hf or _translate(name, _TO_HF)
    assert hf is not None, f"no Hugging Face name for {name}"
    return hf


def moe_family(cfg: LlamaConfig) -> str:
    return cfg.family if cfg.family in MOE_FAMILIES else "qwen3_moe" if cfg.qk_norm else "mixtral"


def expert_names(cfg: LlamaConfig, name: str) -> list[str] | None:
    """For our stacked experts' tensor `name`, the Hugging Face name of each expert's; else None."""
    hf = to_hf_name(name, cfg) if cfg.n_experts and name.endswith(("feed_forward.w1", "feed_forward.w3",
                                                                   "feed_forward.w2")) else None
    return None if hf is None else [hf.replace("{e}", str(e)) for e in range(cfg.n_experts)]


def expert_part(cfg: LlamaConfig, hf_name: str) -> tuple[str, int] | None:
    """(our stacked tensor, expert index) for one expert's Hugging Face tensor; else None."""
    if not cfg.n_experts:
        return None
    for pattern, ours in _MOE_TO_OURS[moe_family(cfg)]:
        m = pattern.match(hf_name)
        if m and "e" in m.groupdict():
            return ours.format(i=m["i"]), int(m["e"])
    return None


# A FUSED family's tensors: (Hugging Face pattern, our tensors that are its rows, in order).
_FUSED_NAMES = [
    ("model.layers.{i}.self_attn.qkv_proj.weight",
     ("layers.{i}.attention.wq.weight", "layers.{i}.attention.wk.weight", "layers.{i}.attention.wv.weight")),
    ("model.layers.{i}.mlp.gate_up_proj.weight",
     ("layers.{i}.feed_forward.w1.weight", "layers.{i}.feed_forward.w3.weight")),
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


def from_hf_name(name: str, cfg: LlamaConfig | None = None) -> str | None:
    """Our name for a Hugging Face tensor name (of `cfg`'s family); None for tensors we do not
    use (e.g. precomputed rotary tables some checkpoints carry)."""
    ours = _translate(name, _SANDWICH_TO_OURS) if cfg is not None and cfg.sandwich_norm else None
    if cfg is not None and cfg.n_experts and expert_part(cfg, name) is None:
        ours = ours or _translate(name, _MOE_TO_OURS[moe_family(cfg)])
    return ours or _translate(name, _TO_OURS)


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
    of them, so the check names it. Experts' tensors are stacked as our model holds them."""
    shapes, experts = {}, {}
    for fname in files:
        for hf_name, shape in header_shapes(Path(folder) / fname).items():
            parts = fused_parts(cfg, hf_name)
            if parts is not None:
                whole = len(shape) == 2 and shape[0] == sum(n for _, _, n in parts)
                for ours, _, n in parts if whole else parts[:1]:
                    shapes[ours] = (n, shape[1]) if whole else tuple(shape)
                continue
            expert = expert_part(cfg, hf_name)
            if expert is not None:  # stacked: as many as the file has, each expert's shape
                experts.setdefault(expert[0], {})[expert[1]] = tuple(shape)
                continue
            ours = from_hf_name(hf_name, cfg)
            if ours is not None:
                shapes[ours] = shape
    for ours, found in experts.items():
        first = found[min(found)]
        shapes[ours] = (len(found), *first) if all(s == first for s in found.values()) else (len(found), -1)
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
