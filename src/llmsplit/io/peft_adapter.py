"""LoRA adapters out as a PEFT adapter folder (`adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads onto the
transformers model of the run's base, `model.hf`, plus the run's tokenizer files), and in:
`lora.init` continues training from such a folder, or from another LoRA run's adapters.

Names: our `layers.3.attention.wq.lora_a` is PEFT's
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (the module name from the same
table as the Hugging Face export, `hf.to_hf_name`); A and B keep their shapes ([rank, in] and
[out, rank]); `lora_alpha` / `r` is the same scale.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError
from ..models.hf_names import FUSED
from .hf import to_hf_name
from .run_dir import read_run_config, resolve_checkpoint, run_tokenizer


def export_peft(source: str | Path, out: str | Path) -> dict:
    from safetensors.torch import save_file

    from ..config import model_config
    from . import dcp_files
    from .hf_export import write_tokenizer
    from .weights import read_adapters

    out = Path(out)
    if not Path(source).exists():
        raise ConfigError(f"--checkpoint {str(source)!r} does not exist; pass a run folder or one of its checkpoints")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {str(out)!r} exists and is not an empty folder; choose a new folder")
    run_dir, ck = resolve_checkpoint(source)
    cfg = read_run_config(run_dir)
    if not cfg.lora.rank:
        raise ConfigError(f"--to peft: run {str(run_dir)!r} trained every parameter, not LoRA adapters; "
                          f"export it with --to hf")
    if not (cfg.model.hf or cfg.model.gguf):
        raise ConfigError(f"--to peft: run {str(run_dir)!r} adapted random weights (no model.hf or model.gguf), "
                          f"which no Hugging Face model holds; export it merged with --to hf")
    tok = run_tokenizer(run_dir, cfg)[0]  # the run's own copy of its tokenizer files
    model_cfg = model_config(cfg, tok.vocab_size)
    if model_cfg.family in FUSED:
        raise ConfigError(f"--to peft: {model_cfg.family} stores q/k/v (and gate/up) fused, which PEFT adapts as one "
                          f"module; export the run merged with --to hf")
    adapters = read_adapters(cfg, ck, dcp_files.saved_model_shapes(dcp_files.read_metadata(ck)))
    tensors, modules = {}, set()
    for name, t in adapters.items():
        layer, which = name.rsplit(".", 1)
        tensors[_peft_key(name, model_cfg)] = t.contiguous()
        modules.add(to_hf_name(f"{layer}.weight", model_cfg).split(".")[-2])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.model.hf or cfg.model.gguf,
              "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
              "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(tok, out)
    return {"tensors": len(tensors), "files": 1, "params": sum(t.numel() for t in tensors.values()), "out": str(out)}


def initial_adapters(init: str, lora, model_cfg, names: list[str]) -> dict:
    """The adapters `lora.init` names, by our parameter names (`names`: the model's adapters):
    a PEFT adapter folder, or a LoRA run (its newest checkpoint) or one of its checkpoints."""
    import torch

    from . import dcp_files
    from .weights import read_adapters

    path = Path(init)
    check_init(init, lora)
    if (path / "adapter_config.json").is_file():
        from safetensors.torch import load_file

        found = load_file(str(path / "adapter_model.safetensors"))
        keys = {name: _peft_key(name, model_cfg) for name in names}
        missing = [k for k in keys.values() if k not in found]
        if missing:
            raise ConfigError(f"lora.init={init!r} lacks {missing[0]} (and {len(missing) - 1} more) that "
                              f"lora.targets={lora.targets!r} trains; set lora.targets to the adapter's modules")
        return {name: found[key].to(torch.float32) for name, key in keys.items()}
    run_dir, ck = resolve_checkpoint(path)
    cfg = read_run_config(run_dir)
    saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(ck))
    if set(saved) != set(names):
        raise ConfigError(f"lora.init={init!r} trained other adapters (lora.rank={cfg.lora.rank}, alpha={cfg.lora.alpha}, "
                          f"targets={cfg.lora.targets!r}); set the [lora] keys to those")
    return read_adapters(cfg, ck, saved)


def check_init(init: str, lora) -> None:
    """Refuse, before any worker starts, a `lora.init` of another rank or scale than [lora]'s."""
    path = Path(init)
    if (path / "adapter_config.json").is_file():
        try:
            config = json.loads((path / "adapter_config.json").read_text())
            found = (config.get("r"), float(config.get("lora_alpha", 0)))
        except (ValueError, TypeError, AttributeError):
            raise ConfigError(f"lora.init={init!r}: adapter_config.json is not a PEFT adapter's config") from None
        if found != (lora.rank, float(lora.alpha)):
            raise ConfigError(f"lora.init={init!r} is an adapter of r={found[0]}, lora_alpha={found[1]:g}; set "
                              f"lora.rank and lora.alpha to those")
        return
    cfg = read_run_config(resolve_checkpoint(path)[0])
    if (cfg.lora.rank, cfg.lora.alpha) != (lora.rank, lora.alpha):
        raise ConfigError(f"lora.init={init!r} is a run with lora.rank={cfg.lora.rank}, lora.alpha={cfg.lora.alpha:g}; "
                          f"set the [lora] keys to those")


def _peft_key(name: str, model_cfg) -> str:
    layer, which = name.rsplit(".", 1)
    return f"base_model.model.{to_hf_name(f'{layer}.weight', model_cfg)[:-len('.weight')]}.lora_{which[-1].upper()}.weight"
