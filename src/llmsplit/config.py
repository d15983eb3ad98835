"""The run configuration: one dataclass per TOML section, `--set` overrides, and
`validate()`, which refuses every mistake a user can make before any worker starts.

Every error is a `ConfigError` whose message is one sentence naming the key, the value
and what is allowed; the command line turns it into exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A mistake in the user's configuration or command line (exit status 2)."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    hf: str | None = None
    gguf: str | None = None
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int | None = None
    rope_theta: float | None = None
    norm_eps: float | None = None
    tie_embeddings: bool | None = None
    qkv_bias: bool | None = None
    rope_scaling: str | None = None  # JSON, as models.llama.rope_params reads it (set from model.hf)


@dataclass
class DataSection:
    source: str = "builtin"
    seq_len: int = 256
    tokenizer: str = "byte"


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
    compile: bool = False
    timeout_s: float = 600.0  # how long a collective (or a node joining the job) may wait for the others
    profile_steps: int = 0  # `--profile N`: torch.profiler traces of N steps under RUN_DIR/profile/
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "train.lr_schedule": ("cosine", "linear", "constant"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "parallel.pp_schedule": ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"),
    "memory.activation_checkpoint": ("none", "selective", "full"),
    "memory.offload": ("none", "cpu", "nvme"),
}

# Keys whose features later releases deliver; refusing them here is more honest than
# silently training something else.
NOT_YET = {
    "model.gguf": (None, "loading GGUF files is not available in this version; remove model.gguf"),
}


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
    if par.tp < 1 or par.pp < 1:
        bad = "parallel.tp" if par.tp < 1 else "parallel.pp"
        raise ConfigError(f"{bad}={getattr(par, bad.split('.')[1])} must be at least 1")
    if par.dp == -1:
        if world_size % (par.tp * par.pp):
            raise ConfigError(f"world size {world_size} is not divisible by parallel.tp × parallel.pp = "
                              f"{par.tp * par.pp}; change --nproc or the tp/pp degrees")
        par.dp = world_size // (par.tp * par.pp)
    elif par.dp < 1:
        raise ConfigError(f"parallel.dp={par.dp} must be -1 (what is left) or at least 1")
    if par.dp * par.tp * par.pp != world_size:
        raise ConfigError(f"parallel.dp × tp × pp = {par.dp}×{par.tp}×{par.pp} = {par.dp * par.tp * par.pp} "
                          f"but the world size is {world_size}; set parallel.dp=-1 or --nproc "
                          f"{par.dp * par.tp * par.pp}")
    if par.sequence_parallel is None:
        par.sequence_parallel = par.tp > 1


def validate(cfg: Config, world_size: int, model_cfg=None, tokenizer_vocab: int | None = None) -> None:
    """Refuse what cannot run, before any worker starts. Fills in derived values."""
    t, d, par, mem, ck = cfg.train, cfg.data, cfg.parallel, cfg.memory, cfg.checkpoint
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(map(repr, allowed))}")
    _at_least(cfg, "train.steps", 1)
    _at_least(cfg, "train.global_batch", 1)
    _at_least(cfg, "train.micro_batch", 1)
    _at_least(cfg, "train.warmup_steps", 0)
    _at_least(cfg, "train.weight_decay", 0)
    _at_least(cfg, "train.grad_clip", 0)
    _at_least(cfg, "train.log_every", 1)
    _at_least(cfg, "train.seed", 0)
    _at_least(cfg, "data.seq_len", 2)
    _at_least(cfg, "checkpoint.every", 0)
    _at_least(cfg, "checkpoint.keep", 1)
    _at_least(cfg, "train.profile_steps", 0)
    if mem.limit_bytes is not None:
        _at_least(cfg, "memory.limit_bytes", 1)
    _at_least(cfg, "parallel.dp_replicate", 1)
    _at_least(cfg, "parallel.pp_virtual_stages", 1)
    if not t.lr > 0:
        raise ConfigError(f"train.lr={t.lr} must be greater than 0")
    if not t.timeout_s > 0:
        raise ConfigError(f"train.timeout_s={t.timeout_s} must be greater than 0 (seconds)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be between 0 and 1")
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={par.zero} is not one of: 0, 1, 2, 3")
    resolve_world(cfg, world_size)
    if par.dp % par.dp_replicate:
        raise ConfigError(f"parallel.dp={par.dp} is not divisible by parallel.dp_replicate={par.dp_replicate}")
    if par.dp_replicate > 1 and par.zero < 2:
        raise ConfigError(f"parallel.dp_replicate={par.dp_replicate} (hybrid sharding) needs parallel.zero=2 or 3")
    if t.global_batch % (par.dp * t.micro_batch):
        raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by parallel.dp × train.micro_batch "
                          f"= {par.dp}×{t.micro_batch} = {par.dp * t.micro_batch}; change one of them")
    if par.pp > 1:
        _check_pipeline(cfg)
    if mem.offload == "cpu" and par.zero < 2:
        raise ConfigError(f"memory.offload=\"cpu\" offloads sharded state and needs parallel.zero=2 or 3, "
                          f"not {par.zero}")
    if mem.offload == "nvme":
        _check_offload_dir(mem.offload_dir)
    _check_precision_supported(t.precision)
    for key, (allowed, why) in NOT_YET.items():
        if _get(cfg, key) != allowed:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {why}")
    if model_cfg is not None:
        if model_cfg.n_heads % par.tp:
            raise ConfigError(f"model.n_heads={model_cfg.n_heads} is not divisible by parallel.tp={par.tp}; use "
                              f"parallel.tp in {_divisor_list(model_cfg.n_heads)}")
        if model_cfg.dim % model_cfg.n_heads:
            raise ConfigError(f"model.dim={model_cfg.dim} is not divisible by model.n_heads={model_cfg.n_heads}")
        if model_cfg.n_heads % model_cfg.n_kv_heads:
            raise ConfigError(f"model.n_heads={model_cfg.n_heads} is not divisible by "
                              f"model.n_kv_heads={model_cfg.n_kv_heads}")
        if model_cfg.head_dim % 2:
            raise ConfigError(f"model.dim / model.n_heads = {model_cfg.head_dim} must be even for rotary embeddings")
        n_stages = par.pp * pipeline_stages_per_rank(par.pp_schedule, par.pp_virtual_stages) if par.pp > 1 else 1
        if model_cfg.n_layers < n_stages:
            raise ConfigError(f"model.n_layers={model_cfg.n_layers} is fewer than the {n_stages} pipeline stages "
                              f"(parallel.pp × stages per rank of {par.pp_schedule!r}); lower parallel.pp or "
                              f"parallel.pp_virtual_stages")
        if par.pp > 1 and model_cfg.tie_embeddings:
            raise ConfigError("model.tie_embeddings=true shares the embedding with the output head, which pipeline "
                              "parallel puts on different ranks; set parallel.pp=1 or model.tie_embeddings=false")
        kv = model_cfg.n_kv_heads
        if kv % par.tp and par.tp % kv:
            # Each rank needs whole kv heads: a share of them, or one replicated (tp a multiple).
            fits = [t for t in divisors(model_cfg.n_heads) if kv % t == 0 or t % kv == 0]
            raise ConfigError(f"model.n_kv_heads={kv} is neither divisible by nor a divisor of parallel.tp={par.tp}; "
                              f"use parallel.tp in {', '.join(map(str, fits))}")
        if model_cfg.ffn_dim % par.tp:
            raise ConfigError(f"model.ffn_dim={model_cfg.ffn_dim} is not divisible by parallel.tp={par.tp}; use "
                              f"parallel.tp in {_divisor_list(math.gcd(model_cfg.ffn_dim, model_cfg.n_heads))}")
        if model_cfg.vocab_size % par.tp:
            padded = -(-model_cfg.vocab_size // par.tp) * par.tp
            raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is not divisible by parallel.tp={par.tp}; "
                              f"set model.vocab_size={padded} (the extra rows are never used)")
        if d.seq_len > model_cfg.max_seq_len:
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; "
                              f"lower data.seq_len or raise model.max_seq_len")
        if tokenizer_vocab is not None and model_cfg.vocab_size < tokenizer_vocab:
            raise ConfigError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                              f"{tokenizer_vocab} tokens; raise model.vocab_size or remove it")
    del ck


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisor_list(n: int) -> str:
    return ", ".join(map(str, divisors(n)))


V_SCHEDULES = ("zbv", "dualpipev")
# Schedules that split a backward into an input-gradient and a later weight-gradient pass
# (both V schedules in torch 2.13).
SPLIT_BACKWARD_SCHEDULES = V_SCHEDULES


def pipeline_stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each pipeline rank holds: two in a V for zbv/dualpipev, pp_virtual_stages
    for interleaved_1f1b, one otherwise."""
    if schedule in V_SCHEDULES:
        return 2
    return virtual_stages if schedule == "interleaved_1f1b" else 1


