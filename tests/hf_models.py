"""Tiny Hugging Face model folders built in the tests with `transformers` (random weights)
and a byte-level BPE tokenizer trained with `tokenizers` on Python's own documentation."""

from __future__ import annotations

from pathlib import Path

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
# The tiny mixture-of-experts configurations (4 experts, 2 per token) of the MoE and GGUF tests.
MOE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
       "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "head_dim": 24,
                     "norm_topk_prob": False}}


def train_tokenizer(vocab_size: int = 320):
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = list(topics.values())[:40]
    tok.train_from_iterator(text, trainer)
    return tok


def make_hf_folder(path: Path, arch: str = "llama", tie: bool = False, seed: int = 0, **overrides) -> Path:
    import torch
    import transformers

    tok = train_tokenizer()
    kw = {**SMALL, "vocab_size": tok.get_vocab_size(), "tie_word_embeddings": tie, "bos_token_id": 0,
          "eos_token_id": 1, **overrides}  # vocab_size may exceed the tokenizer's, as in many checkpoints
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).float().eval()
    with torch.no_grad():  # norms and biases start at 1 and 0; make them count in the comparison
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def transformers_loss(folder, step: int = 0) -> float:
    """The mean next-token loss transformers computes on llmsplit's global batch of `step`."""
    import torch

    from llmsplit.data.corpus import load_tokens
    from llmsplit.data.loader import BatchSampler
    from llmsplit.io.tokenizer import load_tokenizer

    tok = load_tokenizer(str(folder))
    batch = BatchSampler(load_tokens("builtin", tok), 32, 8, 0).rank_batch(step, 0, 1)
    with torch.no_grad():
        logits = hf_model(folder)(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def greedy_tokens(m, prompt: list[int], n: int = 8) -> list[int]:
    """`n` greedy tokens of a loaded model (`llmsplit.load`) after `prompt`, EOS ignored."""
    from llmsplit.infer.engine import SamplingParams

    seq = m.engine.new_sequence(prompt, SamplingParams(n, ignore_eos=True))
    m.engine.generate([seq])
    return seq.tokens


def merge_peft_adapter(model, adapter_dir: Path, scale: float):
    """`model` (transformers) with a PEFT LoRA export merged in the way PEFT merges it:
    W += scale · B @ A for every adapted module (peft itself is a benchmark-only peer)."""
    import torch
    from safetensors.torch import load_file

    adapter = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    with torch.no_grad():
        for key, a in adapter.items():
            if ".lora_A." in key:
                module = model.get_submodule(key[len("base_model.model."):].split(".lora_A.")[0])
                module.weight += scale * adapter[key.replace("lora_A", "lora_B")] @ a
    return model


def make_peft_folder(out: Path, base: Path, modules: tuple[str, ...], rank: int, seed: int = 0) -> Path:
    """A PEFT LoRA adapter folder for the Hugging Face folder `base` (adapter_config.json and
    adapter_model.safetensors as PEFT's save_pretrained writes them), random A and B of `rank`
    on each of its layers' `modules` (e.g. "q_proj"), lora_alpha = 2 * rank."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(str(Path(base) / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith(".weight") and name.split(".")[-2] in modules:
                out_f, in_f = f.get_slice(name).get_shape()
                key = f"base_model.model.{name[:-len('.weight')]}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.2
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
        "lora_alpha": 2 * rank, "target_modules": sorted(modules), "bias": "none", "use_dora": False}))
    return out
