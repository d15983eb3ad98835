"""The planner's entry points: a report for `llmsplit plan`, the prediction for one
training config (for the trainer's self-check), and a runnable config for a layout."""

from __future__ import annotations

import copy
import shlex
from dataclasses import replace
from pathlib import Path

from ..config import (Config, check_lora, layout_of, load_config, model_config, record_model_sizes, to_toml,
                      workload_of)
from ..errors import ConfigError
from ..layout import (PRECISIONS, SPLIT_BACKWARD_SCHEDULES, Layout, Workload, check, check_model,
                      packed_split_problem, parse_layout, rank_layer_counts, resolve_dp, stage_layers)
from ..models.hf_config import UnsupportedHFConfig, is_hf_folder, read_hf_config
from ..models.llama import LlamaConfig
from ..models.presets import PRESETS, preset_config
from ..quant.sizes import MODES
from .experts import expert_params_per_rank
from .hardware import Device, get_device
from .search import accepts, evaluate, first_fit, search

# The suggestion when full fine-tuning fits only offloaded: LoRA at rank 16 (PEFT's and
# torchtune's recipes use 8-64) and QLoRA, the same over a base stored as nf4.
ADAPTERS = (("LoRA", {"lora_rank": 16}, "--set lora.rank=16", "LoRA, rank 16"),
            ("QLoRA", {"lora_rank": 16, "lora_base": "nf4"}, "--set lora.rank=16 --set lora.base=nf4",
             "QLoRA: the same over a base stored as nf4"))


def resolve_model(model, tokenizer_vocab: int | None = None, sets: tuple[str, ...] = ()
                  ) -> tuple[LlamaConfig, str, Config | None]:
    """A preset name, a Hugging Face folder, a training config file, or a LlamaConfig. A
    Hugging Face folder (or a config's model.hf) is read by the parser that training and
    inference use, so all three accept and refuse the same config.json. `sets` (`--set
    KEY=VALUE`) make a training config of a preset or folder, or change the file's: the
    planner reads its lora.*, data.seq_len, train.global_batch and train.precision."""
    if isinstance(model, LlamaConfig):
        return model, "custom", load_config(None, sets) if sets else None
    text = str(model)
    if text in PRESETS:
        if not sets:
            return preset_config(text), text, None
        cfg = load_config(None, [f"model.preset={text}", *sets])  # model.* sizes set on top of the preset's
        return model_config(cfg, tokenizer_vocab), text, cfg
    path = Path(text)
    if path.suffix == ".toml":
        cfg = load_config(path, sets)  # a missing or unparsable file is a ConfigError
        if cfg.model.hf:  # as `llmsplit train` does: the sizes are the folder's
            record_model_sizes(cfg, _hf_folder_config(cfg.model.hf))
        return model_config(cfg, tokenizer_vocab), str(path), cfg
    if is_hf_folder(path):
        return _hf_folder_config(path), str(path), load_config(None, [f"model.hf={path}", *sets]) if sets else None
    raise ConfigError(f"--model {text!r} is not a known preset, a Hugging Face folder or a .toml config; "
                      f"presets: {', '.join(PRESETS)}")


def _hf_folder_config(folder) -> LlamaConfig:
    try:
        return read_hf_config(folder)[0]
    except UnsupportedHFConfig as e:
        raise ConfigError(str(e)) from None


