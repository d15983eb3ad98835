"""The run configuration's sections: one dataclass per TOML section ([data] and [lora] live in
data.py and lora.py with their checks), and `Config`, which holds them all."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from ..models.llama import LlamaConfig
from .data import DataSection
from .lora import LoraSection
from .objective import DpoSection, GrpoSection

# [model]: where the model comes from, then every field of the model's config (LlamaConfig),
# each unset (None) unless a file or --set names it: explicit sizes override the preset, and a
# run's config.toml records them all, so every model feature round-trips without a list here.
ModelSection = dataclasses.make_dataclass("ModelSection", [
    ("preset", "str", field(default="tiny")), ("hf", "str | None", field(default=None)),
    ("gguf", "str | None", field(default=None)),
    *[(f.name, f"{f.type.split('|')[0].strip()} | None", field(default=None)) for f in fields(LlamaConfig)]])


# The values of the train keys a user leaves unset in a run that loads trained weights (model.hf
# or model.gguf), instead of TrainSection's from-scratch ones; why these numbers:
# train/finetune.py, which applies them. With [lora] on (lora.rank > 0) the lr is LORA_LR.
FINETUNE_DEFAULTS = {"train.lr": 2e-5, "train.warmup_steps": 0, "train.weight_decay": 0.0}
LORA_LR = 2e-4


@dataclass
class TrainSection:
    objective: str = "sft"  # "sft": next-token loss; "dpo": preference pairs; "grpo": rewards (config/objective.py)
    # A model to distil from (train/distill.py): the loss is KL to its next-token distribution, mixed
    # with the next-token loss by distill_weight, over its and the student's temperature-softened logits.
    teacher: str | None = None
    distill_weight: float = 1.0
    distill_temperature: float = 1.0
    teacher_params: int = 0  # set at launch from train.teacher's weights (the planner counts them)
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
    cp: int = 1  # context parallel: each sequence split over cp ranks (parallel/context_parallel.py)
    cp_mode: str = "ring"  # | "alltoall"


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
    # `checkpoint.async` in a file or --set (a Python keyword, so the field has another name):
    # write with DCP's async save while training goes on (train/checkpoint.py).
    async_save: bool = False
    every_seconds: float = 0.0  # also save when this long has passed since the last save (0: off)


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    memory: MemorySection = field(default_factory=MemorySection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    lora: LoraSection = field(default_factory=LoraSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)

    def __post_init__(self):
        self.explicit: set[str] = set()  # keys a file or --set named (defaults for fine-tuning fill the others)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
