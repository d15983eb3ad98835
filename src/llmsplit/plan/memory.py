"""Memory per device, term by term, for what llmsplit actually runs.

What the code does, and therefore what is counted:
- Parameters are fp32 whatever `train.precision` says. zero 0/1 (DDP) compute under
  autocast: bf16 copies of the weights are made per forward and saved for backward, and
  the residual stream and RMSNorm stay fp32. zero 2/3 (FSDP2 with a MixedPrecisionPolicy)
  keep fp32 shards and all-gather bf16 weights, so the whole block computes in bf16.
- AdamW keeps exp_avg and exp_avg_sq in fp32 (8 bytes per parameter), no master copy.
- DDP copies gradients into its own buckets (gradient_as_bucket_view is off), which is a
  second fp32 gradient-sized buffer.
- The trainer upcasts the logits to fp32 for the loss over the whole vocabulary.

The activation constants were derived term by term from the autograd graph of
`models.llama.TransformerBlock` (what each op saves for backward) and are checked against
saved-tensor hooks in tests/test_plan_memory.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..adapters.lora import TARGETS
from ..layout import INFER_EXPERT_DIMS, SPLIT_BACKWARD_SCHEDULES, rank_layer_shapes, stage_ids_of_rank
from ..models.llama import LlamaConfig
from .experts import dispatch_buffer_bytes, expert_params_per_rank
from .hardware import Device
from .rollout import rollout_engine_bytes, teacher_bytes
from ..layout import Layout, Workload, microbatches, rank_layer_counts
from .states import FP32, inference_weight_bytes, model_state_bytes, quantized_base_params, stored_bytes, zero_paper_bytes  # noqa: F401

NVME_GROUP_BYTES = 64 << 20  # NvmeAdamW's default group_bytes
# glibc's M_MMAP_THRESHOLD in llmsplit's CPU workers (launch.py fixes it at 4 MiB): smaller
# allocations come from the heap, which keeps what is freed.
CPU_MMAP_THRESHOLD = 4 << 20


@dataclass
class Breakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    comm_buffers: int
    overhead: int
    host: int = 0          # bytes this device keeps in host RAM (offload)
    stage: int = 0         # the pipeline stage this breakdown is for (the fullest one)
    detail: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.comm_buffers + self.overhead

    def to_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "comm_buffers": self.comm_buffers,
                "overhead": self.overhead, "total": self.total}


# ---------------------------------------------------------------- parameters

def layer_params(cfg: LlamaConfig, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer on one tensor-parallel (or expert-parallel) rank, split as
    training splits them (layout.tp_plan): ep keeps 1/ep of the routed experts, whole on every
    tp rank."""
    shapes = rank_layer_shapes(cfg, tp, experts_over_tp=False)
    rest = sum(math.prod(shape) for name, shape in shapes.items() if name not in INFER_EXPERT_DIMS)
    return rest + expert_params_per_rank(cfg, ep)


def stage_params(cfg: LlamaConfig, layout: Layout, stage: int) -> dict:
    """Parameter counts held by one rank of pipeline stage `stage` (vocab-parallel under tp).

    With V schedules rank 0 holds the first and the last chunk, so embedding and head.
    """
    t = layout.tp
    ids = stage_ids_of_rank(layout.pp_schedule, stage, layout.pp, layout.pp_virtual_stages)
    first, last = 0 in ids, layout.n_stages - 1 in ids
    table = cfg.vocab_size * cfg.dim // t
    # A tied head shares the embedding's tensor only when both live on the same rank.
    head = table if last and (not cfg.tie_embeddings or not first) else 0
    n_layers = rank_layer_counts(cfg, layout)[stage]
    return {"n_layers": n_layers, "layers": n_layers * layer_params(cfg, t, layout.ep), "embedding": table if first else 0,
            "head": head, "final_norm": cfg.dim if last else 0, "has_head": last}


