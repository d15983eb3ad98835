"""The frozen models a run holds beside the one it trains. A distillation's teacher
(train/distill.py): whole on each rank in the compute dtype, and where the loss is computed its
logits and the KL's float temporaries over the vocabulary for one micro-batch.

What a GRPO run's rollout engine holds on each rank (posttrain/handover.py): the whole model
in fp32 (its weights gathered whole from any training layout; under LoRA the frozen base and
the adapters), a second frozen copy as the KL reference when grpo.beta > 0 without LoRA, and
the paged KV pool of the completions that rank generates at once (its share of the step's).
It is resident for the whole run, beside the training layout's own states."""

from __future__ import annotations

import math

from ..layout import Layout, Workload
from ..models.llama import LlamaConfig
from ..models.weight_shapes import model_params

ENGINE_BYTES = 4  # the engine computes in fp32 (the hand-over copies the fp32 master weights)
BLOCK = 16  # the engine's KV block size (InferConfig.block_size's default)


def rollout_engine_bytes(cfg: LlamaConfig, layout: Layout, work: Workload, lora_params: int = 0) -> dict:
    """{"weights", "reference", "kv_pool"} bytes on one rank; empty without an engine."""
    if not work.rollout_rows:
        return {}
    rows = math.ceil(work.rollout_rows / layout.world)
    context = math.ceil(work.rollout_context / BLOCK) * BLOCK
    weights = (model_params(cfg) + lora_params) * ENGINE_BYTES
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * ENGINE_BYTES * rows * context
    return {"weights": weights, "reference": weights if work.rollout_reference else 0, "kv_pool": kv}


def teacher_bytes(cfg: LlamaConfig, layout: Layout, work: Workload, has_head: bool) -> dict:
    """{"teacher", "teacher_logits"} bytes on one rank; empty without a teacher. The logits:
    the teacher's in the compute dtype, and four float32 arrays as wide (its log-softmax,
    their exponent, the difference to the student's, the product) while the KL is formed."""
    if not work.teacher_params:
        return {}
    rows = layout.micro_batch * work.rows_per_sample
    logits = rows * work.seq_len * cfg.vocab_size * (work.compute_bytes + 4 * 4) if has_head else 0
    return {"teacher": work.teacher_params * work.compute_bytes, "teacher_logits": logits}
