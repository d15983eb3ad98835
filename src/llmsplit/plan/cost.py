"""Step time from FLOPs, bytes moved and the pipeline bubble; tokens/s and MFU.

A roofline-style model: matmul FLOPs at the device's peak × its matmul efficiency, the
elementwise traffic at memory bandwidth, each collective's bytes at the bandwidth of the
slowest link its group crosses, minus the part the schedule hides behind compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..layout import idle_per_compute
from ..models.llama import LlamaConfig
from .experts import all_to_all_bytes_per_step, all_to_all_calls_per_step
from .hardware import Device
from ..layout import Layout, Workload, microbatches, rank_layer_counts
from .memory import FP32, compute_pattern, inference_weight_bytes, layer_activation_bytes, layer_params, stage_params

# Collectives reach about this fraction of link bandwidth (NCCL bus bandwidth vs wire speed).
LINK_EFFICIENCY = 0.8
# Host DRAM share per GPU and an NVMe drive's share, for offloaded optimizer steps.
HOST_MEM_BW = 100e9
NVME_BW = 2e9
# Fixed cost per collective launch (NCCL on NVLink is ~10 µs; on TCP more, but the
# bandwidth term dominates there).
COLLECTIVE_LATENCY_S = 10e-6


@dataclass
class StepCost:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    detail: dict = field(default_factory=dict)


def model_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × matmul parameters (forward 2, backward 4) plus the
    attention scores and values, 12·L·h·s (PaLM's accounting, no causal discount)."""
    matmul = cfg.n_layers * (layer_params(cfg) - 2 * cfg.dim) + cfg.vocab_size * cfg.dim
    return 6 * matmul + 12 * cfg.n_layers * cfg.dim * seq_len


def _bw(device: Device, extent: int) -> float:
    """Bandwidth of a group whose ranks span `extent` consecutive global ranks."""
    return LINK_EFFICIENCY * (device.intra_bw if extent <= device.gpus_per_node else device.inter_bw)


def _ring(nbytes: float, n: int, bw: float) -> float:
    """All-gather or reduce-scatter of a buffer of `nbytes` over n ranks (an all-reduce is two)."""
    return 0.0 if n <= 1 else nbytes * (n - 1) / n / bw + COLLECTIVE_LATENCY_S * (n - 1)