def lora_layer_params(cfg: LlamaConfig, work: Workload, tp: int = 1) -> int:
    """LoRA parameters of one layer on one tp rank: A [r, in] and B [out, r] per target, split like
    the layer (adapters/lora.py): column-parallel B by rows, row-parallel A by columns, i.e. A's
    inputs and B's outputs are those of the target's weight on the rank (layout.tp_plan)."""
    if not work.lora_rank:
        return 0
    shapes = rank_layer_shapes(cfg, tp, experts_over_tp=False)
    names = (f"{TARGETS[t.strip()]}.weight" for t in work.lora_targets.split(",") if t.strip())
    # A MoE layer has no gate/up/down layers to adapt (training refuses them: train/api.check_moe_training).
    targets = [shapes[name] for name in names if name in shapes]
    return sum(work.lora_rank * (n_in + n_out) for n_out, n_in in targets)


# ---------------------------------------------------------------- activations

def compute_pattern(layout: Layout, work: Workload) -> str:
    if work.precision == "fp32":
        return "fp32"
    return "mixed_params" if layout.zero >= 2 else "autocast"


def layer_saved_tensors(cfg: LlamaConfig, s: int, layout: Layout, pattern: str, checkpoint: str = "none",
                        fused_attention: bool = True) -> list[tuple[int, float]]:
    """What one decoder layer saves for backward, as (how many tensors, bytes of one of them
    per token) pairs: a tensor of a micro-batch of b×s tokens has b·s times that many bytes.

    Term by term (per token; h dim, k = n_kv_heads·head_dim, f ffn_dim, a heads, c compute
    bytes, t tp; the norm part and rsqrt divide by t only with sequence parallel):
      2 RMSNorms      fp32/autocast: input x + x·rsqrt, both fp32: 2·8h; mixed params: 2·(4+c)h
      linear inputs   fp32: 4h (q/k/v) + 4h (w1/w3) shared; autocast casts the normed input
                      once per linear: 3ch + 2ch; mixed params: ch + ch
      q, k, v         c(h + 2k)/t          (after rope: SDPA's inputs)
      SDPA            out ch/t + logsumexp 4a/t (fused kernel; the math kernel instead
                      keeps the a·s probabilities and k, v repeated to all heads)
      SwiGLU          gate, silu(gate), up, product: 4cf/t (MoE: f of each token's k routed and
                      shared experts, `active_ffn_dim`; its gathered rows and outputs are not
                      counted: tiny-moe at dim 256, 4 layers, 2048 tokens: measured peak 0.98-0.99x predicted)
      rsqrt           2·4
    """
    h, a, f = cfg.dim, cfg.n_heads, cfg.active_ffn_dim()
    kv = cfg.n_kv_heads * cfg.head_dim
    c = 4 if pattern == "fp32" else 2
    t = layout.tp
    norm_t = t if layout.sp else 1  # the norm region is split over tp only with sequence parallel
    r = c if pattern == "mixed_params" else FP32  # residual stream dtype
    if checkpoint == "full":
        return [(1, r * h / norm_t)]
    if checkpoint == "selective":
        # parallel/memory.py keeps the matmul outputs (q, k, v, wo, w1, w3, w2) and the
        # block input; norms, rope, attention and SiLU are recomputed from them.
        return [(1, r * h / norm_t), (1, c * h / t), (2, c * kv / t), (2, c * f / t), (2, c * h / norm_t)]
    norms = {"fp32": [(4, 4 * h)], "autocast": [(4, 4 * h)], "mixed_params": [(2, 4 * h), (2, c * h)]}[pattern]
    linear_in = {"fp32": (2, 4 * h), "autocast": (5, c * h), "mixed_params": (2, c * h)}[pattern]
    if fused_attention:
        attention = [(1, c * h / t), (2, c * kv / t), (1, c * h / t), (1, 4 * a / t)]
    else:
        attention = [(3, c * h / t), (1, c * h / t), (1, c * a * s / t)]
    norm_region = [(n, row / norm_t) for n, row in (*norms, (2, 4))]
    return [*norm_region, linear_in, *attention, (4, c * f / t)]


