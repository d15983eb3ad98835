"""Model states per device: parameters (a quantized base at its stored width), gradients and
AdamW moments, as llmsplit holds them (plan/memory.py adds activations and buffers)."""

from __future__ import annotations

from ..layout import Workload, rank_layer_shapes
from ..models.llama import LlamaConfig
from ..quant.sizes import kind_for, packed_nbytes

FP32 = 4
# Bytes a value of a quantized frozen base takes (adapters/qlora.py, torchao's tensors): NF4 is
# 4 bits plus one int8 scale per block of 64 (the fp32 factors of its double quantization, one
# per 256 blocks at most, are under 0.1%); int8 is 1 byte plus an fp32 scale per row (ignored).
STORED_BYTES = {"nf4": 0.5 + 1 / 64, "int8": 1.0}


def quantized_base_params(cfg: LlamaConfig, work: Workload, n_layers: int) -> int:
    """Parameters a quantized base (lora.base) stores below fp32: every linear weight of the
    stage's decoder layers (norms and biases stay fp32, as do the embedding and the head).
    Dense layers only, on tp 1: layout/rules.py refuses a quantized base otherwise."""
    if not work.lora_rank or work.lora_base == "none":
        return 0
    return n_layers * cfg.layer_matmul_params()


def stored_bytes(n_params: int, quantized: int, base: str, c: int = FP32) -> int:
    """Bytes of `n_params` parameters held at `c` bytes each but `quantized` of them at their
    quantized width."""
    return int(c * (n_params - quantized) + (STORED_BYTES[base] * quantized if quantized else 0))


def model_state_bytes(n_params: int, zero: int, shard: int, trained: int | None = None, quantized: int = 0,
                      base: str = "none") -> dict:
    """llmsplit's model states per device: fp32 params, fp32 grads, fp32 Adam moments.

    zero 1 shards only the optimizer state (DDP + ZeroRedundancyOptimizer);
    zero 2 and 3 (FSDP2) shard all three; what differs between them is what is gathered
    for compute, counted under communication buffers. `trained`: the parameters that have
    gradients and optimizer state (LoRA's adapters), when not all of them; `quantized` of the
    parameters are stored as `base` (QLoRA).
    """
    n = shard if zero >= 1 else 1
    trained = n_params if trained is None else trained
    params = stored_bytes(n_params, quantized, base) // (n if zero >= 2 else 1)
    grads = FP32 * trained // (n if zero >= 2 else 1)
    optimizer = 2 * FP32 * trained // n
    return {"params": params, "grads": grads, "optimizer": optimizer}


def zero_paper_bytes(n_params: float, zero: int, n: int) -> float:
    """The ZeRO paper's classic mixed-precision Adam accounting (bf16/fp16 params and grads
    plus fp32 master, momentum, variance = 16 bytes per parameter), per device."""
    if zero == 0:
        return 16 * n_params
    if zero == 1:
        return 4 * n_params + 12 * n_params / n
    if zero == 2:
        return 2 * n_params + 14 * n_params / n
    return 16 * n_params / n


def inference_weight_bytes(cfg: LlamaConfig, stage: dict, layer: int, t: int, c: int, quantize: str) -> int:
    """Bytes of the weights one inference rank of pipeline stage `stage` (`memory.stage_params`;
    `layer` parameters a decoder layer on this rank) holds: `c` bytes a value, or with
    `quantize` the bytes a packed load holds (`quant.sizes.packed_nbytes`): q/k/v fused into one
    packed weight and gate/up into another (`infer.runner.runner.fuse_projections`), each with its
    group scales and the int4 layout's padded rows; the embedding and head at int8 (int4 too
    keeps them there, `quant.sizes.kind_for`) on one tp rank, at `c` under tp (the vocabulary
    shards are read as float); norms, biases and MoE experts stay at `c`."""
    n_layers, ends = stage["n_layers"], (stage["embedding"] > 0) + (stage["head"] > 0)
    table = cfg.vocab_size * cfg.dim // t
    norm = stage["final_norm"]
    if quantize == "none":
        return c * (n_layers * layer + table * ends + norm)
    shapes = rank_layer_shapes(cfg, t, experts_over_tp=True)
    wq, wk, wv, wo = (shapes[f"attention.w{x}.weight"] for x in "qkvo")
    mats = [((wq[0] + wk[0] + wv[0], wq[1]), quantize), (wo, quantize)]
    if not cfg.n_experts:
        gate, up, down = (shapes[f"feed_forward.w{x}.weight"] for x in "132")
        mats += [((gate[0] + up[0], gate[1]), quantize), (down, quantize)]
    packed_values = sum(n * k for (n, k), _ in mats)
    per_layer = sum(packed_nbytes(shape, kind) for shape, kind in mats) + c * (layer - packed_values)
    vocab = packed_nbytes((cfg.vocab_size, cfg.dim), kind_for("output.weight", quantize)) if t == 1 else c * table
    return n_layers * per_layer + vocab * ends + c * norm
