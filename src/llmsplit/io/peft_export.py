"""LoRA adapters out as a PEFT adapter folder: `adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained` loads onto the
transformers model of the run's base (`model.hf`), plus the run's tokenizer files.

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
    if not cfg.model.hf:
        raise ConfigError(f"--to peft: run {str(run_dir)!r} adapted random weights (no model.hf), which no Hugging "
                          f"Face model holds; export it merged with --to hf")
    tok = run_tokenizer(run_dir, cfg)[0]  # the run's own copy of its tokenizer files
    model_cfg = model_config(cfg, tok.vocab_size)
    if model_cfg.family in FUSED:
        raise ConfigError(f"--to peft: {model_cfg.family} stores q/k/v (and gate/up) fused, which PEFT adapts as one "
                          f"module; export the run merged with --to hf")
    adapters = read_adapters(cfg, ck, dcp_files.saved_model_shapes(dcp_files.read_metadata(ck)))
    tensors, modules = {}, set()
    for name, t in adapters.items():
        layer, which = name.rsplit(".", 1)
        hf = to_hf_name(f"{layer}.weight", model_cfg)[:-len(".weight")]
        tensors[f"base_model.model.{hf}.lora_{which[-1].upper()}.weight"] = t.contiguous()
        modules.add(hf.rsplit(".", 1)[-1])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.model.hf,
              "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
              "target_modules": sorted(modules), "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
              "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(tok, out)
    return {"tensors": len(tensors), "files": 1, "params": sum(t.numel() for t in tensors.values()), "out": str(out)}
