"""Every rule about splitting a model, checked in one place.

`check(model, layout, work)` is called by `config.validate` before training starts, by
inference `--tp/--pp` before any worker starts, and by the planner for every candidate, so
a layout the planner ranks is one the trainer runs, and one that would fail inside a
collective is refused here in one sentence. Messages name the key the user set: config
keys (`parallel.tp=3`) for training and the planner, flags (`--tp 3`) for inference.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..models.llama import LlamaConfig
from ..models.weight_shapes import structure_problem
from .context import check_context_parallel
from .spec import CHECKPOINTING, CP_MODES, MODES, OFFLOADS, SCHEDULES, V_SCHEDULES, Layout, Workload, stages_per_rank
from .tp_plan import rank_layer_shapes

# The inputs of one int4 group: quant.sizes.INT4_GROUP, which layout/ may not import (a sibling
# layer); tests/test_tp_plan.py keeps the two equal.
INT4_GROUP = 32

_TRAIN_NAMES = {"dp": "parallel.dp", "dp_replicate": "parallel.dp_replicate", "zero": "parallel.zero",
                "tp": "parallel.tp", "pp": "parallel.pp", "pp_schedule": "parallel.pp_schedule",
                "pp_virtual_stages": "parallel.pp_virtual_stages", "pp_microbatches": "parallel.pp_microbatches",
                "micro_batch": "train.micro_batch", "activation_checkpoint": "memory.activation_checkpoint",
                "offload": "memory.offload", "sequence_parallel": "parallel.sequence_parallel", "ep": "parallel.ep",
                "cp": "parallel.cp", "cp_mode": "parallel.cp_mode"}


def _say(key: str, value, work: Workload | None) -> str:
    """`parallel.tp=3` for training, `--tp 3` for inference (the flag the user typed)."""
    if work is not None and work.mode == "infer" and key in ("tp", "pp"):
        return f"--{key} {value}"
    return f"{_TRAIN_NAMES.get(key, key)}={value!r}" if isinstance(value, str) else f"{_TRAIN_NAMES.get(key, key)}={value}"


def _name(key: str, work: Workload | None) -> str:
    return f"--{key}" if work is not None and work.mode == "infer" and key in ("tp", "pp") else _TRAIN_NAMES[key]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _product(dp, cp: int, tp: int, pp: int) -> tuple[str, str]:
    """('parallel.dp × tp × pp', '2×1×1'), with cp among them when it is on."""
    keys, values = ["tp", "pp"], [tp, pp]
    if cp > 1:
        keys, values = ["cp", *keys], [cp, *values]
    return " × ".join(["parallel.dp", *keys]), "×".join(map(str, [dp, *values]))


def resolve_dp(dp: int, tp: int, pp: int, world: int, cp: int = 1) -> int:
    """The data-parallel degree on `world` ranks: `dp` itself, or what is left when it is -1."""
    for key, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if value < 1:
            raise ConfigError(f"parallel.{key}={value} must be at least 1")
    if dp == -1:
        if world % (cp * tp * pp):
            names = "parallel.cp × parallel.tp × parallel.pp" if cp > 1 else "parallel.tp × parallel.pp"
            raise ConfigError(f"world size {world} is not divisible by {names} = {cp * tp * pp}; "
                              f"change --nproc (or --gpus) or the {'cp/' if cp > 1 else ''}tp/pp degrees")
        return world // (cp * tp * pp)
    if dp < 1:
        raise ConfigError(f"parallel.dp={dp} must be -1 (what is left) or at least 1")
    if dp * cp * tp * pp != world:
        names, values = _product(dp, cp, tp, pp)
        raise ConfigError(f"{names} = {values} = {dp * cp * tp * pp} but the world size is {world}; "
                          f"set parallel.dp=-1 or --nproc {dp * cp * tp * pp}")
    return dp


def check(model: LlamaConfig | None, layout: Layout, work: Workload | None = None, world: int | None = None) -> None:
    """Refuse, with one sentence naming the key and the fix, a layout that cannot run `work`
    for `model` on `world` ranks. `model`/`work`/`world` may be None when not yet known
    (then only the rules that need them are skipped)."""
    if work is not None and work.mode not in MODES:
        raise ConfigError(f"mode {work.mode!r} is not one of: {', '.join(MODES)}")
    _check_degrees(layout, work)
    if world is not None and layout.world != world:
        names, values = _product(layout.dp, layout.cp, layout.tp, layout.pp)
        raise ConfigError(f"{names} = {values} = {layout.world} but the world size is {world}; change parallel.dp "
                          f"(or leave it at -1)")
    _check_data_parallel(layout)
    _check_expert_parallel(model, layout, work)
    check_context_parallel(model, layout, work)
    if layout.pp > 1:
        _check_schedule(layout)
    training = work is None or work.mode == "train"
    if work is not None and not training:
        _check_inference(layout, work)
    if work is not None and training:
        _check_batches(layout, work)
        _check_quantized_base(model, layout, work)
    if model is not None:
        check_model(model)
        _check_tensor_parallel(model, layout, work)
        if work is not None:
            problem = packed_split_problem(model, layout.tp, work.quantize)
            if problem:
                raise ConfigError(problem)
        _check_pipeline_model(model, layout, work)
        if work is not None:
            _check_sequence(model, layout, work)


def check_model(model: LlamaConfig) -> None:
    """The shape rules of the decoder itself, whatever the layout: the same ones the model
    readers apply to a file's metadata (`models.weight_shapes.structure_problem`)."""
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
        if getattr(model, key) < 1:
            raise ConfigError(f"model.{key}={getattr(model, key)} must be at least 1")
    problem = structure_problem(model, lambda field: f"model.{field}")
    if problem:
        raise ConfigError(problem)


