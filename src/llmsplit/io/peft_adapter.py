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

from ..adapters.lora import TARGETS
from ..errors import ConfigError
from ..models.hf_names import FUSED
from ..models.weight_shapes import parameter_shapes
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
    from . import dcp_files
    from .weights import read_adapters

    path = Path(init)
    check_init(init, lora)
    if is_peft_folder(path):
        found = read_peft(path, model_cfg, f"lora.init={init!r}")[0]
        missing = [_peft_key(name, model_cfg) for name in names if name not in found]
        if missing:
            raise ConfigError(f"lora.init={init!r} lacks {missing[0]} (and {len(missing) - 1} more) that "
                              f"lora.targets={lora.targets!r} trains; set lora.targets to the adapter's modules")
        return {name: found[name] for name in names}
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
    if is_peft_folder(path):
        config = peft_config(path, f"lora.init={init!r}")
        found = (config["r"], float(config["lora_alpha"]))
        if found != (lora.rank, float(lora.alpha)):
            raise ConfigError(f"lora.init={init!r} is an adapter of r={found[0]}, lora_alpha={found[1]:g}; set "
                              f"lora.rank and lora.alpha to those")
        return
    cfg = read_run_config(resolve_checkpoint(path)[0])
    if (cfg.lora.rank, cfg.lora.alpha) != (lora.rank, lora.alpha):
        raise ConfigError(f"lora.init={init!r} is a run with lora.rank={cfg.lora.rank}, lora.alpha={cfg.lora.alpha:g}; "
                          f"set the [lora] keys to those")


def is_peft_folder(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


# adapter_config.json keys whose other values change what the adapter computes, and what
# llmsplit computes (plain LoRA: W + lora_alpha / r * B @ A on whole linear layers).
_PLAIN = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {},
          "alpha_pattern": {}, "modules_to_save": None}


def peft_config(folder: Path, what: str) -> dict:
    """The adapter_config.json of a PEFT LoRA folder, refused in one sentence where it asks for
    something other than plain LoRA (DoRA, rsLoRA, rank or alpha patterns, trained biases or
    whole modules), which the merge and the served adapters would compute differently."""
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ConfigError(f"{what}: adapter_config.json is not a PEFT LoRA adapter's config (it needs \"r\" and "
                          f"\"lora_alpha\"); pass a folder that PEFT's save_pretrained wrote") from None
    if config.get("peft_type", "LORA") != "LORA" or rank < 1:
        raise ConfigError(f"{what}: adapter_config.json is a {config.get('peft_type')} adapter of r={rank}; llmsplit "
                          f"applies LoRA adapters (peft_type LORA, r >= 1) only")
    for key, plain in _PLAIN.items():
        if config.get(key, plain) not in (plain, None, {}, []):
            raise ConfigError(f"{what}: adapter_config.json sets {key}={config[key]!r}, which llmsplit does not "
                              f"apply (plain LoRA only: {key}={plain!r}); merge the adapter with PEFT's "
                              f"merge_and_unload and pass the merged model instead")
    config["r"], config["lora_alpha"] = rank, alpha
    return config


def read_peft(folder: str | Path, model_cfg, what: str) -> tuple[dict, float]:
    """A PEFT LoRA adapter folder's adapters by our names ({"layers.3.attention.wq.lora_a": A,
    ...}, float32 on the CPU) and their scale lora_alpha / r, each checked against `model_cfg`
    (the base it is applied to): only the projections [lora] can target, every A [r, in] and
    B [out, r] of that base's layer. `what`: the key or flag that named the folder."""
    import torch
    from safetensors import safe_open

    from ..models.hf_names import from_hf_name

    folder = Path(folder)
    config = peft_config(folder, what)
    rank = config["r"]
    if model_cfg.family in FUSED:
        raise ConfigError(f"{what}: {model_cfg.family} stores q/k/v (and gate/up) fused, which PEFT adapts as one "
                          f"module and llmsplit does not; merge the adapter with PEFT and pass the merged model")
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        raise ConfigError(f"{what}: {str(folder)!r} has no adapter_model.safetensors (llmsplit reads no pickled "
                          f"adapter_model.bin); save the adapter with PEFT's save_pretrained(safe_serialization=True)")
    found = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            module, _, which = key.removeprefix("base_model.model.").rpartition(".lora_")
            layer = from_hf_name(f"{module}.weight", model_cfg) if which in ("A.weight", "B.weight") else None
            if layer is None or not layer.endswith(_TARGET_WEIGHTS):
                raise ConfigError(f"{what}: its tensor {key} adapts no q/k/v/o/gate/up/down projection; pass an "
                                  f"adapter of those modules only")
            found[f"{layer[:-len('.weight')]}.lora_{which[0].lower()}"] = f.get_tensor(key).to(torch.float32)
    check_fit(found, model_cfg, rank, what)
    return found, config["lora_alpha"] / rank


def peft_base(folder: str | Path, what: str) -> Path:
    """The base model a PEFT folder adapts: its adapter_config.json's base_model_name_or_path,
    a local folder or GGUF file (absolute, or relative to the working directory), or a
    Hugging Face hub name already in this machine's cache (looked up offline: no download)."""
    name = peft_config(Path(folder), what).get("base_model_name_or_path") or ""
    if name and Path(name).exists():
        if is_peft_folder(name) and not (Path(name) / "config.json").is_file():
            raise ConfigError(f"{what}: its base_model_name_or_path={name!r} is another adapter, not a model; set "
                              f"it to the base model's folder or .gguf file")
        return Path(name)
    if name.count("/") == 1:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:  # not cached (or no huggingface_hub): refused below  # noqa: BLE001
            pass
    raise ConfigError(f"{what}: its adapter_config.json names base_model_name_or_path={name!r}, which is neither a "
                      f"local model nor in the Hugging Face cache; set it to the base model's folder or .gguf "
                      f"file, or serve the base as --model with --lora NAME={folder}")


_TARGET_WEIGHTS = tuple(f".{t}.weight" for t in TARGETS.values())


def check_fit(adapters: dict, model_cfg, rank: int, what: str) -> None:
    """Refuse adapters that do not fit the base `model_cfg` they are applied to: each A
    [rank, in] and B [out, rank] of one of its layers' q/k/v/o/gate/up/down projections."""
    shapes = dict(parameter_shapes(model_cfg))
    for name, t in adapters.items():
        layer, which = name.rsplit(".", 1)
        shape = shapes.get(f"{layer}.weight") if f"{layer}.weight".endswith(_TARGET_WEIGHTS) else None
        want = None if shape is None else (rank, shape[1]) if which == "lora_a" else (shape[0], rank)
        other = f"{layer}.lora_{'b' if which == 'lora_a' else 'a'}"
        if want is None or tuple(t.shape) != want or other not in adapters:
            needs = (f"needs {list(want)} (and both A and B)" if want else
                     f"has no such dense projection ({model_cfg.n_layers} layers)")
            raise ConfigError(f"{what}: its adapter {name} is {list(t.shape)} where this base (r={rank}) {needs}; "
                              f"pass an adapter trained on this base model")


def _peft_key(name: str, model_cfg) -> str:
    layer, which = name.rsplit(".", 1)
    return f"base_model.model.{to_hf_name(f'{layer}.weight', model_cfg)[:-len('.weight')]}.lora_{which[-1].upper()}.weight"
