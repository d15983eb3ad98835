"""One entry point for every model format llmsplit reads: a training run folder (or one of
its checkpoints), a Hugging Face folder, or a GGUF file.

Each reader offers the same small interface, so inference (and training's `model.hf`)
never cares where weights come from:
  config: LlamaConfig, tokenizer, eos_ids: set[int], dtype (as stored),
  names() -> our parameter names, read(name, shard=(dim, index, parts) | None) -> Tensor.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..config import model_config
from ..errors import ConfigError
from ..models.weight_shapes import parameter_shapes, shape_mismatch
from .run_dir import CONFIG_FILE, is_complete_checkpoint, read_run_config, resolve_checkpoint, run_tokenizer


def open_weights(path: str | Path, what: str = "--model"):
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {str(path)!r} does not exist; pass a run folder, a checkpoint, a Hugging Face "
                          f"folder or a .gguf file")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConfigError(f"{what} {str(path)!r} is a file but not a GGUF model; pass a .gguf file or a model folder")
        from .gguf import GGUFWeights

        return GGUFWeights(path)
    from .peft_adapter import is_peft_folder

    if is_peft_folder(path) and not (path / "config.json").is_file():
        from .peft_adapter import peft_base, read_peft

        base = open_weights(peft_base(path, f"{what} {str(path)!r}"), what=f"{what} {str(path)!r}'s base model")
        return AdaptedWeights(base, *read_peft(path, base.config, f"{what} {str(path)!r}"))
    if (path / "config.json").is_file():
        from .hf import HFWeights

        return HFWeights(path)
    if (path / CONFIG_FILE).is_file() or is_complete_checkpoint(path):
        return RunWeights(path)
    raise ConfigError(f"{what} {str(path)!r} is not a model: it holds neither config.json (Hugging Face), "
                      f"{CONFIG_FILE} (an llmsplit run) nor a complete checkpoint")


def pretrained_weights(cfg):
    """The reader of the weights training starts from: model.hf (a Hugging Face folder) or
    model.gguf (a GGUF file, its blocks dequantized as read); None: from the seed."""
    if cfg.model.hf and cfg.model.gguf:
        raise ConfigError("model.hf and model.gguf are both set; keep the one the weights come from")
    if cfg.model.hf:
        return open_weights(cfg.model.hf, "model.hf")
    if cfg.model.gguf:
        if not Path(cfg.model.gguf).is_file():
            raise ConfigError(f"model.gguf={cfg.model.gguf!r} is not a file; pass a .gguf model file")
        return open_weights(cfg.model.gguf, "model.gguf")
    return None


class RunWeights:
    """The newest complete checkpoint of a training run (or a given checkpoint), read once
    into CPU memory: distributed checkpoints are written per rank, and training models are
    small enough to gather whole here."""

    def __init__(self, path: str | Path):
        from . import dcp_files

        run_dir, ck = resolve_checkpoint(path)
        cfg = read_run_config(run_dir)
        self.tokenizer, self.eos_ids = run_tokenizer(run_dir, cfg)  # the run's own copy: it works from anywhere
        self.config = model_config(cfg, self.tokenizer.vocab_size)
        self.dtype = torch.float32
        # The sizes of config.toml against the shapes the checkpoint's metadata records, before
        # any tensor is allocated (a config.toml saying 10⁹ layers is refused, not built).
        saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(ck))
        if cfg.lora.rank:
            self._state = lora_merged(cfg, self.config, ck, saved)
            return
        problem = shape_mismatch(self.config, saved, layers_key="model.n_layers")
        if problem:
            raise ConfigError(f"{str(run_dir / CONFIG_FILE)!r} does not match checkpoint {str(ck)!r}: {problem}; "
                              f"the [model] settings must be the ones the run was trained with")
        state = {"model": {name: torch.empty(shape) for name, shape in parameter_shapes(self.config) if name in saved}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_files.load(state, ck)  # never unpickles code from the checkpoint
        self._state = state["model"]

    def names(self) -> list[str]:
        from .hf import expected_names

        return expected_names(self.config)

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        t = self._state[name if name in self._state else "tok_embeddings.weight"]  # a tied head saved once
        if shard is not None:
            dim, index, parts = shard
            t = t.chunk(parts, dim)[index]
        return t.contiguous()


def lora_merged(cfg, model_cfg, ck: Path, saved: dict) -> dict[str, torch.Tensor]:
    """A LoRA run's model: the frozen base it trained on (model.hf or model.gguf, or the seed's initial
    weights) with each adapter merged in (`AdaptedWeights`). Its checkpoints hold the adapters only."""
    source = pretrained_weights(cfg)
    if source is None:
        from ..models.llama import Transformer

        model = Transformer(model_cfg)
        model.init_weights(cfg.train.seed)  # what training started from: weights from (seed, name)
        source = _StateWeights({name: t.detach() for name, t in model.state_dict().items()})
    merged = AdaptedWeights(source, read_adapters(cfg, ck, saved), cfg.lora.alpha / cfg.lora.rank)
    return {name: merged.read(name).float() for name in source.names()}


class _StateWeights:
    """A state dict as a weights reader (a LoRA run's base drawn from its seed)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self._state = state

    def names(self) -> list[str]:
        return list(self._state)

    def read(self, name: str, shard=None) -> torch.Tensor:
        return self._state[name]


class AdaptedWeights:
    """A base model's reader with LoRA adapters merged in as each weight is read, W + scale ·
    B·A (the product the adapted layer computes): a LoRA run, or a PEFT adapter folder as the
    model. Adapted weights are read whole, merged in float32, then sliced; the others (and
    their packed forms) come from the base as they are."""

    def __init__(self, base, adapters: dict[str, torch.Tensor], scale: float):
        self.base, self.adapters, self.scale = base, adapters, scale
        self.config = getattr(base, "config", None)
        self.tokenizer, self.eos_ids = getattr(base, "tokenizer", None), getattr(base, "eos_ids", set())
        self.dtype = getattr(base, "dtype", torch.float32)

    def names(self) -> list[str]:
        return self.base.names()

    def _adapted(self, name: str) -> bool:
        return name.endswith(".weight") and f"{name[:-len('.weight')]}.lora_a" in self.adapters

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        if not self._adapted(name):
            return self.base.read(name, shard)
        layer = name[:-len(".weight")]
        a, b = self.adapters[f"{layer}.lora_a"], self.adapters[f"{layer}.lora_b"]
        w = self.base.read(name).float() + self.scale * b @ a
        return w if shard is None else w.chunk(shard[2], shard[0])[shard[1]].contiguous()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.base.shape(name)) if hasattr(self.base, "shape") else tuple(self.read(name).shape)

    def read_region(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        if hasattr(self.base, "read_region") and not self._adapted(name):
            return self.base.read_region(name, offsets, sizes)
        w = self.read(name)
        for dim, (start, size) in enumerate(zip(offsets, sizes)):
            w = w.narrow(dim, start, size)
        return w.contiguous()

    def packed_kind(self, name: str) -> str | None:
        return None if self._adapted(name) or not hasattr(self.base, "packed_kind") else self.base.packed_kind(name)

    def read_packed(self, name: str, shard: tuple[int, int, int] | None = None):
        if self._adapted(name) or not hasattr(self.base, "read_packed"):
            return None
        return self.base.read_packed(name, shard)


def read_weight(source, name: str, shard: tuple[int, int, int] | None = None, quantize: str | None = None):
    """`source.read`, with weights kept packed where asked: `quantize` None keeps a GGUF's own
    packed types (and widens the rest), "none" widens everything, "int8" / "int4" keeps a
    GGUF's packed types and quantizes every other matmul weight as it is read, one tensor at
    a time (the float copy of the whole model never exists)."""
    from .. import quant

    if quantize != "none" and hasattr(source, "read_packed"):
        packed = source.read_packed(name, shard)
        if packed is not None:
            return packed
    w = source.read(name, shard)
    if quantize in ("int8", "int4") and quant.is_matmul_weight(name) and w.dim() == 2:
        try:
            return quant.quantize(w, quant.kind_for(name, quantize))
        except ValueError as e:
            raise ConfigError(f"--quantize {quantize}: {name} {tuple(w.shape)}: {e}; use --quantize int8") from None
    return w


def run_adapters(path: str | Path, what: str, model_cfg) -> tuple[dict[str, torch.Tensor], float]:
    """The adapters of a LoRA run (its newest checkpoint, or the checkpoint given) or of a PEFT
    adapter folder, and their scale alpha / rank, checked against `model_cfg`, the served base:
    what `serve --lora NAME=RUN` applies over it."""
    from . import dcp_files
    from .peft_adapter import check_fit, is_peft_folder, read_peft

    if is_peft_folder(path):
        return read_peft(path, model_cfg, what)
    try:
        run_dir, ck = resolve_checkpoint(path)
        cfg = read_run_config(run_dir)
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    if not cfg.lora.rank:
        raise ConfigError(f"{what}: {str(path)!r} is a run without LoRA adapters (lora.rank = 0); serve it as --model")
    saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(ck))
    adapters = read_adapters(cfg, ck, saved)
    check_fit(adapters, model_cfg, cfg.lora.rank, what)
    return adapters, cfg.lora.alpha / cfg.lora.rank