def training_cost(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> StepCost:
    s, m = work.seq_len, microbatches(layout, work)
    tokens_step = work.global_batch * work.rows_per_sample * s
    per_token = model_flops_per_token(cfg, s)
    matmul_s, elementwise_s = _compute_times(cfg, layout, work, device, per_token)
    compute_s = matmul_s + elementwise_s
    bubble_s = compute_s * idle_per_compute(layout.pp_schedule, layout.pp, m, layout.pp_virtual_stages)
    stage = stage_params(cfg, layout, 0)
    n_local = stage["layers"] + stage["embedding"] + stage["head"] + stage["final_norm"]
    dp_comm, dp_exposed = _data_parallel_comm(cfg, layout, work, device, n_local, compute_s)
    tp_s, pp_s = _model_parallel_comm(cfg, layout, work, device)
    cp_s = _context_parallel_comm(cfg, layout, work, device, compute_s)
    # Every MoE layer waits for its tokens: the all-to-all is on the critical path.
    a2a_bytes = all_to_all_bytes_per_step(cfg, layout, work)
    a2a_calls = all_to_all_calls_per_step(cfg, layout, work)
    ep_s = a2a_bytes / _bw(device, layout.tp * layout.ep) + a2a_calls * COLLECTIVE_LATENCY_S * (layout.ep - 1)
    optimizer_s = _optimizer_time(layout, m, device, n_local)
    step = compute_s + bubble_s + dp_exposed + tp_s + pp_s + ep_s + cp_s + optimizer_s
    tokens_per_s = tokens_step / step
    mfu = per_token * tokens_per_s / (layout.world * device.flops(work.precision))
    detail = {"compute_s": compute_s, "matmul_s": matmul_s, "elementwise_s": elementwise_s, "bubble_s": bubble_s,
              "dp_comm_s": dp_comm, "dp_exposed_s": dp_exposed, "tp_comm_s": tp_s, "pp_comm_s": pp_s, "cp_comm_s": cp_s,
              "ep_comm_s": ep_s, "ep_all_to_all_bytes": a2a_bytes, "optimizer_s": optimizer_s, "model_flops_per_token": per_token}
    return StepCost(step_time_s=step, tokens_per_s=tokens_per_s, mfu=mfu, detail=detail)


def _compute_times(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device,
                   per_token: float) -> tuple[float, float]:
    """(matmul seconds, elementwise seconds) of one rank's step."""
    s, m = work.seq_len, microbatches(layout, work)
    tokens_step = work.global_batch * work.rows_per_sample * s
    model_flops = per_token * tokens_step / layout.world
    # Recomputation: full re-runs every block's forward (+1/3 of the block FLOPs);
    # selective re-runs attention's forward (the matmul outputs are kept).
    block_flops = per_token - 6 * cfg.vocab_size * cfg.dim
    attention_flops = 12 * cfg.n_layers * cfg.dim * s
    extra = {"none": 0.0, "selective": attention_flops / 3, "full": block_flops / 3}[layout.activation_checkpoint]
    hardware_flops = model_flops + extra * tokens_step / layout.world
    matmul_s = hardware_flops / (device.flops(work.precision) * device.matmul_efficiency)
    # Elementwise work (norms, rope, SiLU, casts, their backward) streams the saved
    # activations about three times: written in forward, read and written in backward.
    layers = max(rank_layer_counts(cfg, layout))  # the fullest stage sets the pace
    per_layer = layer_activation_bytes(cfg, layout.micro_batch * work.rows_per_sample, s // layout.cp, layout,
                                       compute_pattern(layout, work))
    elementwise_s = 3 * per_layer * layers * m / (device.mem_bw / (device.gpus_per_node if device.kind == "cpu" else 1))
    return matmul_s, elementwise_s


def _data_parallel_comm(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device, n_local: float,
                        compute_s: float) -> tuple[float, float]:
    """(all data-parallel communication, the part not hidden behind compute), in seconds;
    fp32 gradients, since the parameters are fp32. Context-parallel ranks reduce with them."""
    t, dp, shard, m, c = layout.tp, layout.dp * layout.cp, layout.shard, microbatches(layout, work), work.compute_bytes
    if dp == 1:
        return 0.0, 0.0
    dp_bw, shard_bw = _bw(device, t * dp), _bw(device, t * shard)
    backward_window = 2 / 3 * compute_s / m  # the last micro-batch's backward hides gradient sync
    if layout.zero <= 1:
        dp_comm = 2 * _ring(FP32 * n_local, dp, dp_bw)
        dp_exposed = max(0.0, dp_comm - backward_window)
        if layout.zero == 1:  # owners broadcast updated parameters after the step
            broadcast = _ring(FP32 * n_local, dp, dp_bw)
            dp_comm += broadcast
            dp_exposed += broadcast
        return dp_comm, dp_exposed
    gathers = 1 if layout.zero == 2 else 2 * m
    gather = gathers * _ring(c * n_local, shard, shard_bw)
    scatter = _ring(FP32 * n_local, shard, shard_bw)
    replicate = 2 * _ring(FP32 * n_local / shard, layout.dp_replicate, dp_bw)
    # Prefetching hides the gathers behind compute; the first block's cannot be.
    first = _ring(c * layer_params(cfg, t), shard, shard_bw)
    return gather + scatter + replicate, max(0.0, gather - compute_s) + first + max(0.0, scatter + replicate -
                                                                                    backward_window)


def _model_parallel_comm(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> tuple[float, float]:
    """(tensor-parallel, pipeline) communication seconds on the critical path."""
    s, m, c, t, p = work.seq_len // layout.cp, microbatches(layout, work), work.compute_bytes, layout.tp, layout.pp
    tp_s = pp_s = 0.0
    if t > 1:  # two collectives per layer forward, two in backward, none hidden
        act = layout.micro_batch * work.rows_per_sample * s * cfg.dim * c
        tp_s = 4 * max(rank_layer_counts(cfg, layout)) * m * 2 * _ring(act, t, _bw(device, t))
        if layout.activation_checkpoint == "full":
            tp_s *= 1.5  # the recomputed forward repeats its two
    if p > 1:  # pipeline sends: on the critical path once per micro-batch per boundary
        act = layout.micro_batch * work.rows_per_sample * s * cfg.dim * c / (t if layout.sp else 1)
        pp_s = 2 * (m + p - 1) * (act / _bw(device, t * layout.dp * p) + COLLECTIVE_LATENCY_S)
    return tp_s, pp_s


def _context_parallel_comm(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device,
                           compute_s: float) -> float:
    """Context parallel's seconds on the critical path (parallel/context_parallel.py). Ring:
    per layer and micro-batch, cp - 1 key/value blocks forward, and in backward as many again
    plus their fp32 gradients, each sent while the previous block is computed: exposed only
    where the sends outlast the compute. All-to-all: q, k, v in and the output back, forward
    and backward, (cp - 1)/cp of each rank's share moved, waited for."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    tokens = layout.micro_batch * work.rows_per_sample * work.seq_len // cp
    calls = max(rank_layer_counts(cfg, layout)) * microbatches(layout, work)
    kv, h, c = cfg.n_kv_heads * cfg.head_dim / t, cfg.n_heads * cfg.head_dim / t, work.compute_bytes
    bw = _bw(device, t * cp)  # the cp ranks of one tp rank lie tp apart (parallel/mesh.py)
    if layout.cp_mode == "alltoall":
        moved = 2 * tokens * c * (2 * h + 2 * kv) * (cp - 1) / cp
        return calls * (moved / bw + 4 * COLLECTIVE_LATENCY_S)
    sent = (cp - 1) * tokens * 2 * kv * (2 * c + FP32)
    return max(0.0, calls * sent / bw - compute_s) + calls * 2 * (cp - 1) * COLLECTIVE_LATENCY_S


def _optimizer_time(layout: Layout, m: int, device: Device, n_local: float) -> float:
    """AdamW streams 28 bytes per local parameter (read p, g, m, v; write p, m, v)."""
    shard = layout.shard
    local_opt = n_local / (shard if layout.zero >= 1 else 1)
    if layout.offload == "cpu":
        offload_moves = (2 * m if layout.zero == 3 else 1) * FP32 * n_local / shard + FP32 * n_local / shard
        return offload_moves / device.host_bw + 28 * local_opt / HOST_MEM_BW
    optimizer_s = 28 * local_opt / device.mem_bw
    if layout.offload == "nvme":
        optimizer_s += 2 * 2 * FP32 * local_opt / NVME_BW
    return optimizer_s


def inference_cost(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> StepCost:
    """One decode step for `global_batch` sequences at full context: memory-bound, so the
    time is the bytes each device reads (its weights and KV cache) over its bandwidth;
    the pipeline stages run one after the other for a single batch."""
    c = work.compute_bytes
    t, p = layout.tp, layout.pp
    stage = stage_params(cfg, layout, 0)
    weights = inference_weight_bytes(cfg, {**stage, "embedding": 0}, layer_params(cfg, t, layout.ep), t, c,
                                     work.quantize)  # the embedding is a lookup
    layers = max(rank_layer_counts(cfg, layout))
    kv = 2 * layers * (cfg.n_kv_heads // t) * cfg.head_dim * c * work.global_batch * work.seq_len
    read_s = (weights + kv) / device.mem_bw
    flops = 2 * cfg.num_params() * work.global_batch / layout.world
    compute_s = flops / (device.flops(work.precision) * device.matmul_efficiency)
    tp_s = 2 * layers * 2 * _ring(work.global_batch * cfg.dim * c, t, _bw(device, t)) if t > 1 else 0.0
    per_stage = max(read_s, compute_s) + tp_s
    step = per_stage * p + (p - 1) * COLLECTIVE_LATENCY_S
    replicas = layout.dp
    tokens_per_s = work.global_batch * replicas / step
    mfu = 2 * cfg.num_params() * tokens_per_s / (layout.world * device.flops(work.precision))
    return StepCost(step_time_s=step, tokens_per_s=tokens_per_s, mfu=mfu,
                    detail={"read_s": read_s, "compute_s": compute_s, "tp_comm_s": tp_s})


def step_cost(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device) -> StepCost:
    if work.mode == "infer":
        return inference_cost(cfg, layout, work, device)
    return training_cost(cfg, layout, work, device)
