"""Hugging Face Llama-family folders in: `config.json` → `LlamaConfig` (through
`models/hf_config.py`, the parser every entry point shares), `*.safetensors`
(one file or sharded with an index) → our parameter names, `tokenizer.json` → tokenizer.

Training and inference share this one reader. `read(name, shard=...)` returns only the
requested slice of a tensor through `safe_open(...).get_slice`, so a rank of a sharded or
tensor-parallel layout never materializes the whole model. Our rotary embedding uses the
Hugging Face "rotate half" layout, so q/k weights need no permutation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.hf_config import UnsupportedHFConfig, eos_ids_from_hf, read_hf_config
from ..models.hf_names import expert_part, from_hf_name, fused_parts, norm_offset, to_hf_name, weight_files
from ..models.llama import LlamaConfig
from ..models.weight_shapes import parameter_shapes

__all__ = ["HFWeights", "expected_names", "from_hf_name", "to_hf_name"]  # the names live in models/hf_names.py


class HFWeights:
    """A Hugging Face folder read tensor by tensor (or slice by slice) under our names."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.path = Path(folder)
        try:  # config.json, checked against the safetensors headers
            self.config, raw = read_hf_config(self.path)
            files = weight_files(self.path)
        except UnsupportedHFConfig as e:
            raise ConfigError(str(e)) from None
        if not files:
            raise ConfigError(f"{str(self.path)!r} holds no *.safetensors weights; llmsplit reads the safetensors "
                              f"format that transformers' save_pretrained writes")
        self.eos_ids = eos_ids_from_hf(raw) | _generation_eos_ids(self.path)
        self.dtype = _DTYPES.get(raw.get("dtype") or raw.get("torch_dtype"), torch.float32)
        self._files = {}  # file name -> open safe_open handle (memory-mapped, opened once)
        # our name -> (file, HF name, first row, rows): a part of a fused tensor is a block of its rows
        self._where: dict[str, tuple[str, str, int, int | None]] = {}
        self._experts: dict[str, dict[int, tuple[str, str]]] = {}  # our stacked name -> expert -> (file, HF name)
        for fname in files:
            try:
                handle = safe_open(str(self.path / fname), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a damaged header
                raise ConfigError(f"{str(self.path / fname)!r} is not a readable safetensors file ({e})") from None
            self._files[fname] = handle
            for hf_name in handle.keys():
                expert = expert_part(self.config, hf_name)
                if expert is not None:  # one expert's tensor of the stack our model holds
                    self._experts.setdefault(expert[0], {})[expert[1]] = (fname, hf_name)
                    continue
                parts = fused_parts(self.config, hf_name)
                for ours, row, rows in parts or []:
                    self._where[ours] = (fname, hf_name, row, rows)
                ours = from_hf_name(hf_name, self.config) if parts is None else None
                if ours is not None:
                    self._where[ours] = (fname, hf_name, 0, None)
        self.tokenizer = _folder_tokenizer(self.path)

    def names(self) -> list[str]:
        return expected_names(self.config)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._experts:
            fname, hf_name = self._experts[name][0]
            return (len(self._experts[name]), *self._files[fname].get_slice(hf_name).get_shape())
        fname, hf_name, _, rows = self._where[self._resolve(name)]
        shape = tuple(self._files[fname].get_slice(hf_name).get_shape())
        return shape if rows is None else (rows, *shape[1:])

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor `name` (our naming), or with shard=(dim, index, parts) only that
        contiguous part along `dim`, read from the memory-mapped file without the rest."""
        shape = self.shape(name)
        if shard is None:
            return self.read_region(name, (0,) * len(shape), shape)
        dim, index, parts = shard
        assert shape[dim] % parts == 0, (name, shape[dim], parts)
        step = shape[dim] // parts
        offsets = [0] * len(shape)
        offsets[dim] = index * step
        return self.read_region(name, tuple(offsets), tuple(step if d == dim else n for d, n in enumerate(shape)))

    def read_region(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block [offsets, offsets + sizes) of tensor `name`, read without the rest (how
        a rank of a sharded training layout loads only its shard)."""
        if name in self._experts:  # experts offsets[0].. of the stack, each read as its own block
            experts = self._experts[name]
            return torch.stack([self._files[experts[e][0]].get_slice(experts[e][1])[
                tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))]
                for e in range(offsets[0], offsets[0] + sizes[0])])
        fname, hf_name, row, _ = self._where[self._resolve(name)]
        sl = self._files[fname].get_slice(hf_name)
        offsets = (offsets[0] + row, *offsets[1:]) if offsets else offsets
        block = sl[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        offset = norm_offset(self.config, name)
        return block.float() + offset if offset else block

    def _resolve(self, name: str) -> str:
        if name == "output.weight" and name not in self._where:
            return "tok_embeddings.weight"  # tied: the head is the embedding
        return name


def expected_names(cfg: LlamaConfig) -> list[str]:
    """Every parameter name of our model for `cfg` (tied heads included once, as output.weight)."""
    return [name for name, _ in parameter_shapes(cfg)]


def _folder_tokenizer(folder: Path):
    from .tokenizer import load_tokenizer

    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{str(folder)!r} has no tokenizer.json; save the tokenizer next to the weights "
                          f"(tokenizer.save_pretrained)")
    return load_tokenizer(str(folder / "tokenizer.json"), key="tokenizer")  # with its config and chat template


def _generation_eos_ids(folder: Path) -> set[int]:
    """generation_config.json's eos_token_id, where instruct models list their end-of-turn
    ids (Llama 3.1 Instruct names three); generation stops at any of them."""
    try:
        raw = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return set()
    return {i for i in eos_ids_from_hf(raw) if isinstance(i, int)} if isinstance(raw, dict) else set()


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
