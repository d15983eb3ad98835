"""The run configuration: one dataclass per TOML section, `--set` overrides, and
`validate()`, which refuses every mistake a user can make before any worker starts.

Every error is a `ConfigError` whose message is one sentence naming the key, the value
and what is allowed; the command line turns it into exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .config_data import DataSection, check_data
from .config_lora import LoraSection, check_lora
from .errors import ConfigError  # re-exported: callers import it from here too
from .layout import PRECISIONS, SPLIT_BACKWARD_SCHEDULES, Layout, Workload, check, resolve_dp
from .models.llama import LlamaConfig

# [model]: where the model comes from, then every field of the model's config (LlamaConfig),
# each unset (None) unless a file or --set names it: explicit sizes override the preset, and a
# run's config.toml records them all, so every model feature round-trips without a list here.
ModelSection = dataclasses.make_dataclass("ModelSection", [
    ("preset", "str", field(default="tiny")), ("hf", "str | None", field(default=None)),
    ("gguf", "str | None", field(default=None)),
    *[(f.name, f"{f.type.split('|')[0].strip()} | None", field(default=None)) for f in fields(LlamaConfig)]])


@dataclass
class TrainSection:
    steps: int = 120
    global_batch: int = 16
    micro_batch: int = 8
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    lr_schedule: str = "cosine"
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "fp32"
    seed: int = 0
    deterministic: bool = False
    log_every: int = 1
    eval_every: int = 0  # steps between evaluations on the held-out data (0 = never)
    compile: bool = False
    moe_aux_loss: float = 0.0  # times the MoE layers' load-balancing loss, added to the loss (Mixtral: 0.02)
    moe_bias_rate: float = 0.0  # loss-free balancing's step on model.router_bias per step (DeepSeek-V3: 0.001)
    timeout_s: float = 600.0  # how long a collective (or a node joining the job) may wait for the others
    profile_steps: int = 0  # `--profile N`: torch.profiler traces of N steps under RUN_DIR/profile/
    tensorboard: bool = False  # also write metrics.jsonl's records as TensorBoard events under RUN_DIR/tensorboard/
    # Set by `--auto` on a GPU or with memory.limit_bytes: try micro-batches from the planner's
    # before step 1 and train with the largest that fits (train/batch_trial.py).
    confirm_micro_batch: bool = False


@dataclass
class ParallelSection:
    dp: int = -1
    dp_replicate: int = 1
    zero: int = 0
    tp: int = 1
    sequence_parallel: bool | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int = 1
    ep: int = 1  # expert parallel: each MoE layer's experts split over ep data-parallel ranks


@dataclass
class MemorySection:
    activation_checkpoint: str = "none"
    offload: str = "none"
    offload_dir: str | None = None
    # Peak bytes a rank may use (CPU: the process's resident peak); above it the run stops
    # with the planner's explanation. Unset: the device's own memory is the limit.
    limit_bytes: int | None = None


@dataclass
class CheckpointSection:
    dir: str | None = None
    every: int = 0
    keep: int = 3


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)

    def __post_init__(self):
        self.explicit: set[str] = set()  # keys a file or --set named (defaults for fine-tuning fill the others)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The [parallel] and [memory] choices are layout.check's.
CHOICES = {"train.lr_schedule": ("cosine", "linear", "constant"), "train.precision": PRECISIONS}

# Keys whose features later releases deliver; refusing them here is more honest than
# silently training something else.
NOT_YET: dict = {}


# ---------------------------------------------------------------- loading and overrides

def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (optional) and apply `KEY=VALUE` overrides, checking names and types."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing .toml file to --config")
        try:
            raw = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML ({e}); fix the syntax") from None
    return config_from_dict(raw, overrides)


def config_from_toml(text: str) -> Config:
    return config_from_dict(tomllib.loads(text))


def config_from_dict(raw: dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    cfg = Config()
    for section, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"top-level key {section!r} in the config file must be a [section]; "
                              f"known sections: {', '.join(_sections())}")
        for key, value in values.items():
            set_key(cfg, f"{section}.{key}", value)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like KEY=VALUE, e.g. --set train.steps=10")
        key, text = item.split("=", 1)
        set_key(cfg, key.strip(), _parse_value(text.strip()))
    return cfg


def set_key(cfg: Config, dotted: str, value) -> None:
    section_name, _, key = dotted.partition(".")
    if section_name not in _sections() or not key:
        raise ConfigError(f"unknown config key {dotted!r}; keys look like SECTION.KEY with SECTION one of "
                          f"{', '.join(_sections())}")
    section = getattr(cfg, section_name)
    known = {f.name: f for f in fields(section)}
    if key not in known:
        raise ConfigError(f"unknown config key {dotted!r}; {section_name} has: {', '.join(known)}")
    setattr(section, key, _coerce(dotted, value, known[key].type))
    cfg.explicit.add(dotted)


def _sections() -> list[str]:
    return [f.name for f in fields(Config)]


def _parse_value(text: str):
    """A --set value is read as a TOML value when it is one, else as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _coerce(key: str, value, annotation):
    typ = _base_type(annotation)
    optional = annotation.endswith("| None")
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{key} cannot be empty")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if typ is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise AssertionError(f"unhandled type {annotation} for {key}")