def _check_degrees(layout: Layout, work: Workload | None) -> None:
    for key in ("dp", "dp_replicate", "tp", "pp", "pp_virtual_stages", "micro_batch", "ep", "cp"):
        if getattr(layout, key) < 1:
            raise ConfigError(f"{_say(key, getattr(layout, key), work)} must be at least 1")
    if layout.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero={layout.zero} is not one of: 0, 1, 2, 3")
    for key, allowed in (("pp_schedule", SCHEDULES), ("activation_checkpoint", CHECKPOINTING), ("offload", OFFLOADS),
                         ("cp_mode", CP_MODES)):
        if getattr(layout, key) not in allowed:
            raise ConfigError(f"{_say(key, getattr(layout, key), work)} is not one of: {', '.join(map(repr, allowed))}")


def _check_data_parallel(layout: Layout) -> None:
    if layout.dp % layout.dp_replicate:
        raise ConfigError(f"parallel.dp={layout.dp} is not divisible by parallel.dp_replicate={layout.dp_replicate}")
    if layout.dp_replicate > 1 and layout.zero < 2:
        raise ConfigError(f"parallel.dp_replicate={layout.dp_replicate} (hybrid sharding) needs parallel.zero=2 or 3")
    if layout.zero == 1 and layout.tp > 1:
        # ZeroRedundancyOptimizer broadcasts each updated parameter with c10d, which has no
        # sharding rule for tensor parallel's DTensors (NotImplementedError at the first step).
        raise ConfigError(f"parallel.zero=1 does not combine with parallel.tp={layout.tp}; use parallel.zero=2 "
                          f"(FSDP also shards only gradients and optimizer state between steps) or 0")
    if layout.offload == "cpu" and layout.zero < 2:
        raise ConfigError(f"memory.offload=\"cpu\" offloads sharded state and needs parallel.zero=2 or 3, "
                          f"not {layout.zero}")


