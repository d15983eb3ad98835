"""The planner's entry points: a report for `llmsplit plan`, the prediction for one
training config (for the trainer's self-check), and a runnable config for a layout."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..config import Config, ConfigError, load_config, model_config, to_toml, validate
from ..models.llama import LlamaConfig
from ..models.presets import PRESETS, preset_config
from .hardware import Device, get_device
from .layout import Layout, Workload, check_layout, parse_layout, PRECISIONS
from .search import evaluate, search

# Hugging Face config.json keys of the Llama family → our sizes.
_HF_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
            "num_key_value_heads": "n_kv_heads", "vocab_size": "vocab_size", "intermediate_size": "ffn_dim",
            "max_position_embeddings": "max_seq_len", "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps",
            "tie_word_embeddings": "tie_embeddings"}


def resolve_model(model, tokenizer_vocab: int | None = None) -> tuple[LlamaConfig, str, Config | None]:
    """A preset name, a Hugging Face folder, a training config file, or a LlamaConfig."""
    if isinstance(model, LlamaConfig):
        return model, "custom", None
    text = str(model)
    if text in PRESETS:
        return preset_config(text), text, None
    path = Path(text)
    if path.suffix == ".toml":
        cfg = load_config(path)  # a missing or unparsable file is a ConfigError
        return model_config(cfg, tokenizer_vocab), str(path), cfg
    if path.is_dir() and (path / "config.json").is_file():
        try:
            raw = json.loads((path / "config.json").read_text())
            sizes = {ours: raw[hf] for hf, ours in _HF_KEYS.items() if hf in raw}
            sizes["qkv_bias"] = bool(raw.get("attention_bias", raw.get("model_type") == "qwen2"))
            return LlamaConfig(**sizes), str(path), None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"--model {text!r}: config.json is not a Llama-family config ({e})") from None
    raise ConfigError(f"--model {text!r} is not a known preset, a Hugging Face folder or a .toml config; "
                      f"presets: {', '.join(PRESETS)}")


def plan_report(model, gpus: int, gpu: str = "H100-80GB", nodes: int | None = None, seq_len: int | None = None,
                global_batch: int | None = None, mode: str = "train", layout: str | Layout | None = None,
                top: int = 5, precision: str | None = None, tokenizer_vocab: int | None = None) -> dict:
    """Everything `llmsplit plan` prints, as one JSON-ready dict (best layout first)."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    if top < 1:
        raise ConfigError(f"--top {top} must be at least 1")
    if mode not in ("train", "infer"):
        raise ConfigError(f"--mode {mode!r} is not one of: 'train', 'infer'")
    if nodes is not None and (nodes < 1 or gpus % nodes):
        raise ConfigError(f"--nodes {nodes} must be at least 1 and divide --gpus {gpus}")
    cfg_model, name, source = resolve_model(model, tokenizer_vocab)
    per_node = gpus // nodes if nodes else None
    device = get_device(gpu, workers_per_node=per_node or gpus)
    if per_node is None:
        per_node = min(gpus, device.gpus_per_node)
    device = replace(device, gpus_per_node=per_node) if device.kind != "cpu" else device
    work = _workload(cfg_model, source, gpus, device, seq_len, global_batch, mode, precision)
    fixed = _fixed_layout(layout, gpus)
    runnable = (lambda lay: _runnable(source, name, cfg_model, lay, work, gpus)) if mode == "train" else None
    result = search(cfg_model, work, gpus, device, fixed, runnable)
    cands = result["candidates"]
    shown = cands[:top]
    return {
        "model": {"name": name, "params": cfg_model.num_params(), **cfg_model.to_dict()},
        "hardware": {"gpu": device.name, "count": gpus, "nodes": -(-gpus // per_node), "gpus_per_node": per_node,
                     **{k: v for k, v in device.to_dict().items() if k not in ("name", "gpus_per_node")}},
        "workload": {"mode": work.mode, "seq_len": work.seq_len, "global_batch": work.global_batch,
                     "precision": work.precision},
        "considered": len(cands), "fitting": sum(c.fits for c in cands),
        "advice": result["advice"],
        "layouts": [c.to_dict() for c in shown],
        "best_runnable": result["runnable"][0].to_dict() if result["runnable"] else None,
    }


def _workload(cfg: LlamaConfig, source: Config | None, gpus: int, device: Device, seq_len, global_batch, mode,
              precision) -> Workload:
    if precision is None:
        precision = source.train.precision if source else ("fp32" if device.kind == "cpu" else "bf16")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r} is not one of: {', '.join(map(repr, PRECISIONS))}")
    if seq_len is None:
        seq_len = source.data.seq_len if source else min(cfg.max_seq_len, 2048 if mode == "train" else 8192)
    if global_batch is None:
        if source:
            global_batch = source.train.global_batch
        else:
            global_batch = 4 * gpus if mode == "train" else 1
    for flag, value in (("--seq-len", seq_len), ("--global-batch", global_batch)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if seq_len > cfg.max_seq_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    return Workload(seq_len=seq_len, global_batch=global_batch, precision=precision, mode=mode)


def _fixed_layout(layout, gpus: int) -> Layout | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    lay = parse_layout(layout)
    explicit_dp = any(item.split("=")[0].strip().split(".")[-1] == "dp" for item in layout.split(","))
    if not explicit_dp:
        if gpus % (lay.tp * lay.pp):
            raise ConfigError(f"--layout tp × pp = {lay.tp}×{lay.pp} does not divide --gpus {gpus}")
        lay = replace(lay, dp=gpus // (lay.tp * lay.pp))
    return lay


# ---------------------------------------------------------------- configs for llmsplit train

def layout_config(source: Config | None, name: str, model: LlamaConfig, layout: Layout, work: Workload) -> Config:
    """A training config that runs `layout` (a copy of `source` when planning from one)."""
    cfg = load_config(None) if source is None else Config(**{k: replace(v) for k, v in vars(source).items()})
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
    par.sequence_parallel = layout.sp if layout.tp > 1 else None
    par.pp_schedule, par.pp_virtual_stages, par.pp_microbatches = (layout.pp_schedule, layout.pp_virtual_stages,
                                                                   layout.pp_microbatches)
    cfg.memory.activation_checkpoint, cfg.memory.offload = layout.activation_checkpoint, layout.offload
    return cfg


def _runnable(source, name, model, layout: Layout, work: Workload, world: int) -> bool:
    """Does this version of `llmsplit train` accept the layout (its own validate())?"""
    cfg = layout_config(source, name, model, layout, work)
    try:
        validate(cfg, world, model_config(cfg))
    except ConfigError:
        return False
    return True


def runnable(cfg: Config, model_cfg: LlamaConfig, layout: Layout, world: int) -> bool:
    """Does `llmsplit train` accept this training config with `layout` instead of its own?"""
    return _runnable(cfg, "custom", model_cfg, layout, workload_of_config(cfg), world)


def emit_config(model, gpus: int, gpu: str = "cpu", path: str | Path = "plan.toml", **kwargs) -> tuple[Path, dict]:
    """Write the fastest fitting layout that `llmsplit train` runs as a TOML file."""
    report = plan_report(model, gpus, gpu, **kwargs)
    best = report["best_runnable"]
    if best is None:
        raise ConfigError(f"no layout that this version of llmsplit train runs fits on {gpus} × {gpu}; "
                          f"{report['advice'] or 'see the plan for the reasons'}")
    cfg_model, name, source = resolve_model(model, kwargs.get("tokenizer_vocab"))
    lay = Layout(**{k: v for k, v in best["layout"].items()})
    w = report["workload"]
    work = Workload(seq_len=w["seq_len"], global_batch=w["global_batch"], precision=w["precision"], mode=w["mode"])
    cfg = layout_config(source, name, cfg_model, lay, work)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(cfg))
    return out, report


# ---------------------------------------------------------------- the trainer's self-check

def layout_of_config(cfg: Config, world_size: int) -> Layout:
    """The layout a training config runs (sequence parallel left to its default when the
    config has the default, so that changing tp keeps the default)."""
    par, mem = cfg.parallel, cfg.memory
    dp = par.dp if par.dp > 0 else world_size // (par.tp * par.pp)
    sp = None if par.sequence_parallel in (None, par.tp > 1) else par.sequence_parallel
    return Layout(dp=dp, dp_replicate=par.dp_replicate, zero=par.zero, tp=par.tp,
                  sequence_parallel=sp, pp=par.pp, pp_schedule=par.pp_schedule,
                  pp_virtual_stages=par.pp_virtual_stages, pp_microbatches=par.pp_microbatches,
                  micro_batch=cfg.train.micro_batch, activation_checkpoint=mem.activation_checkpoint,
                  offload=mem.offload)


def workload_of_config(cfg: Config) -> Workload:
    return Workload(seq_len=cfg.data.seq_len, global_batch=cfg.train.global_batch, precision=cfg.train.precision)


def predict_for_config(cfg: Config, model_cfg: LlamaConfig, world_size: int, gpu: str | Device = "cpu",
                       workers_per_node: int | None = None) -> dict:
    """The plan's prediction for one resolved training config: memory per device term by
    term (the fullest pipeline stage), step time, tokens/s and MFU. For `llmsplit train`
    to record next to what it measured."""
    layout, work = layout_of_config(cfg, world_size), workload_of_config(cfg)
    check_layout(model_cfg, layout, work, world_size)
    device = get_device(gpu, workers_per_node=workers_per_node or world_size)
    cand = evaluate(model_cfg, layout, work, device)
    mem_bd = cand.memory
    return {"gpu": device.name, "layout": layout.to_dict(), "fits": cand.fits,
            "memory_per_device": mem_bd.to_dict(), "model_state_bytes": mem_bd.params + mem_bd.grads + mem_bd.optimizer,
            "host_bytes_per_device": mem_bd.host, "stage": mem_bd.stage,
            "step_time_s": cand.cost.step_time_s, "tokens_per_s": cand.cost.tokens_per_s, "mfu": cand.cost.mfu}


# ---------------------------------------------------------------- llmsplit train --auto

def auto_config(cfg: Config, model_cfg: LlamaConfig, world_size: int, device: Device) -> tuple[Config, dict]:
    """`cfg` with the [parallel]/[memory] keys and train.micro_batch of the fastest layout
    that fits `device` (within memory.limit_bytes when set) and that `llmsplit train` runs,
    and that layout's plan entry."""
    if cfg.memory.limit_bytes is not None:
        device = replace(device, memory_bytes=min(device.memory_bytes, cfg.memory.limit_bytes))
    work = workload_of_config(cfg)
    result = search(model_cfg, work, world_size, device,
                    runnable=lambda lay: _runnable(cfg, "custom", model_cfg, lay, work, world_size))
    if not result["runnable"]:
        raise ConfigError(f"--auto: no layout that llmsplit train runs fits {world_size} × {device.name}; "
                          f"{result['advice'] or 'see llmsplit plan for the reasons'}")
    best = result["runnable"][0]
    chosen = layout_config(cfg, "custom", model_cfg, best.layout, work)
    return chosen, best.to_dict()