def plan_report(model, gpus: int, gpu: str | Device = "H100-80GB", nodes: int | None = None,
                seq_len: int | None = None, global_batch: int | None = None, mode: str = "train",
                layout: str | Layout | None = None, top: int = 5, precision: str | None = None, quantize: str = "none",
                tokenizer_vocab: int | None = None, cpu_measured: dict | None = None, sets: tuple[str, ...] = ()) -> dict:
    """Everything `llmsplit plan` prints, as one JSON-ready dict (best layout first).
    `gpu="cpu"` needs `cpu_measured`, the machine's numbers (`diagnose.probe.measure_cpu()`)."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if top < 1:
        raise ConfigError(f"--top {top} must be at least 1")
    if mode not in ("train", "infer"):
        raise ConfigError(f"--mode {mode!r} is not one of: 'train', 'infer'")
    if nodes is not None and (nodes < 1 or gpus % nodes):
        raise ConfigError(f"--nodes {nodes} must be at least 1 and divide --gpus {gpus}")
    cfg_model, name, source = resolve_model(model, tokenizer_vocab, tuple(sets))
    if source is not None:
        check_lora(source.lora)
    check_model(cfg_model)  # before anything is sized per layer
    per_node = gpus // nodes if nodes else None
    device = get_device(gpu, workers_per_node=per_node or gpus, cpu_measured=cpu_measured)
    if per_node is None:
        per_node = min(gpus, device.gpus_per_node)
    device = replace(device, gpus_per_node=per_node) if device.kind != "cpu" else device
    work = _workload(cfg_model, source, gpus, device, seq_len, global_batch, mode, precision,
                     from_file=str(model).endswith(".toml"))
    work = replace(work, quantize=_quantize(quantize, mode))
    problem = packed_split_problem(cfg_model, 1, work.quantize)  # else every layout would be left out
    if problem:
        raise ConfigError(problem)
    fixed = _fixed_layout(layout, gpus)
    result = search(cfg_model, work, gpus, device, fixed)
    cands = result["candidates"]
    shown = cands[:top]
    command = None if isinstance(model, LlamaConfig) else _plan_command(model, gpus, device, sets, {
        "--nodes": nodes, "--seq-len": seq_len, "--global-batch": global_batch, "--precision": precision,
        "--layout": layout if isinstance(layout, str) else None})
    return {
        "model": {"name": name, "params": cfg_model.num_params(), "active_params": cfg_model.active_params(),
                  **cfg_model.to_dict()},
        "hardware": {"gpu": device.name, "count": gpus, "nodes": -(-gpus // per_node), "gpus_per_node": per_node,
                     **{k: v for k, v in device.to_dict().items() if k not in ("name", "gpus_per_node")}},
        "workload": {"mode": work.mode, "seq_len": work.seq_len, "global_batch": work.global_batch,
                     "precision": work.precision, "lora_rank": work.lora_rank, "lora_targets": work.lora_targets,
                     "lora_base": work.lora_base, "quantize": work.quantize},
        "considered": len(cands), "fitting": sum(c.fits for c in cands),
        "advice": result["advice"],
        "layouts": [_entry(cfg_model, c, device) for c in shown],
        "best_runnable": _entry(cfg_model, result["runnable"][0], device) if result["runnable"] else None,
        "closest_excluded": [_entry(cfg_model, c, device) for c in result["excluded"]],
        "next_step": _next_step(command, cfg_model, work, gpus, device, result["runnable"], fixed is None),
    }


def _plan_command(model, gpus: int, device: Device, sets, flags: dict) -> str:
    """This plan as a command line, for the next steps to add their flags to."""
    words = ["llmsplit plan --model", shlex.quote(str(model)), f"--gpus {gpus} --gpu {device.name}"]
    words += [f"{flag} {value}" for flag, value in flags.items() if value is not None]
    words += [f"--set {shlex.quote(s)}" for s in sets]
    return " ".join(words)


def _next_step(command: str | None, cfg: LlamaConfig, work: Workload, gpus: int, device: Device,
               fitting: list, every_layout: bool) -> dict | None:
    """What to run next: write the best layout as a config; but when full fine-tuning fits only
    with its state offloaded to host RAM (moved over PCIe every step), or not at all, first the
    LoRA and QLoRA plans that fit on the devices alone (checked here, so the command works;
    not after --layout, whose command would keep that layout)."""
    if command is None or work.mode != "train":
        return None
    emit = [{"command": f"{command} --emit-config plan.toml",
             "what": "write the layout as a config that llmsplit train runs"}] if fitting else []
    plain = {"why": "train the best layout", "steps": emit} if emit else None
    if work.lora_rank or not every_layout or any(c.layout.offload == "none" for c in fitting):
        return plain
    adapters = [(name, {"command": f"{command} {flags}", "what": what}) for name, keys, flags, what in ADAPTERS
                if first_fit(cfg, replace(work, **keys), gpus, device, offload=False)]
    if not adapters:
        return plain
    if emit:
        emit[0]["what"] = "or full fine-tuning, offloaded: write its config"
    full = "fits only with offload=cpu" if fitting else "does not fit"
    return {"why": f"full fine-tuning {full} on {gpus} × {device.name}; "
                   f"{' and '.join(name for name, _ in adapters)} {'fit' if len(adapters) > 1 else 'fits'} "
                   f"on the devices alone",
            "steps": [step for _, step in adapters] + emit}


def _entry(cfg: LlamaConfig, cand, device: Device) -> dict:
    """A candidate as JSON; with pp > 1 also the layers of each pipeline stage, the split that
    training and inference run (`layout.stage_layers`), so anyone can compare them."""
    entry = cand.to_dict()
    # The node's RAM the layout takes: the offloaded state of each device on it, or on the cpu
    # device (whose memory is the host's) everything its workers hold.
    on_host = cand.memory.total if device.kind == "cpu" else cand.memory.host
    entry["host_bytes_per_node"] = on_host * device.gpus_per_node
    if cand.layout.pp > 1:
        entry["stage_layers"] = stage_layers(cfg, cand.layout)
    if cfg.n_experts:
        # The fullest stage's routed experts on one ep rank, what the step sends by all-to-all
        # (plan/experts.py), and the dispatch buffers counted in comm_buffers.
        lay = cand.layout
        entry["experts"] = {
            "expert_params_per_rank": max(rank_layer_counts(cfg, lay)) * expert_params_per_rank(cfg, lay.ep),
            "all_to_all_bytes_per_step": (cand.cost.detail.get("ep_all_to_all_bytes", 0) if cand.cost else 0),
            "dispatch_buffer_bytes": cand.memory.detail.get("comm", {}).get("ep_dispatch", 0)}
    return entry


def _workload(cfg: LlamaConfig, source: Config | None, gpus: int, device: Device, seq_len, global_batch, mode,
              precision, from_file: bool = True) -> Workload:
    """What runs: the flags, else the config's values (a config made of --set alone gives only
    the keys it names), else the defaults for the device and model."""
    def given(key: str) -> bool:
        return source is not None and (from_file or key in source.explicit)

    if precision is None:
        precision = source.train.precision if given("train.precision") else ("fp32" if device.kind == "cpu" else "bf16")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r} is not one of: {', '.join(map(repr, PRECISIONS))}")
    if seq_len is None:
        seq_len = source.data.seq_len if given("data.seq_len") else min(cfg.max_seq_len, 2048 if mode == "train" else 8192)
    if global_batch is None:
        global_batch = source.train.global_batch if given("train.global_batch") else (4 * gpus if mode == "train" else 1)
    for flag, value in (("--seq-len", seq_len), ("--global-batch", global_batch)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if source is not None and mode == "train":  # its adapters, objective (DPO's pairs, GRPO's engine), teacher
        return workload_of(source, seq_len, global_batch, precision)
    return Workload(seq_len=seq_len, global_batch=global_batch, precision=precision, mode=mode)


def _quantize(mode: str, run_mode: str) -> str:
    if mode not in MODES:
        raise ConfigError(f"--quantize {mode!r} is not one of: {', '.join(MODES)}")
    if mode != "none" and run_mode != "infer":
        raise ConfigError(f"--quantize {mode} plans inference (--mode infer); a quantized base for training is "
                          f"--set lora.base=nf4|int8")
    return mode


def _fixed_layout(layout, gpus: int) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    lay = parse_layout(layout)
    explicit_dp = any(item.split("=")[0].strip().split(".")[-1] == "dp" for item in layout.split(","))
    if not explicit_dp:
        lay = replace(lay, dp=resolve_dp(-1, lay.tp, lay.pp, gpus, lay.cp))
    return lay


# ---------------------------------------------------------------- configs for llmsplit train

def layout_config(source: Config | None, name: str, model: LlamaConfig, layout: Layout, work: Workload) -> Config:
    """A training config that runs `layout` (a copy of `source` when planning from one)."""
    cfg = load_config(None) if source is None else copy.deepcopy(source)
    if source is None:
        if name in PRESETS:
            cfg.model.preset = name
        else:
            for key, value in model.to_dict().items():
                if hasattr(cfg.model, key):
                    setattr(cfg.model, key, value)
    cfg.data.seq_len = work.seq_len
    cfg.train.global_batch = work.global_batch
    cfg.train.micro_batch = layout.micro_batch
    cfg.train.precision = work.precision
    par = cfg.parallel
    par.dp, par.dp_replicate, par.zero, par.tp, par.pp = layout.dp, layout.dp_replicate, layout.zero, layout.tp, layout.pp
    par.cp, par.cp_mode = layout.cp, layout.cp_mode
    par.sequence_parallel = layout.sp if layout.tp > 1 else None
    par.pp_schedule, par.pp_virtual_stages, par.pp_microbatches = (layout.pp_schedule, layout.pp_virtual_stages,
                                                                   layout.pp_microbatches)
    cfg.memory.activation_checkpoint, cfg.memory.offload = layout.activation_checkpoint, layout.offload
    return cfg


def runnable(cfg: Config, model_cfg: LlamaConfig, layout: Layout, world: int) -> bool:
    """Does `llmsplit train` accept this training config with `layout` instead of its own?"""
    return accepts(model_cfg, layout, workload_of(cfg), world)


def emit_config(model, gpus: int, gpu: str = "cpu", path: str | Path = "plan.toml", **kwargs) -> tuple[Path, dict]:
    """Write the fastest fitting layout that `llmsplit train` runs as a TOML file."""
    report = plan_report(model, gpus, gpu, **kwargs)
    best = report["best_runnable"]
    if best is None:
        raise ConfigError(f"no layout that this version of llmsplit train runs fits on {gpus} × {gpu}; "
                          f"{report['advice'] or 'see the plan for the reasons'}")
    cfg_model, name, source = resolve_model(model, kwargs.get("tokenizer_vocab"), tuple(kwargs.get("sets", ())))
    lay = Layout(**{k: v for k, v in best["layout"].items()})
    w = report["workload"]
    work = Workload(**{k: w[k] for k in ("seq_len", "global_batch", "precision", "mode", "lora_rank", "lora_targets",
                                           "lora_base")
                       if k in w})
    cfg = layout_config(source, name, cfg_model, lay, work)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(cfg))
    hw = report["hardware"]
    train = f"llmsplit train --config {shlex.quote(str(out))} --nproc {hw['gpus_per_node']}"
    if hw["nodes"] > 1:  # one command per machine (docs/multinode.md)
        train += f" --nnodes {hw['nodes']} --node-rank R --master-addr NODE0 --master-port 29500"
    report["next_step"] = {"why": f"wrote {out}", "steps": [{"command": train, "what": "train it" + (
        f" (on each node, R = 0..{hw['nodes'] - 1})" if hw["nodes"] > 1 else "")}]}
    return out, report


# ---------------------------------------------------------------- the trainer's self-check

def predict_for_config(cfg: Config, model_cfg: LlamaConfig, world_size: int, device: Device) -> dict:
    """The plan's prediction for one resolved training config on `device` (for the local
    machine: `diagnose.probe.local_device`): memory per device term by term (the fullest
    pipeline stage), step time, tokens/s and MFU. For `llmsplit train` to record next to
    what it measured."""
    layout, work = layout_of(cfg, world_size), workload_of(cfg)
    check(model_cfg, layout, work, world_size)
    cand = evaluate(model_cfg, layout, work, device)
    mem_bd = cand.memory
    return {"gpu": device.name, "layout": layout.to_dict(), "fits": cand.fits,
            "memory_per_device": mem_bd.to_dict(), "model_state_bytes": mem_bd.params + mem_bd.grads + mem_bd.optimizer,
            "host_bytes_per_device": mem_bd.host, "stage": mem_bd.stage,
            "step_time_s": cand.cost.step_time_s, "tokens_per_s": cand.cost.tokens_per_s, "mfu": cand.cost.mfu}


# ---------------------------------------------------------------- llmsplit train --auto

def auto_config(cfg: Config, model_cfg: LlamaConfig, world_size: int, device: Device):
    """`cfg` with the [parallel]/[memory] keys and train.micro_batch of the fastest layout
    that fits `device` (within memory.limit_bytes when set) and that `llmsplit train` runs,
    and that layout's plan entry (a search.Candidate)."""
    if cfg.memory.limit_bytes is not None:
        device = replace(device, memory_bytes=min(device.memory_bytes, cfg.memory.limit_bytes))
    work = workload_of(cfg)
    result = search(model_cfg, work, world_size, device)
    if cfg.train.objective == "dpo":  # what config/checks.py refuses DPO with; the layout rules see no objective
        result["runnable"] = [c for c in result["runnable"]
                              if c.layout.cp == 1 and c.layout.pp_schedule not in SPLIT_BACKWARD_SCHEDULES]
    if not result["runnable"]:
        raise ConfigError(f"--auto: no layout that llmsplit train runs fits {world_size} × {device.name}; "
                          f"{result['advice'] or 'see llmsplit plan for the reasons'}")
    best = result["runnable"][0]
    chosen = layout_config(cfg, "custom", model_cfg, best.layout, work)
    return chosen, best