def _check_expert_parallel(model: LlamaConfig | None, layout: Layout, work: Workload | None) -> None:
    """ep splits each copy of the experts over ep of the data-parallel ranks (parallel/expert_parallel.py)."""
    ep = layout.ep
    if ep == 1:
        return
    if work is not None and work.mode == "infer":
        raise ConfigError(f"parallel.ep={ep} is for training; inference splits a mixture-of-experts model with "
                          f"--tp (each expert split over the ranks) or --pp")
    shard = layout.dp // layout.dp_replicate  # ep splits a replica's ranks (hybrid sharding: each replica)
    if shard % ep:
        where = "parallel.dp" if layout.dp_replicate == 1 else "parallel.dp / parallel.dp_replicate"
        raise ConfigError(f"parallel.ep={ep} does not divide the {shard} data-parallel ranks ({where}); use "
                          f"parallel.ep in {', '.join(map(str, divisors(shard)))}")
    # Refused: ZeRO-1 broadcasts every updated parameter over all of dp with c10d, which has no
    # sharding rule for the experts' DTensors (NotImplementedError at the first step) and would
    # mix the experts of different ep ranks; fp16's GradScaler unscales every gradient in one
    # foreach call, which takes DTensors or plain tensors, not both (RuntimeError at step 1);
    # offload untried. (LoRA adapts attention only in MoE models, train/api.check_moe_training.)
    precision = work.precision if work is not None else "fp32"
    for bad, name, value, fix in ((layout.zero == 1, "parallel.zero", layout.zero, "parallel.zero=0, 2 or 3"),
                                  (precision == "fp16", "train.precision", precision, 'train.precision="bf16"'),
                                  (layout.offload != "none", "memory.offload", layout.offload, 'memory.offload="none"')):
        if bad:
            raise ConfigError(f"parallel.ep={ep} does not combine with {name}={value!r} yet; set {fix} or "
                              f"parallel.ep=1")
    if model is None:
        return
    if not model.n_experts:
        raise ConfigError(f"parallel.ep={ep} splits experts, and this model has none (model.n_experts=0); set "
                          f"parallel.ep=1")
    if model.n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide model.n_experts={model.n_experts}; use parallel.ep in "
                          f"{', '.join(str(d) for d in divisors(model.n_experts) if shard % d == 0)}")


def _check_schedule(layout: Layout) -> None:
    if layout.pp_virtual_stages > 1 and layout.pp_schedule not in ("interleaved_1f1b", *V_SCHEDULES):
        raise ConfigError(f"parallel.pp_virtual_stages={layout.pp_virtual_stages} needs "
                          f"parallel.pp_schedule=\"interleaved_1f1b\" (or 1)")
    if layout.pp_schedule in V_SCHEDULES and layout.pp_virtual_stages not in (1, 2):
        raise ConfigError(f"parallel.pp_schedule={layout.pp_schedule!r} always puts 2 stages on each rank; "
                          f"set parallel.pp_virtual_stages=2 (or leave it at 1)")


def _check_batches(layout: Layout, work: Workload) -> None:
    if work.global_batch < 1:
        raise ConfigError(f"train.global_batch={work.global_batch} must be at least 1")
    if work.global_batch % (layout.dp * layout.micro_batch):
        raise ConfigError(f"train.global_batch={work.global_batch} is not divisible by parallel.dp × "
                          f"train.micro_batch = {layout.dp}×{layout.micro_batch} = {layout.dp * layout.micro_batch}; "
                          f"change one of them")
    if layout.pp == 1:
        return
    per_rank = work.global_batch // layout.dp
    if layout.pp_microbatches is not None:
        if layout.pp_microbatches < 1 or per_rank % layout.pp_microbatches:
            raise ConfigError(f"parallel.pp_microbatches={layout.pp_microbatches} must divide the {per_rank} "
                              f"sequences of each data-parallel rank (train.global_batch / parallel.dp)")
        n_micro, source = layout.pp_microbatches, f"parallel.pp_microbatches={layout.pp_microbatches}"
    else:
        n_micro = per_rank // layout.micro_batch
        source = f"train.global_batch / (parallel.dp × train.micro_batch) = {n_micro} micro-batches"
    if n_micro < layout.pp:
        raise ConfigError(f"{source} is fewer than parallel.pp={layout.pp}: the schedule needs at least one "
                          f"micro-batch per stage; raise train.global_batch or lower train.micro_batch")
    if layout.pp_schedule == "dualpipev" and n_micro < 2 * layout.pp:
        # torch's DualPipeV refuses, at the first step, fewer micro-batches than its 2·pp stages.
        raise ConfigError(f"{source} is fewer than the {2 * layout.pp} stages of parallel.pp_schedule=\"dualpipev\" "
                          f"(2 per rank); raise train.global_batch or lower train.micro_batch")


