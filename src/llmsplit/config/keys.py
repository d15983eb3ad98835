"""What each config key means: its one-line description (here, beside the sections' dataclasses,
which hold the names, types and defaults; tests/test_config.py checks that every key has its
line and no line outlives its key), the values it allows where they are fixed (the constants
the checks refuse others with), and the default that applies in context. `llmsplit train
--help-config` prints them (`config_keys_text`); an unknown key is answered with the closest
known one (`closest_key`)."""

from __future__ import annotations

import dataclasses
import difflib

from ..layout.spec import CHECKPOINTING, CP_MODES, OFFLOADS, SCHEDULES
from ..models.presets import PRESETS
from ..models.weight_shapes import VALUE_CHOICES
from .checks import CHOICES
from .data import FORMATS, LOSS_ON
from .lora import BASES, TARGET_NAMES
from .objective import DPO_LOSSES, GRPO_LOSSES, OBJECTIVES
from .sections import FINETUNE_DEFAULTS, LORA_LR, Config

DOCS = {
    "model.preset": "named model sizes, weights random from train.seed (when neither model.hf nor model.gguf is set)",
    "model.hf": "a Hugging Face folder to fine-tune: its config.json sizes, safetensors weights and tokenizer",
    "model.gguf": "a GGUF file to fine-tune: its sizes, weights (dequantized as read) and tokenizer",
    "model.dim": "hidden size: the width of the residual stream",
    "model.n_layers": "decoder layers",
    "model.n_heads": "attention query heads",
    "model.n_kv_heads": "key/value heads (fewer than n_heads: grouped-query attention)",
    "model.vocab_size": "rows of the embedding and the output head (grown to cover the tokenizer's ids when unset)",
    "model.ffn_dim": "hidden size of each MLP",
    "model.max_seq_len": "longest sequence the model takes",
    "model.rope_theta": "base of the rotary position embedding",
    "model.norm_eps": "epsilon of the RMSNorms",
    "model.tie_embeddings": "the output head shares the embedding's weight",
    "model.qkv_bias": "biases on the q, k and v projections (Qwen2)",
    "model.rope_scaling": "rotary scaling as JSON text (from model.hf's rope_scaling)",
    "model.head_dim": "width of one attention head (dim / n_heads when unset; Qwen3 and Gemma choose their own)",
    "model.qk_norm": "an RMSNorm over each q and k head before the rotation (Qwen3)",
    "model.family": "the Hugging Face model_type an export writes where the maths alone does not say (Phi-3)",
    "model.embed_scale": "the embeddings are multiplied by it (Gemma: sqrt(dim))",
    "model.sandwich_norm": "norms after attention and MLP as well as before (Gemma 2/3)",
    "model.mlp_act": "the MLP's activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)",
    "model.query_pre_attn_scalar": "attention scale query_pre_attn_scalar ** -0.5 instead of head_dim's (Gemma)",
    "model.attn_softcap": "tanh cap on the attention scores (Gemma 2)",
    "model.logit_softcap": "tanh cap on the output logits (Gemma 2)",
    "model.sliding_window": "layers that slide attend to the keys within this many positions only (Mistral, Gemma)",
    "model.sliding_pattern": "every Nth layer attends globally, the others slide (0: every layer slides)",
    "model.rope_local_theta": "rotary base of the sliding layers (Gemma 3)",
    "model.n_experts": "routed experts in each MLP (mixture of experts; 0: a dense MLP)",
    "model.experts_per_token": "experts each token is routed to (top k)",
    "model.moe_ffn_dim": "hidden size of each expert (ffn_dim when unset)",
    "model.n_shared_experts": "experts every token passes through beside the routed ones",
    "model.router_score": "how the router's logits become scores: softmax (Mixtral) or sigmoid (DeepSeek-V3)",
    "model.router_renorm": "the top-k scores are renormalised to sum to 1",
    "model.router_bias": "a per-expert bias for choosing the top k (set by train.moe_bias_rate)",
    "data.source": "\"builtin\" (a small corpus), a token file from llmsplit prepare, \"text:GLOB\" or FILE.jsonl",
    "data.seq_len": "tokens per training sequence",
    "data.tokenizer": "\"byte\" (a byte per token), or the path of a tokenizer.json or of its folder",
    "data.format": "chat: JSONL conversations in the model's chat template, packed whole into sequences",
    "data.loss_on": "the tokens that carry loss: the assistant's turns, or all",
    "data.eval_source": "held-out data, in the same form as data.source",
    "data.eval_fraction": "this share of the source's documents (the last ones) held out instead",
    "train.objective": "what training minimises: next-token loss (sft), the DPO loss on preference pairs (dpo), "
                       "or GRPO's loss on completions scored by reward functions (grpo)",
    "train.teacher": "a model to distil from (run, checkpoint, Hugging Face folder or GGUF with the data's "
                     "tokenizer): the loss becomes KL to its next-token distribution, the teacher frozen on each rank",
    "train.distill_weight": "with train.teacher: the KL term's share of the loss, the rest next-token loss",
    "train.distill_temperature": "with train.teacher: both sides' logits divided by this (KL times its square)",
    "train.teacher_params": "the teacher's parameters, which the planner counts (set from train.teacher's weights)",
    "train.steps": "optimizer steps",
    "train.global_batch": "sequences per optimizer step, over all data-parallel ranks (dpo: preference pairs; "
                          "grpo: completions, grpo.num_generations per prompt)",
    "train.micro_batch": "sequences a rank computes at a time, gradients accumulate over the rest (dpo: pairs; "
                         "grpo: completions)",
    "train.lr": "peak learning rate, reached after train.warmup_steps",
    "train.min_lr_ratio": "the schedule ends at train.lr times this",
    "train.warmup_steps": "steps of linear warmup from 0 to train.lr",
    "train.lr_schedule": "how the learning rate falls after the warmup",
    "train.weight_decay": "AdamW's weight decay on the weight matrices (not on norms and biases)",
    "train.grad_clip": "the global gradient norm is clipped to this (0: no clipping)",
    "train.precision": "compute dtype: fp32, or bf16 / fp16 autocast over fp32 weights",
    "train.seed": "seed of the initial weights, the adapters and the data order",
    "train.deterministic": "deterministic algorithms only: the same numbers on every run, slower",
    "train.log_every": "steps between the lines of metrics.jsonl (the last step is always logged)",
    "train.eval_every": "steps between evaluations on the held-out data (0: never)",
    "train.compile": "torch.compile the model",
    "train.moe_aux_loss": "times the MoE load-balancing loss, added to the loss (Mixtral: 0.02; not with pp > 1)",
    "train.moe_bias_rate": "loss-free balancing: the router bias's step per optimizer step (DeepSeek-V3: 0.001)",
    "train.timeout_s": "seconds a collective (or a node joining the job) may wait for the others",
    "train.profile_steps": "steps traced with torch.profiler into RUN_DIR/profile/ (set by --profile)",
    "train.tensorboard": "also write metrics.jsonl's records as TensorBoard events in RUN_DIR/tensorboard/",
    "train.confirm_micro_batch": "try micro-batches before step 1, train with the largest that fits (set by --auto)",
    "parallel.dp": "data-parallel ranks (-1: the workers left after cp, tp and pp)",
    "parallel.dp_replicate": "with zero 2 or 3: replicas of the sharded model (hybrid sharding)",
    "parallel.zero": "0 DDP; 1 shards the optimizer state; 2 also the gradients; 3 also the parameters (FSDP2)",
    "parallel.tp": "tensor-parallel ranks each layer is split over",
    "parallel.sequence_parallel": "with tp: the norms and the residual stream split along the sequence too",
    "parallel.pp": "pipeline stages the layers are cut into",
    "parallel.pp_schedule": "the pipeline schedule",
    "parallel.pp_microbatches": "micro-batches the pipeline runs per step",
    "parallel.pp_virtual_stages": "looped stages per rank (interleaved_1f1b)",
    "parallel.ep": "expert-parallel ranks each MoE layer's experts are split over (divides dp)",
    "parallel.cp": "context-parallel ranks each sequence is split over (data.seq_len divisible by 2 x cp)",
    "parallel.cp_mode": "how attention crosses the split: key/value blocks round a ring, or all-to-all over heads",
    "memory.activation_checkpoint": "recompute in backward: each block (full), or element-wise ops and attention",
    "memory.offload": "cpu (zero 2/3): the model state in host memory; nvme: the Adam moments in a file",
    "memory.offload_dir": "the folder of memory.offload=\"nvme\"'s file",
    "memory.limit_bytes": "the peak bytes a rank may use; above it the run stops and explains",
    "checkpoint.dir": "where checkpoints go",
    "checkpoint.every": "steps between checkpoints (0: only at the end)",
    "checkpoint.keep": "newest checkpoints kept",
    "checkpoint.async_save": "(also `checkpoint.async`) write checkpoints in the background while training goes on",
    "checkpoint.every_seconds": "also save when this many seconds have passed since the last save (0: off)",
    "lora.rank": "rank of the LoRA adapters (0: LoRA off, every parameter trains)",
    "lora.alpha": "the adapters' update is scaled by lora.alpha / lora.rank",
    "lora.dropout": "dropout on the adapters' input",
    "lora.targets": "the projections of each layer that get adapters",
    "lora.base": "the frozen base stored as 4-bit NF4 or int8 (QLoRA)",
    "dpo.beta": "how far the policy may move from the reference: the loss's inverse temperature",
    "dpo.loss": "sigmoid (DPO) or ipo (IPO, on the replies' mean token log-probs)",
    "dpo.label_smoothing": "the assumed chance that a pair's preference is wrong (conservative DPO; sigmoid only)",
    "grpo.rewards": "reward functions, each \"module:function\" or \"path/to/file.py:function\", called as "
                    "f(prompts, completions, **columns) -> a number per completion",
    "grpo.reward_weights": "the weight of each reward function in the reward a completion gets",
    "grpo.num_generations": "completions sampled per prompt; each one's advantage is relative to its group's",
    "grpo.epsilon": "the clip range: the probability ratio of a token is clipped to 1 +- epsilon",
    "grpo.beta": "times the KL divergence to the reference model in the loss (0: no reference kept)",
    "grpo.loss": "grpo (each completion's token losses averaged) or dr_grpo (summed, divided by "
                 "grpo.max_completion_tokens)",
    "grpo.max_completion_tokens": "tokens a completion may have; generation stops there",
    "grpo.temperature": "the sampling temperature of the completions",
    "grpo.top_p": "nucleus sampling of the completions: the smallest set of tokens with this much probability",
    "lora.init": "a PEFT adapter folder, or a LoRA run or checkpoint, to start the adapters from",
}