def stage_ids_of_rank(schedule: str, pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Looped schedules give rank r stages r, r+p, r+2p…; V schedules give r and 2p−1−r."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(pipeline_stages_per_rank(schedule, virtual_stages))]


def _check_pipeline(cfg: Config) -> None:
    par, t = cfg.parallel, cfg.train
    if par.pp_virtual_stages > 1 and par.pp_schedule not in ("interleaved_1f1b", "zbv", "dualpipev"):
        raise ConfigError(f"parallel.pp_virtual_stages={par.pp_virtual_stages} needs "
                          f"parallel.pp_schedule=\"interleaved_1f1b\" (or 1)")
    if par.pp_schedule in ("zbv", "dualpipev") and par.pp_virtual_stages not in (1, 2):
        raise ConfigError(f"parallel.pp_schedule={par.pp_schedule!r} always puts 2 stages on each rank; "
                          f"set parallel.pp_virtual_stages=2 (or leave it at 1)")
    per_rank = t.global_batch // par.dp
    if par.pp_microbatches is not None:
        if par.pp_microbatches < 1 or per_rank % par.pp_microbatches:
            raise ConfigError(f"parallel.pp_microbatches={par.pp_microbatches} must divide the {per_rank} sequences "
                              f"of each data-parallel rank (train.global_batch / parallel.dp)")
        n_micro, source = par.pp_microbatches, f"parallel.pp_microbatches={par.pp_microbatches}"
    else:
        n_micro = per_rank // t.micro_batch
        source = f"train.global_batch / (parallel.dp × train.micro_batch) = {n_micro} micro-batches"
    if n_micro < par.pp:
        raise ConfigError(f"{source} is fewer than parallel.pp={par.pp}: the schedule needs at least one micro-batch "
                          f"per stage; raise train.global_batch or lower train.micro_batch")
    if par.pp_schedule == "dualpipev" and n_micro < 2 * par.pp:
        # torch's DualPipeV refuses, at the first step, fewer micro-batches than its 2·pp stages.
        raise ConfigError(f"{source} is fewer than the {2 * par.pp} stages of parallel.pp_schedule=\"dualpipev\" "
                          f"(2 per rank); raise train.global_batch or lower train.micro_batch")


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
    from .models.llama import LlamaConfig

    m = cfg.model
    if m.preset not in PRESETS:
        raise ConfigError(f"model.preset={m.preset!r} is not one of: {', '.join(map(repr, PRESETS))}")
    sizes = dict(PRESETS[m.preset])
    explicit = {f.name: getattr(m, f.name) for f in fields(m)
                if f.name not in ("preset", "hf", "gguf") and getattr(m, f.name) is not None}
    for key, value in explicit.items():
        if key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len") and value < 1:
            raise ConfigError(f"model.{key}={value} must be at least 1")
        if key in ("rope_theta", "norm_eps") and not value > 0:
            raise ConfigError(f"model.{key}={value} must be greater than 0")
        if key == "rope_scaling":
            from .models.llama import rope_params

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
    what was built (and rebuilds the same model when read back)."""
    for f in fields(cfg.model):
        if f.name not in ("preset", "hf", "gguf") and hasattr(model_cfg, f.name):
            setattr(cfg.model, f.name, getattr(model_cfg, f.name))