def layer_activation_bytes(cfg: LlamaConfig, b: int, s: int, layout: Layout, pattern: str,
                           checkpoint: str = "none", fused_attention: bool = True) -> int:
    """Bytes one decoder layer saves for backward for one micro-batch of b×s tokens: the
    tensors of `layer_saved_tensors`, plus (without checkpointing) the rope tables cast to
    c (4·s·head_dim·c per micro-batch) when c ≠ 4."""
    per_token = sum(n * row for n, row in layer_saved_tensors(cfg, s, layout, pattern, checkpoint, fused_attention))
    c = 4 if pattern == "fp32" else 2
    rope_casts = 0 if c == 4 or checkpoint != "none" else 4 * s * cfg.head_dim * c
    return int(b * s * per_token + rope_casts)


def cpu_retained_heap_bytes(cfg: LlamaConfig, b: int, s: int, layout: Layout, pattern: str, layers: int,
                            fused_attention: bool = True) -> int:
    """What glibc's heap keeps resident beyond the live tensors on a CPU worker: one
    micro-batch's worth of the rank's saved activations, counting only the tensors smaller
    than the mmap threshold (bigger ones get their own mapping, returned to the OS when freed).

    Why one micro-batch: freed heap memory stays resident, and backward frees a micro-batch's
    activations while the gradients are allocated into the holes, so the next micro-batch's
    activations no longer fit there and the heap grows by about their size once; after that
    the same holes serve every step. Measured with mallinfo2 on 2 workers (dim 256-512,
    seq 256, zero 0/3, pp 2, micro-batches of 1-8): the free heap at the peak was 0.9-1.5x
    this term (the tiny default model 0.9x, the issue-16 cases 1.3-1.5x)."""
    tokens = b * s

    def heap_bytes(checkpoint: str) -> float:
        return sum(n * row * tokens for n, row in layer_saved_tensors(cfg, s, layout, pattern, checkpoint,
                                                                      fused_attention)
                   if row * tokens < CPU_MMAP_THRESHOLD)

    retained = layers * heap_bytes(layout.activation_checkpoint)
    if layout.activation_checkpoint != "none":
        retained += heap_bytes("none")  # the layer recomputed in backward churns the same heap
    return int(retained)


def backward_working_bytes(cfg: LlamaConfig, b: int, s: int, layout: Layout, pattern: str) -> int:
    """Gradients of activations alive while one layer runs backward: the residual
    gradient in and out plus the three ffn-sized intermediates."""
    c = 4 if pattern == "fp32" else 2
    r = c if pattern == "mixed_params" else FP32
    return int(b * s * (2 * r * cfg.dim + 3 * c * cfg.active_ffn_dim() / layout.tp))


def head_activation_bytes(cfg: LlamaConfig, b: int, s: int, layout: Layout, pattern: str) -> dict:
    """Final norm, and the loss over the vocabulary: the logits (compute dtype) are upcast to
    fp32; log_softmax keeps its fp32 output; its backward holds that, the incoming gradient
    and its own fp32 result at once, while the trainer still references the logits."""
    h = cfg.dim
    c = 4 if pattern == "fp32" else 2
    tokens = b * s
    vocab = cfg.vocab_size / layout.tp  # loss parallel keeps the vocabulary split
    norm = {"fp32": 12 * h, "autocast": 8 * h + c * h, "mixed_params": (4 + 2 * c) * h}[pattern]
    logits = tokens * vocab * c
    loss_peak = tokens * vocab * 3 * FP32
    return {"final_norm": int(tokens * norm), "logits": int(logits), "loss_peak": int(logits + loss_peak)}