def _base_type(annotation: str):
    # Field annotations are strings here (`from __future__ import annotations`): "int | None".
    name = annotation.split("|")[0].strip()
    return {"bool": bool, "int": int, "float": float, "str": str}[name]


# ---------------------------------------------------------------- validation

def resolve_world(cfg: Config, world_size: int) -> None:
    """Fill in `parallel.dp` (and sequence_parallel) from the world size, or refuse the layout."""
    par = cfg.parallel
    par.dp = resolve_dp(par.dp, par.tp, par.pp, world_size)
    if par.sequence_parallel is None:
        par.sequence_parallel = par.tp > 1


def layout_of(cfg: Config, world_size: int) -> Layout:
    """The layout a training config runs. Sequence parallel stays at its default (None) when
    the config has the default, so that a planner changing tp keeps the default."""
    par, mem = cfg.parallel, cfg.memory
    dp = par.dp if par.dp > 0 else resolve_dp(-1, par.tp, par.pp, world_size)
    sp = None if par.sequence_parallel in (None, par.tp > 1) else par.sequence_parallel
    return Layout(dp=dp, dp_replicate=par.dp_replicate, zero=par.zero, tp=par.tp, sequence_parallel=sp, pp=par.pp,
                  pp_schedule=par.pp_schedule, pp_virtual_stages=par.pp_virtual_stages,
                  pp_microbatches=par.pp_microbatches, micro_batch=cfg.train.micro_batch, ep=par.ep,
                  activation_checkpoint=mem.activation_checkpoint, offload=mem.offload)


def workload_of(cfg: Config) -> Workload:
    return Workload(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch, precision=cfg.train.precision,
                    lora_rank=cfg.lora.rank, lora_targets=cfg.lora.targets, lora_base=cfg.lora.base)


def validate(cfg: Config, world_size: int, model_cfg=None, tokenizer_vocab: int | None = None) -> None:
    """Refuse what cannot run, before any worker starts. Fills in derived values. The
    splitting rules are `layout.check`'s; this adds the keys that are not about splitting."""
    t, mem = cfg.train, cfg.memory
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(repr, allowed))}")
    for key, low in (("train.steps", 1), ("train.global_batch", 1), ("train.micro_batch", 1), ("train.warmup_steps", 0),
                     ("train.weight_decay", 0), ("train.grad_clip", 0), ("train.log_every", 1), ("train.seed", 0),
                     ("data.seq_len", 2), ("checkpoint.every", 0), ("checkpoint.keep", 1), ("train.profile_steps", 0),
                     ("parallel.dp_replicate", 1), ("parallel.pp_virtual_stages", 1), ("train.moe_aux_loss", 0)):
        _at_least(cfg, key, low)
    if mem.limit_bytes is not None:
        _at_least(cfg, "memory.limit_bytes", 1)
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be greater than 0")
    if not t.timeout_s > 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be greater than 0 (seconds)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    check_data(cfg.data, t.eval_every)
    if t.eval_every and cfg.parallel.pp > 1 and cfg.parallel.pp_schedule in SPLIT_BACKWARD_SCHEDULES:
        raise ConfigError(f"train.eval_every with parallel.pp_schedule={cfg.parallel.pp_schedule!r}: torch cannot run "
                          f"that schedule forward-only; evaluate with \"1f1b\", \"gpipe\" or \"interleaved_1f1b\"")
    check_lora(cfg.lora)
    resolve_world(cfg, world_size)
    check(model_cfg, layout_of(cfg, world_size), workload_of(cfg), world_size)
    if mem.offload == "nvme":
        _check_offload_dir(mem.offload_dir)
    _check_precision_supported(t.precision)
    for key, (allowed, why) in NOT_YET.items():
        if _get(cfg, key) != allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {why}")
    if model_cfg is not None and tokenizer_vocab is not None and model_cfg.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer_vocab} tokens; raise model.vocab_size or remove it")