def _check_tensor_parallel(model: LlamaConfig, layout: Layout, work: Workload | None) -> None:
    tp, kv, training = layout.tp, model.n_kv_heads, work is None or work.mode == "train"
    flag = _name("tp", work)
    if model.n_experts and tp > 1 and training and layout.ep == 1:
        # Training splits attention over tp and the experts over ep (parallel/tensor_parallel.py);
        # inference splits each expert over tp (layout/tp_plan.py: INFER_EXPERT_DIMS).
        fix = "parallel.ep > 1 beside parallel.tp (experts split over data-parallel ranks)"
        raise ConfigError(f"{_say('tp', tp, work)} does not split mixture-of-experts layers (model.n_experts="
                          f"{model.n_experts}) by itself; use {fix}")
    if model.n_heads % tp:
        raise ConfigError(f"{_say('tp', tp, work)} does not divide model.n_heads={model.n_heads}; use {flag} in "
                          f"{', '.join(map(str, divisors(model.n_heads)))}")
    if training and kv % tp and tp % kv:
        # Each rank needs whole kv heads: a share of them, or one replicated (tp a multiple).
        fits = [t for t in divisors(model.n_heads) if kv % t == 0 or t % kv == 0]
        raise ConfigError(f"model.n_kv_heads={kv} is neither divisible by nor a divisor of {_say('tp', tp, work)}; "
                          f"use {flag} in {', '.join(map(str, fits))}")
    if not training and kv % tp:
        # Inference shards the KV cache by kv head and does not replicate them (yet).
        raise ConfigError(f"{_say('tp', tp, work)} does not divide model.n_kv_heads={kv} (inference shards the "
                          f"key/value heads); use {flag} in {', '.join(map(str, divisors(kv)))}")
    # The MLP width split over tp: a dense MLP's; inference's experts (each split like one)
    # and training's shared experts (routed experts go to ep) of a MoE layer.
    key, width = "model.ffn_dim", model.ffn_dim
    if model.n_experts and not training:
        key, width = "model.moe_ffn_dim", model.moe_ffn_dim
    elif model.n_experts:
        key, width = "model.n_shared_experts × model.moe_ffn_dim", model.n_shared_experts * model.moe_ffn_dim
    if width % tp:
        raise ConfigError(f"{_say('tp', tp, work)} does not divide {key}={width}; use {flag} in "
                          f"{', '.join(map(str, divisors(math.gcd(width, model.n_heads))))}")
    if model.n_experts and not training and width // tp % 8:
        fits = divisors(math.gcd(width // 8, model.n_kv_heads))
        raise ConfigError(f"{_say('tp', tp, work)} splits each expert's {key}={width} into {width // tp} rows, not a "
                          f"multiple of 8 (the grouped matmul's alignment); use {flag} in {', '.join(map(str, fits))}")
    # No rule for the vocabulary: training's vocabulary-parallel embedding and loss take uneven
    # DTensor shards (vocab 259 on tp 2: loss and gradient norm equal to one process), and
    # inference pads the last shard.


def packed_split_problem(model: LlamaConfig, tp: int, quantize: str) -> str | None:
    """Why `--quantize int4` cannot hold `model`'s layers packed on `tp` ranks, or None. Each
    rank packs its slice of every linear weight of a layer in groups of INT4_GROUP inputs, so
    the inputs it holds must be whole groups: the loader refuses the same inside the workers
    (io.weights.read_weight, io/gguf.py's packed blocks). Routed experts ([experts, out, in])
    stay float; the embedding and head are int8 (one scale a row) on one rank and read as
    float vocabulary shards under tp, so neither has groups to cut."""
    if quantize != "int4":
        return None
    whole = _cut_group(model, 1)
    if whole:
        module, full, _ = whole
        return (f"--quantize int4 keeps groups of {INT4_GROUP} inputs whole, and {module} has {full} inputs; "
                f"use --quantize int8")
    cut = _cut_group(model, tp)
    if cut is None:
        return None
    module, full, _ = cut
    # Among the degrees inference takes (whole kv heads a rank); 1 always fits here.
    fits = [t for t in divisors(model.n_kv_heads) if _cut_group(model, t) is None]
    tps = f"--tp {fits[0]}" if len(fits) == 1 else f"--tp in {', '.join(map(str, fits))}"
    return (f"--quantize int4 under --tp {tp} splits {module}'s {full} inputs into {full / tp:g} per rank, not "
            f"whole groups of {INT4_GROUP}; use {tps} or --quantize int8")


def _cut_group(model: LlamaConfig, tp: int) -> tuple[str, int, int] | None:
    """(module, its inputs, the inputs one of `tp` ranks holds) of the first linear weight of a
    layer whose inputs on a rank are not whole int4 groups, or None."""
    split = rank_layer_shapes(model, tp, experts_over_tp=True)
    for name, shape in rank_layer_shapes(model, 1, experts_over_tp=True).items():
        if len(shape) != 2:
            continue
        full, held = shape[1], split[name][1]
        if held % INT4_GROUP or (held != full and held * tp != full):
            return name.rpartition(".")[0], full, held
    return None


def _check_inference(layout: Layout, work: Workload) -> None:
    """What a loaded model combines, checked by node 0 and by every other node of a split alike."""
    if work.compile and layout.world > 1:
        raise ConfigError("--compile applies to a model loaded in one process; drop it or --tp/--pp")


def _check_quantized_base(model: LlamaConfig | None, layout: Layout, work: Workload) -> None:
    """QLoRA's base is torchao's NF4/int8 tensors: FSDP2 shards them by rows, but tensor
    parallel's DTensor placements and the experts' batched weights are not theirs."""
    base = work.lora_base
    if base == "none":
        return
    if layout.tp > 1:
        raise ConfigError(f"lora.base={base!r} does not split the quantized base by tensor parallel "
                          f"({_say('tp', layout.tp, work)}); use parallel.tp=1 with data parallel (zero 0-3) or "
                          f"parallel.pp")
    if model is not None and model.n_experts:
        raise ConfigError(f"lora.base={base!r} does not quantize mixture-of-experts layers (model.n_experts="
                          f"{model.n_experts}); remove lora.base")


def _check_pipeline_model(model: LlamaConfig, layout: Layout, work: Workload | None) -> None:
    if layout.pp == 1:
        return
    chunks = stages_per_rank(layout.pp_schedule, layout.pp_virtual_stages)
    if work is not None and work.mode == "infer":
        chunks = 1  # inference runs one stage per rank, whatever the training schedule
    stages = layout.pp * chunks
    if model.n_layers < stages:
        per = f" ({chunks} per rank with parallel.pp_schedule={layout.pp_schedule!r})" if chunks > 1 else ""
        raise ConfigError(f"model.n_layers={model.n_layers} is fewer than the {stages} pipeline stages of "
                          f"{_say('pp', layout.pp, work)}{per}: the layout needs at least {stages} layers; lower "
                          f"{_name('pp', work)}" + (" or parallel.pp_virtual_stages" if chunks > 1 else ""))
    if (work is None or work.mode == "train") and model.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true shares the embedding with the output head, which pipeline "
                          "parallel puts on different ranks; set parallel.pp=1 or model.tie_embeddings=false")


def sequence_multiple(layout: Layout) -> int:
    """What a training sequence's length must divide by under sequence parallel, which cuts every
    sequence (a cp rank's share of it) into tp equal pieces: uneven pieces make the ranks'
    collectives disagree on sizes (gloo aborts the workers). 1 without it. Context parallel's
    own 2 × cp rule is layout/context.py's."""
    return layout.cp * layout.tp if layout.sp else 1


def _check_sequence(model: LlamaConfig, layout: Layout, work: Workload) -> None:
    if work.mode != "train":
        return
    if work.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len={work.seq_len} exceeds model.max_seq_len={model.max_seq_len}; "
                          f"lower data.seq_len or raise model.max_seq_len")
    if work.seq_len % sequence_multiple(layout):
        by = f"parallel.cp × parallel.tp = {layout.cp * layout.tp}" if layout.cp > 1 else f"parallel.tp={layout.tp}"
        raise ConfigError(f"data.seq_len={work.seq_len} is not divisible by {by}, and sequence parallel splits "
                          f"each sequence over the tp ranks; use a data.seq_len that is a multiple of "
                          f"{layout.cp * layout.tp} or set parallel.sequence_parallel=false")