SECTION_NOTES = {"model": "  (a size left unset comes from model.preset, or model.hf's config.json / model.gguf's metadata)"}


def allowed_values() -> dict[str, str]:
    """The fixed values of each key that has them, as `--help-config` says them."""
    one_of = {**CHOICES, "parallel.pp_schedule": SCHEDULES, "memory.activation_checkpoint": CHECKPOINTING,
              "memory.offload": OFFLOADS, "data.format": FORMATS, "data.loss_on": LOSS_ON, "lora.base": BASES,
              "train.objective": OBJECTIVES, "dpo.loss": DPO_LOSSES, "grpo.loss": GRPO_LOSSES,
              "parallel.cp_mode": CP_MODES, "parallel.zero": ("0", "1", "2", "3"), "model.preset": tuple(PRESETS),
              **{f"model.{name}": values for name, values in VALUE_CHOICES.items()}}
    said = {key: f"one of {', '.join(values)}" for key, values in one_of.items()}
    return {**said, "lora.targets": f"a comma-separated list of {', '.join(TARGET_NAMES)}"}


def context_defaults() -> dict[str, str]:
    """What an unset key takes where its default depends on other keys (after the default's value)."""
    weights, lora = "with model.hf or model.gguf", "with either and [lora] on (lora.rank > 0)"
    tuned = {key: f"{FINETUNE_DEFAULTS[key]:g} {weights}" for key in ("train.warmup_steps", "train.weight_decay")}
    return {
        "train.lr": f"from scratch, {FINETUNE_DEFAULTS['train.lr']:g} {weights}, {LORA_LR:g} {lora}",
        **{key: f"from scratch, {value}" for key, value in tuned.items()},
        "data.tokenizer": f"({weights}: the model's)",
        "data.format": "(chat with train.objective dpo)",
        "lora.alpha": "(2 x lora.rank: a scale of 2)",
        "data.loss_on": "(assistant with data.format chat, else all)",
        "grpo.reward_weights": "(1.0 for each of grpo.rewards)",
        "parallel.sequence_parallel": "(true when tp > 1)",
        "parallel.pp_microbatches": "(global_batch / (dp x micro_batch))",
        "memory.limit_bytes": "(the device's own memory)",
        "checkpoint.dir": "(RUN_DIR/checkpoints)",
    }


