"""What a layout is: the `[parallel]` and `[memory]` keys (plus the micro-batch) as one
frozen value, and the workload it runs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev")
CHECKPOINTING = ("none", "selective", "full")
OFFLOADS = ("none", "cpu", "nvme")
PRECISIONS = ("fp32", "bf16", "fp16")
MODES = ("train", "infer")
CP_MODES = ("ring", "alltoall")  # how attention crosses the sequence shards (parallel/context_parallel.py)

V_SCHEDULES = ("zbv", "dualpipev")
# Schedules that split a backward into an input-gradient and a later weight-gradient pass
# (both V schedules in torch 2.13).
SPLIT_BACKWARD_SCHEDULES = V_SCHEDULES


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    """Stages each pipeline rank holds: two in a V for zbv/dualpipev, pp_virtual_stages
    for interleaved_1f1b, one otherwise."""
    if schedule in V_SCHEDULES:
        return 2
    return virtual_stages if schedule == "interleaved_1f1b" else 1


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
    ep: int = 1  # expert parallel, inside the data-parallel ranks (not a factor of the world)
    cp: int = 1  # context parallel: each sequence split over cp ranks that read the same rows
    cp_mode: str = "ring"

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel and self.tp > 1)

    @property
    def shard(self) -> int:
        """Ranks that share one copy of the sharded state (ZeRO's N): the data-parallel ranks
        and, since they hold the same weights and reduce gradients together, the cp ranks."""
        ranks = self.dp * self.cp
        return ranks // self.dp_replicate if self.zero >= 2 else ranks

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert: the data-parallel ranks over which expert gradients average."""
        return self.dp // self.ep

    @property
    def chunks(self) -> int:
        """Model chunks (pipeline stages) per pipeline rank."""
        return stages_per_rank(self.pp_schedule, self.pp_virtual_stages) if self.pp > 1 else 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.chunks

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sequence_parallel"] = self.sp
        return d

    def settings(self) -> list[str]:
        """The layout as `key=value` settings a person reads and retypes: the split degrees,
        the pipeline schedule, expert and context parallel where used, micro-batch, recompute
        and offload."""
        keys = ["dp", "zero", "tp", "pp", *(["pp_schedule"] if self.pp > 1 else []),
                *(k for k in ("ep", "cp") if getattr(self, k) > 1), "micro_batch", "activation_checkpoint", "offload"]
        return [f"{k}={getattr(self, k)}" for k in keys]


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int          # train: sequences per optimizer step; infer: concurrent sequences
    precision: str = "bf16"
    mode: str = "train"
    lora_rank: int = 0  # train with LoRA adapters of this rank (0: every parameter trains)
    lora_targets: str = "q,k,v,o,gate,up,down"
    lora_base: str = "none"  # "nf4" | "int8": the frozen base stored 4-bit / 8-bit (QLoRA)
    # infer: "int8" | "int4" weights kept packed (llmsplit.quant), as loaded: a GGUF file's own
    # int4 blocks count as "int4" (their groups are cut alike: rules.packed_split_problem).
    quantize: str = "none"
    compile: bool = False  # infer: decode steps run compiled (--compile); train: train.compile
    # train: the sequences each sample of the batch is (a DPO pair: chosen and rejected, 2);
    # global_batch and micro_batch count samples, activations and tokens count sequences.
    rows_per_sample: int = 1
    # train, GRPO: the completions a step generates (each rank's engine makes its share at once),
    # the tokens each may hold, and whether a frozen reference copy is kept (plan/rollout.py).
    rollout_rows: int = 0
    rollout_context: int = 0
    rollout_reference: bool = False
    # train, distillation: the parameters of the frozen teacher each rank holds (plan/rollout.py).
    teacher_params: int = 0

    @property
    def compute_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


def microbatches(layout: Layout, work: Workload) -> int:
    """Micro-batches each data-parallel rank runs per step (pipeline micro-batches when pp > 1)."""
    return layout.pp_microbatches or work.global_batch // (layout.dp * layout.micro_batch)