def read_adapters(cfg, ck: Path, saved: dict) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a LoRA run's checkpoint (name -> tensor, whole, on the CPU)."""
    from . import dcp_files

    if not saved or not all(name.endswith((".lora_a", ".lora_b")) for name in saved):
        raise ConfigError(f"checkpoint {str(ck)!r} does not hold the LoRA adapters its run's config.toml "
                          f"(lora.rank={cfg.lora.rank}) says it trained; pass the run's own checkpoint")
    adapters = {"model": {name: torch.empty(shape) for name, shape in saved.items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_files.load(adapters, ck)
    return adapters["model"]


def packed_unit_bytes(source, quantize: str | None) -> dict[str, int]:
    """{unit: bytes} a load with `quantize` holds for each unit with packed weights, the
    others float32 (what placement budgets instead of float bytes for those units)."""
    from .. import quant
    from ..models.weight_shapes import parameter_shapes

    if quantize == "none":
        return {}
    out: dict[str, int] = {}
    packed_units = set()
    for name, shape in parameter_shapes(source.config):
        unit = name.split(".")[0] if not name.startswith("layers.") else ".".join(name.split(".")[:2])
        kind = source.packed_kind(name) if hasattr(source, "packed_kind") else None
        if kind is None and quantize in ("int8", "int4") and quant.is_matmul_weight(name) and len(shape) == 2:
            kind = quant.kind_for(name, quantize)
        if kind is not None:
            packed_units.add(unit)
        nbytes = quant.packed_nbytes(shape, kind, native=quant.kernels.native_int4_available()) if kind else None
        out[unit] = out.get(unit, 0) + (nbytes or 4 * _numel(shape))
    return {u: b for u, b in out.items() if u in packed_units}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