def config_keys_text() -> str:
    """Every config key: its type, its default (in context) and allowed values on one line, what
    it means on the next, read from the config dataclasses (so the list cannot drift from what
    `--set` accepts)."""
    allowed, context = allowed_values(), context_defaults()
    lines = ["Config keys: a [SECTION] of a TOML file, or --set SECTION.KEY=VALUE. Each key: its type and",
             "default (the default in context, where it depends on other keys), the values it allows, then",
             "what it means."]
    for section in dataclasses.fields(Config):
        values = section.default_factory()
        lines.append(f"\n[{section.name}]" + SECTION_NOTES.get(section.name, ""))
        for f in dataclasses.fields(values):
            key, default = f"{section.name}.{f.name}", getattr(values, f.name)
            shown = "unset" if default is None else _toml_text(default)
            line = f"  {key:<32} {f.type!s:<14} default {shown}"
            line += f" {context[key]}" if key in context else ""
            line += f"; {allowed[key]}" if key in allowed else ""
            lines += [line, f"  {'':<32} {DOCS[key]}"]
    return "\n".join(lines) + "\n"


def closest_key(dotted: str) -> str | None:
    """The known key `dotted` is likeliest a typo of (difflib's closest), or None. Names are
    compared within the section (its own, or the closest section name): compared whole, the
    shared "train." would make any two train keys look alike."""
    sections = {s.name: [f.name for f in dataclasses.fields(s.default_factory())] for s in dataclasses.fields(Config)}
    section, _, key = dotted.partition(".")
    if not key:  # a key without its section ("lr"): any section's
        owner = {name: s for s, names in sections.items() for name in names}
        close = difflib.get_close_matches(section, owner, n=1, cutoff=0.6)
        return f"{owner[close[0]]}.{close[0]}" if close else None
    if section not in sections:
        close = difflib.get_close_matches(section, sections, n=1, cutoff=0.6)
        if not close:
            return None
        section = close[0]
    close = difflib.get_close_matches(key, sections[section], n=1, cutoff=0.6)
    return f"{section}.{close[0]}" if close else None


def _toml_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)