def in_flight(layout: Layout, stage: int, m: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at once, in units of
    (one micro-batch × all layers of the rank)."""
    p, v = layout.pp, layout.chunks
    if p == 1:
        return 1
    sched = layout.pp_schedule
    if sched == "gpipe":
        return m
    if sched == "1f1b":
        return min(p - stage, m)
    if sched == "interleaved_1f1b":
        # Megatron's warm-up: (p - rank - 1)·2 + (v - 1)·p chunk-micro-batches, plus the one
        # in flight, each holding 1/v of the rank's layers.
        return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v) / v
    if sched == "zbv":
        return min(p, m)  # same peak as 1F1B's first stage (Qi et al. 2024)
    return min(p + 1, m)  # dualpipev: one more than 1F1B (DeepSeek-V3 report)


# ---------------------------------------------------------------- per device

def training_memory(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> Breakdown:
    """The fullest pipeline stage's memory on one device."""
    # The first stage holds the most micro-batches in flight, the last one the loss; with
    # an uneven split (balanced by cost) a middle stage may hold more layers: check each.
    stages = [_training_stage(cfg, layout, work, device, i) for i in range(layout.pp)]
    return max(stages, key=lambda bd: bd.total)


def _training_stage(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device, stage: int) -> Breakdown:
    sp_ = stage_params(cfg, layout, stage)
    adapters = sp_["n_layers"] * lora_layer_params(cfg, work, layout.tp)
    n_params = sp_["layers"] + sp_["embedding"] + sp_["head"] + sp_["final_norm"] + adapters
    pattern = compute_pattern(layout, work)
    c = work.compute_bytes
    # A micro-batch's sequences (a DPO pair is two); a cp rank holds its share of each.
    b, s = layout.micro_batch * work.rows_per_sample, work.seq_len // layout.cp
    m = microbatches(layout, work)
    layers = sp_["n_layers"]
    fused = device.kind == "cpu" or work.precision != "fp32"

    # Expert parallel's experts: split over ep, never sharded by ZeRO (parallel/apply.py).
    experts = sp_["n_layers"] * expert_params_per_rank(cfg, layout.ep) if layout.ep > 1 else 0
    quantized = quantized_base_params(cfg, work, sp_["n_layers"])
    states = model_state_bytes(n_params - experts, layout.zero, layout.shard, adapters if work.lora_rank else None,
                               quantized, work.lora_base)
    frozen = 0 if work.lora_rank else None  # LoRA freezes the experts with the rest of the base
    states = {k: v + model_state_bytes(experts, 0, 1, frozen)[k] for k, v in states.items()}
    host = 0
    if layout.offload == "cpu":
        # FSDP2's CPUOffloadPolicy: sharded params, grads and optimizer state live on the host.
        host = sum(states.values())
        states = {"params": 0, "grads": 0, "optimizer": 0}
    elif layout.offload == "nvme":
        # The moments live in a file; NvmeAdamW keeps at most one group resident.
        states["optimizer"] = 0

    engine = rollout_engine_bytes(cfg, layout, work, cfg.n_layers * lora_layer_params(cfg, work))  # GRPO: resident
    teacher = teacher_bytes(cfg, layout, work, sp_["has_head"])  # a distillation's: resident, and at the loss
    # Saved activations at the start of the last in-flight micro-batch's backward.
    per_layer = layer_activation_bytes(cfg, b, s, layout, pattern, layout.activation_checkpoint, fused)
    full_layer = layer_activation_bytes(cfg, b, s, layout, pattern, "none", fused)
    held = in_flight(layout, stage, m)
    saved = held * layers * per_layer
    recompute = full_layer if layout.activation_checkpoint != "none" else 0
    head = head_activation_bytes(cfg, b, s, layout, pattern) if sp_["has_head"] else \
        {"final_norm": 0, "logits": 0, "loss_peak": 0}
    saved += held * head["final_norm"]
    # Autocast keeps a bf16 copy of every matmul weight for backward (zero 0/1 only).
    head_matrix = cfg.vocab_size * cfg.dim // layout.tp if sp_["has_head"] else 0
    # A quantized base's weights are dequantized per use and never cast by autocast.
    matmul_params = sp_["layers"] - layers * 2 * cfg.dim + head_matrix - quantized
    autocast_weights = matmul_params * c if pattern == "autocast" else 0
    working = backward_working_bytes(cfg, b, s, layout, pattern)
    backward_peak = int(saved + autocast_weights + max(head["loss_peak"], recompute + working))
    grads_absent = states["grads"] if _grads_absent_at_peak(layout, m, device) else 0

    # Optimizer step: the fused AdamW the trainer uses (parallel/apply.py) updates each
    # tensor in place in one kernel, with no temporaries; NVMe offload's AdamW streams one
    # resident group; the logits are still referenced by the training loop.
    step_tmp = 0
    if layout.offload == "nvme":
        step_tmp += min(NVME_GROUP_BYTES, 2 * FP32 * n_params // (layout.shard if layout.zero >= 1 else 1))
    step_peak = step_tmp + head["logits"]
    activations = max(backward_peak - grads_absent, step_peak) + sum(engine.values()) + sum(teacher.values())

    comm = _comm_buffers(cfg, layout, work, sp_, c)
    tensors = sum(states.values()) + activations + comm["total"]
    heap = cpu_retained_heap_bytes(cfg, b, s, layout, pattern, layers, fused) if device.kind == "cpu" else 0
    compiled = device.compile_bytes if work.compile else 0  # measured where known (diagnose/probe.py)
    overhead = int(device.runtime_bytes + compiled + device.alloc_slack * tensors + heap)
    detail = {"n_params": n_params, "pattern": pattern, "in_flight_microbatches": held,
              "per_layer_activation": per_layer, "saved_activations": int(saved),
              "autocast_weight_copies": autocast_weights, "loss_peak": head["loss_peak"],
              "backward_peak": backward_peak, "optimizer_step_peak": step_peak,
              "grads_absent_at_peak": grads_absent, "cpu_retained_heap": heap, "comm": comm, "microbatches": m,
              "rollout_engine": engine, "teacher": teacher}
    return Breakdown(params=states["params"], grads=states["grads"], optimizer=states["optimizer"],
                     activations=int(activations), comm_buffers=comm["total"], overhead=overhead,
                     host=host, stage=stage, detail=detail)


def _grads_absent_at_peak(layout: Layout, m: int, device: Device) -> bool:
    """Are the (sharded) gradients still unallocated at the backward peak, the start of a
    step's last micro-batch's backward? Every step starts without them (the trainer frees
    them after the optimizer step). FSDP2 (zero 2/3) accumulates the micro-batches without
    sync in its unsharded gradients (comm_buffers) and makes the sharded ones only during the
    last backward; DDP makes them in the first backward, so only a step's only micro-batch
    starts without them, except in a CPU pipeline, which keeps them between steps (zeroed)."""
    if layout.zero >= 2:
        return True
    return m == 1 and not (layout.pp > 1 and device.kind == "cpu")


def _comm_buffers(cfg: LlamaConfig, layout: Layout, work: Workload, stage: dict, c: int) -> dict:
    out = {}
    adapters = stage["n_layers"] * lora_layer_params(cfg, work, layout.tp)
    n_params = stage["layers"] + stage["embedding"] + stage["head"] + stage["final_norm"] + adapters
    trained = adapters if work.lora_rank else n_params  # what has gradients
    if layout.dp * layout.cp > 1 and layout.zero <= 1:  # DDP reduces over dp × cp
        out["ddp_buckets"] = FP32 * trained  # all buckets, allocated once, 25 MB each
    if layout.zero >= 2:
        unit = layer_params(cfg, layout.tp, layout.ep)
        # The root unit is never resharded after forward; zero 2 keeps every block gathered
        # from forward to backward, zero 3 holds the current block and prefetches the next,
        # except under a schedule with split backward, where it keeps them as zero 2 does
        # (data_parallel.apply_fsdp).
        root = stage["embedding"] + stage["head"] + stage["final_norm"]  # what is not inside a block
        all_gathered = layout.zero == 2 or (layout.pp > 1 and layout.pp_schedule in SPLIT_BACKWARD_SCHEDULES)
        # FSDP2 gathers a quantized base as its quantized bytes (adapters/qlora.py).
        q_unit = quantized_base_params(cfg, work, 1)
        out["gathered_params"] = (stored_bytes(n_params, stage["n_layers"] * q_unit, work.lora_base, c) if all_gathered
                                  else c * root + 2 * stored_bytes(unit, q_unit, work.lora_base, c))
        # A block's unsharded gradient in compute dtype, and its fp32 copy for reduce-scatter.
        grad_unit = max(unit, root) if not work.lora_rank else lora_layer_params(cfg, work, layout.tp)
        out["unsharded_grads"] = (c + FP32) * grad_unit if c != FP32 else FP32 * grad_unit
        if microbatches(layout, work) > 1:
            # Without gradient sync (every micro-batch but the last) FSDP2 keeps each
            # block's unsharded gradient, upcast to the fp32 reduce dtype, until the last.
            out["accumulated_unsharded_grads"] = FP32 * trained
    tokens = layout.micro_batch * work.rows_per_sample * work.seq_len // layout.cp
    if layout.cp > 1:
        out["cp_attention"] = context_buffer_bytes(cfg, layout, tokens, c)
    if layout.tp > 1:
        out["tp_collectives"] = 2 * tokens * cfg.dim * c  # an all-gather output and its input
    if layout.pp > 1:
        out["pp_send_recv"] = 2 * tokens * cfg.dim * c // (layout.tp if layout.sp else 1)
    if layout.ep > 1:
        out["ep_dispatch"] = dispatch_buffer_bytes(cfg, layout, work)
    out["total"] = int(sum(out.values()))
    return out


def context_buffer_bytes(cfg: LlamaConfig, layout: Layout, tokens: int, c: int) -> int:
    """What context parallel's attention holds beside a layer's saved tensors, for a rank's
    `tokens` (parallel/context_parallel.py). Ring, in backward: the key/value block in use and
    the one arriving, and the fp32 key/value gradients being added to, sent and received, plus
    the fp32 query gradient. All-to-all: q, k, v and the output for the whole sequence and a
    cp-th of the heads (as many bytes as the rank's own), each beside its exchange buffer."""
    h, kv, t = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, layout.tp
    if layout.cp_mode == "alltoall":
        return int(2 * tokens * c * (2 * h + 2 * kv) / t)
    return int(tokens * (kv * 2 * (2 * c + 3 * FP32) + FP32 * h) / t)


def inference_memory(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> Breakdown:
    """Weights in the compute dtype (or packed, `work.quantize`) + KV cache for `global_batch` sequences of `seq_len`
    tokens + the prefill workspace (one layer's intermediates and the prompt's logits)."""
    c = work.compute_bytes
    t = layout.tp
    stages = []
    for stage in range(layout.pp):
        sp_ = stage_params(cfg, layout, stage)
        weights = inference_weight_bytes(cfg, sp_, layer_params(cfg, t, layout.ep), t, c, work.quantize)
        layers = sp_["n_layers"]
        tokens = work.global_batch * work.seq_len
        kv = 2 * layers * (cfg.n_kv_heads // t) * cfg.head_dim * c * tokens
        layer_tmp = tokens * c * (3 * cfg.dim + 2 * cfg.n_kv_heads * cfg.head_dim + 3 * cfg.active_ffn_dim()) / t
        logits = tokens * cfg.vocab_size / t * c + work.global_batch * cfg.vocab_size * FP32 if sp_["has_head"] else 0
        workspace = int(layer_tmp + logits)
        comm = 2 * tokens * cfg.dim * c if t > 1 or layout.pp > 1 else 0
        tensors = weights + kv + workspace + comm
        stages.append(Breakdown(params=weights, grads=0, optimizer=0, activations=int(kv + workspace),
                                comm_buffers=comm, overhead=int(device.runtime_bytes + device.alloc_slack * tensors),
                                stage=stage, detail={"kv_cache": kv, "workspace": workspace}))
    return max(stages, key=lambda bd: bd.total)


def memory_per_device(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> Breakdown:
    if work.mode == "infer":
        return inference_memory(cfg, layout, work, device)
    return training_memory(cfg, layout, work, device)
