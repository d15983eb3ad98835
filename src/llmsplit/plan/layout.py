"""What the planner is asked about: a layout (how the devices split the work) and a
workload (what is run on them), with the divisibility rules `llmsplit train` enforces."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..config import CHOICES, V_SCHEDULES, ConfigError, stage_ids_of_rank
from ..models.llama import LlamaConfig
from ..models.stages import split_layers

SCHEDULES = CHOICES["parallel.pp_schedule"]
CHECKPOINTING = CHOICES["memory.activation_checkpoint"]
OFFLOADS = CHOICES["memory.offload"]
PRECISIONS = CHOICES["train.precision"]


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    dp_replicate: int = 1
    zero: int = 0
    tp: int = 1
    sequence_parallel: bool | None = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    pp_microbatches: int | None = None
    micro_batch: int = 1
    activation_checkpoint: str = "none"
    offload: str = "none"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel and self.tp > 1)

    @property
    def shard(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO's N)."""
        return self.dp // self.dp_replicate if self.zero >= 2 else self.dp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank."""
        return 2 if self.pp_schedule in V_SCHEDULES else self.pp_virtual_stages

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sequence_parallel"] = self.sp
        return d


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int          # train: sequences per optimizer step; infer: concurrent sequences
    precision: str = "bf16"
    mode: str = "train"

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def microbatches(layout: Layout, work: Workload) -> int:
    """Micro-batches each data-parallel rank runs per step (pipeline micro-batches when pp > 1)."""
    return layout.pp_microbatches or work.global_batch // (layout.dp * layout.micro_batch)


def check_layout(cfg: LlamaConfig, layout: Layout, work: Workload, world: int | None = None) -> None:
    """Refuse a layout that does not divide the model, the batch or the world, naming the key."""
    for key in ("dp", "dp_replicate", "tp", "pp", "pp_virtual_stages", "micro_batch"):
        if getattr(layout, key) < 1:
            raise ConfigError(f"layout {key}={getattr(layout, key)} must be at least 1")
    if layout.zero not in (0, 1, 2, 3):
        raise ConfigError(f"layout zero={layout.zero} is not one of: 0, 1, 2, 3")
    for key, allowed in (("pp_schedule", SCHEDULES), ("activation_checkpoint", CHECKPOINTING),
                         ("offload", OFFLOADS)):
        if getattr(layout, key) not in allowed:
            raise ConfigError(f"layout {key}={getattr(layout, key)!r} is not one of: {', '.join(map(repr, allowed))}")
    if world is not None and layout.world != world:
        raise ConfigError(f"layout dp × tp × pp = {layout.dp}×{layout.tp}×{layout.pp} = {layout.world} "
                          f"but --gpus is {world}; change dp (or leave it out)")
    # Training replicates kv heads when tp is a multiple of them; inference does not.
    kv_replicated = work.mode == "train" and layout.tp % cfg.n_kv_heads == 0
    if cfg.n_heads % layout.tp or (cfg.n_kv_heads % layout.tp and not kv_replicated):
        also = " (in training, a multiple of the key/value heads also works)" if work.mode == "train" else ""
        raise ConfigError(f"layout tp={layout.tp} does not divide the model's {cfg.n_heads} attention heads "
                          f"and {cfg.n_kv_heads} key/value heads; use a tp that divides both{also}")
    if cfg.vocab_size % layout.tp:
        raise ConfigError(f"layout tp={layout.tp} does not divide the vocabulary of {cfg.vocab_size}")
    if cfg.n_layers < layout.pp * layout.chunks:
        raise ConfigError(f"layout pp={layout.pp} with {layout.chunks} chunk(s) per stage needs at least "
                          f"{layout.pp * layout.chunks} layers but the model has {cfg.n_layers}; lower pp")
    if layout.dp % layout.dp_replicate:
        raise ConfigError(f"layout dp={layout.dp} is not divisible by dp_replicate={layout.dp_replicate}")
    if layout.dp_replicate > 1 and layout.zero < 2:
        raise ConfigError(f"layout dp_replicate={layout.dp_replicate} (hybrid sharding) needs zero=2 or 3")
    if layout.offload == "cpu" and layout.zero < 2:
        raise ConfigError("layout offload='cpu' moves FSDP's sharded state to the host and needs zero=2 or 3")
    if work.mode == "train":
        if work.global_batch % (layout.dp * layout.micro_batch):
            raise ConfigError(f"global batch {work.global_batch} is not divisible by dp × micro_batch = "
                              f"{layout.dp}×{layout.micro_batch}; change --global-batch or the layout")
    if work.seq_len % layout.tp and layout.sp:
        raise ConfigError(f"sequence length {work.seq_len} is not divisible by tp={layout.tp} "
                          f"(sequence parallel splits it)")


LAYOUT_KEYS = {f.name for f in fields(Layout)}


def parse_layout(text: str, base: Layout | None = None) -> Layout:
    """`zero=3,tp=2,pp=1` (the [parallel]/[memory] keys, plus micro_batch) → Layout."""
    values = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in item:
            raise ConfigError(f"--layout item {item!r} must look like KEY=VALUE, e.g. --layout zero=3,tp=2")
        key, raw = (s.strip() for s in item.split("=", 1))
        key = key.split(".")[-1]  # accept parallel.tp as well as tp
        if key not in LAYOUT_KEYS:
            raise ConfigError(f"--layout key {key!r} is not one of: {', '.join(sorted(LAYOUT_KEYS))}")
        values[key] = _value(key, raw)
    return replace(base or Layout(), **values)


def _value(key: str, raw: str):
    if key in ("pp_schedule", "activation_checkpoint", "offload"):
        return raw.strip('"\'')
    if key == "sequence_parallel":
        if raw.lower() not in ("true", "false"):
            raise ConfigError(f"--layout sequence_parallel={raw!r} must be true or false")
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"--layout {key}={raw!r} must be an integer") from None


def rank_layers(cfg: LlamaConfig, layout: Layout) -> tuple[int, ...]:
    """Decoder layers each pipeline rank holds, cut exactly as parallel/pipeline.py cuts them
    (balanced by cost, so not always n_layers / pp)."""
    if layout.pp == 1:
        return (cfg.n_layers,)
    # The search asks for the same split once per stage and per layout; the cut is a
    # dynamic programme over layers × stages, so remember it.
    key = (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.vocab_size,
           layout.pp, layout.pp_schedule, layout.chunks)
    if key not in _RANK_LAYERS:
        per_stage = split_layers(cfg, layout.pp * layout.chunks)
        _RANK_LAYERS[key] = tuple(
            sum(len(per_stage[s]) for s in stage_ids_of_rank(layout.pp_schedule, r, layout.pp, layout.chunks))
            for r in range(layout.pp))
    return _RANK_LAYERS[key]


_RANK_LAYERS: dict[tuple, tuple[int, ...]] = {}
