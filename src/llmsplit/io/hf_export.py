"""Hugging Face folders out: a training checkpoint becomes a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads with the same logits.

Names go through the same table as the reader (`hf.to_hf_name`), config.json keys through
the same table as the parser (`models.hf_config.config_to_hf`). The tokenizer files,
chat template and end-of-sequence ids are the run's copies of its source's. The built-in byte
tokenizer is written as an equivalent `tokenizer.json` (a byte-level BPE with no merges
whose ids are the byte values), so the exported folder is complete either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import ConfigError
from ..models.hf_config import UnsupportedHFConfig, config_to_hf
from ..models.hf_names import expert_names, norm_offset
from .hf import to_hf_name
from .tokenizer import ByteTokenizer, copy_tokenizer_files

DEFAULT_SHARD_BYTES = 5 * 2**30  # what transformers' save_pretrained uses


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table, which the `tokenizers` ByteLevel steps use: printable
    bytes map to themselves, the others to characters from U+0100 on."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """Our byte tokenizer as a `tokenizers` pipeline: ByteLevel turns each byte into one
    character, a BPE without merges gives that character the byte's value as its id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = ByteTokenizer()
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab["<s>"], vocab["</s>"] = tok.bos_id, tok.eos_id
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<s>", "</s>"])
    return t.to_str()


def export_hf(source: str | Path, out: str | Path, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict:
    """Write `out` from a run folder or checkpoint. Returns a short description."""
    from safetensors.torch import save_file

    from .weights import RunWeights

    out = Path(out)
    if not Path(source).exists():
        raise ConfigError(f"--checkpoint {str(source)!r} does not exist; pass a run folder or one of its checkpoints")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"output {str(out)!r} exists and is not an empty folder; choose a new folder")
    weights = RunWeights(source)
    cfg = weights.config
    if cfg.router_bias:
        raise ConfigError("this run trained with train.moe_bias_rate (a per-expert router bias), which Mixtral and "
                          "Qwen3-MoE checkpoints have no tensor for; export a run trained with train.moe_bias_rate=0")
    parts: dict[str, list[torch.Tensor]] = {}
    for name in weights.names():
        if cfg.tie_embeddings and name == "output.weight":
            continue  # transformers re-ties lm_head to the embedding
        experts = expert_names(cfg, name)
        if experts is not None:  # our stack of experts: one tensor per expert, as transformers names them
            parts.update({hf: [t] for hf, t in zip(experts, weights.read(name))})
            continue
        parts.setdefault(to_hf_name(name, cfg), []).append(weights.read(name) - norm_offset(cfg, name))
    # A family that fuses q/k/v (gate/up) gets the parts as rows of one tensor, in our order.
    tensors = {hf: torch.cat(ts).contiguous() for hf, ts in parts.items()}
    tok = weights.tokenizer
    # Every id that ends a turn, as the model the run started from names them (an instruct
    # model's <|im_end|>, not only its tokenizer's end of text): without them generate,
    # serve and transformers run past the answer into an invented next turn.
    eos = sorted(weights.eos_ids)
    eos = eos[0] if len(eos) == 1 else (eos or None)
    try:  # before anything is written: a config transformers cannot build leaves no half folder
        hf_config = config_to_hf(cfg, tok.bos_id, eos, next(iter(tensors.values())).dtype)
    except UnsupportedHFConfig as e:
        raise ConfigError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "eos_token_id": eos}, indent=1))
    write_tokenizer(tok, out)
    return {"tensors": len(tensors), "files": len(shards), "params": cfg.num_params(), "out": str(out)}


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    return shards + [current] if current else shards


def write_tokenizer(tok, out: Path) -> None:
    if isinstance(tok, ByteTokenizer):
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        special = {"bos_token": "<s>", "eos_token": "</s>"}
    else:  # the run's copy of the tokenizer files, chat template included
        copy_tokenizer_files(tok.name, out)
        if (out / "tokenizer_config.json").is_file():
            return
        special = {}
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}, indent=1))