def _check_offload_dir(path: str | None) -> None:
    if not path:
        raise ConfigError("memory.offload=\"nvme\" needs memory.offload_dir set to a writable folder")
    if not Path(path).is_dir():
        raise ConfigError(f"memory.offload_dir={path!r} is not an existing folder; create it or point it at one")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"memory.offload_dir={path!r} is not writable; choose a folder you can write to")


def _check_precision_supported(precision: str) -> None:
    """bf16/fp16 need a device that computes in them: the training device is the GPU when
    there is one, else the CPU."""
    if precision == "fp32":
        return
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if torch.cuda.is_available():
        ok = torch.cuda.is_bf16_supported() if precision == "bf16" else torch.cuda.get_device_capability() >= (5, 3)
    else:
        ok = _autocast_supports("cpu", dtype)
    if not ok:
        raise ConfigError(f"train.precision={precision!r} is not supported on this device; "
                          f"use train.precision=\"fp32\"")


def _autocast_supports(device_type: str, dtype) -> bool:
    # torch's own rule: autocast disables itself (with a warning) for a dtype the device lacks.
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device_type, dtype=dtype):
            return torch.is_autocast_enabled(device_type)


def _get(cfg: Config, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _at_least(cfg: Config, dotted: str, low) -> None:
    value = _get(cfg, dotted)
    if value < low:
        raise ConfigError(f"{dotted}={value} must be at least {low}")


# ---------------------------------------------------------------- writing

def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (keys that are unset are left out)."""
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


# ---------------------------------------------------------------- model sizes

def model_config(cfg: Config, tokenizer_vocab: int | None = None):
    """The model's sizes: the preset, with every explicitly set size on top.

    Without an explicit `model.vocab_size` the embedding grows to cover the tokenizer
    (rounded up to a multiple of 8, which tensor parallel splits evenly).
    """
    from .models.presets import PRESETS

    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset={m.preset!r} is not one of: {', '.join(map(repr, PRESETS))}")
    sizes = dict(PRESETS[m.preset])
    explicit = {f.name: getattr(m, f.name) for f in fields(m)
                if f.name not in ("preset", "hf", "gguf") and getattr(m, f.name) is not None}
    for key, value in explicit.items():
        if key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len",
                   "head_dim") and value < 1:
            raise ConfigError(f"model.{key}={value} must be at least 1")
        if key in ("rope_theta", "norm_eps") and not value > 0:
            raise ConfigError(f"model.{key}={value} must be greater than 0")
        if key == "rope_scaling":
            from .models.rope import rope_params

            try:
                rope_params(value)
            except ValueError as e:
                raise ConfigError(f"model.rope_scaling: {e}") from None
    if "n_heads" in explicit and "n_kv_heads" not in explicit:
        sizes["n_kv_heads"] = explicit["n_heads"]
    sizes.update(explicit)
    if tokenizer_vocab is not None and "vocab_size" not in explicit:
        sizes["vocab_size"] = max(sizes["vocab_size"], -(-tokenizer_vocab // 8) * 8)
    return LlamaConfig(**sizes)


def record_model_sizes(cfg: Config, model_cfg) -> None:
    """Write the resolved sizes into the config, so the run's config.toml says exactly
    what was built (and rebuilds the same model when read back). A head_dim that is just
    dim // n_heads stays derived, so a copy of the file edited to other dim or n_heads
    builds heads of the new size, not the old one's."""
    for f in fields(cfg.model):
        if f.name not in ("preset", "hf", "gguf") and hasattr(model_cfg, f.name):
            setattr(cfg.model, f.name, getattr(model_cfg, f.name))
    if model_cfg.head_dim == model_cfg.dim // model_cfg.n_heads:
        cfg.model.head_dim = None
