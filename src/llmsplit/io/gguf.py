"""GGUF files in (as llama.cpp and Ollama run them), through the `gguf` package.

The file is memory-mapped (`gguf_header`); each tensor is converted only when read (kept
packed, or dequantized to float32), so a layer offloaded to disk or owned by another rank
costs nothing here, and its pages leave the resident set once converted. llama.cpp stores
q/k weights permuted for its interleaved rotary layout; they are permuted back to the
Hugging Face "rotate half" layout our model uses. The tokenizer is rebuilt from the
file's metadata with the `tokenizers` library.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..models.llama import LlamaConfig
from ..models.weight_shapes import shape_mismatch, structure_problem

# Mistral and Mixtral GGUFs use the llama architecture (Mixtral with expert_count set).
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
# Quantization types dequantized through gguf.quants (plain floats, legacy and K-quants).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_LAYER = {
    "attn_norm.weight": "attention_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q.weight": "attention.wq.weight", "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight", "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias", "attn_v.bias": "attention.wv.bias",
    "attn_output.weight": "attention.wo.weight", "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight", "ffn_down.weight": "feed_forward.w2.weight",
    "attn_q_norm.weight": "attention.q_norm.weight", "attn_k_norm.weight": "attention.k_norm.weight",
    # Mixture of experts: the router, the experts stacked in one 3-D tensor each (ggml's
    # [in, out, experts] is our [experts, out, in]) and the shared experts.
    "ffn_gate_inp.weight": "feed_forward.router.weight", "ffn_gate_exps.weight": "feed_forward.w1",
    "ffn_up_exps.weight": "feed_forward.w3", "ffn_down_exps.weight": "feed_forward.w2",
    "ffn_gate_shexp.weight": "feed_forward.shared.w1.weight", "ffn_up_shexp.weight": "feed_forward.shared.w3.weight",
    "ffn_down_shexp.weight": "feed_forward.shared.w2.weight",
}
_TOP = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
        "output.weight": "output.weight"}
# LlamaConfig's counts and the `{architecture}.` metadata keys that hold them (default when absent).
_COUNTS = {"dim": ("embedding_length", None), "n_layers": ("block_count", None),
           "n_heads": ("attention.head_count", None), "n_kv_heads": ("attention.head_count_kv", "n_heads"),
           "ffn_dim": ("feed_forward_length", None), "max_seq_len": ("context_length", 2048)}


def from_gguf_name(name: str) -> str | None:
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def to_gguf_name(name: str) -> str:
    for g, ours in _TOP.items():
        if ours == name:
            return g
    _, i, rest = name.split(".", 2)
    return f"blk.{i}." + next(g for g, ours in _LAYER.items() if ours == rest)


def unpermute_from_gguf(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFWeights:
    """A GGUF file read tensor by tensor under our names, dequantized to float32."""

    def __init__(self, path: str | Path):
        try:
            import gguf  # noqa: F401  (its type tables and dequantization)
        except ImportError:
            raise ConfigError("reading GGUF files needs the gguf package: pip install 'llmsplit[gguf]'") from None
        from .gguf_header import GGUFHeader

        self.path = Path(path)
        try:
            self._file = GGUFHeader(str(self.path))
        except Exception as e:  # ValueError/struct errors (and bad UTF-8) for damaged files
            raise ConfigError(f"{str(self.path)!r} is not a readable GGUF file ({str(e)[:100]})") from None
        self._meta = self._file.fields
        arch = self._value("general.architecture")
        if arch not in ARCHITECTURES:
            raise ConfigError(f"{str(self.path)!r}: GGUF architecture {arch!r} is not supported; llmsplit reads "
                              f"{', '.join(ARCHITECTURES)}")
        self._tensors = {}
        self._rope_freqs = None  # llama.cpp's per-frequency divisors (Llama 3.1+ rope scaling)
        for t in self._file.tensors:
            if t.name == "rope_freqs.weight":
                self._rope_freqs = t
            ours = from_gguf_name(t.name)
            if ours is None:
                continue
            if t.tensor_type.name not in SUPPORTED_TYPES:
                raise ConfigError(f"{str(self.path)!r}: tensor {t.name} uses the quantization type "
                                  f"{t.tensor_type.name}, which llmsplit does not read; supported: "
                                  f"{', '.join(SUPPORTED_TYPES)}")
            self._tensors[ours] = t
        # llama.cpp's converter permutes llama files' q/k rows for its interleaved rotation; qwen2
        # files are read permuted as before this change (unverified against llama.cpp's Qwen2
        # converter); Qwen3 and Qwen3-MoE files keep the rotate-half rows (NEOX rotation).
        self._permuted = arch in ("llama", "qwen2")
        self.config = self._config(arch)
        found = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self._tensors.items()}
        problem = shape_mismatch(self.config, found, to_gguf_name, f"{arch}.block_count")
        if problem:  # before the tokenizer or anything else is built from the metadata
            raise ConfigError(f"{str(self.path)!r}: the GGUF metadata does not match its tensors: {problem}")
        self.dtype = torch.float32  # dequantized values; the engine casts to its compute dtype
        self.tokenizer = gguf_tokenizer(self._value, self.path)
        for key in ("tokens", "merges", "scores", "token_type"):  # now in the tokenizer; ~10 MiB of str
            self._meta.pop(f"tokenizer.ggml.{key}", None)
        eos = self._value("tokenizer.ggml.eos_token_id")
        self.eos_ids = {int(eos)} if eos is not None else set()

    def _value(self, key: str, default=None):
        return self._meta.get(key, default)

    def _config(self, arch: str) -> LlamaConfig:
        """The model config from the `{arch}.*` metadata, each value checked for its kind."""
        if "tok_embeddings.weight" not in self._tensors or len(self._tensors["tok_embeddings.weight"].shape) != 2:
            raise ConfigError(f"{str(self.path)!r} lacks the tensor token_embd.weight [embedding_length, vocabulary]")
        counts = {}
        for field, (key, default) in _COUNTS.items():
            value = self._value(f"{arch}.{key}", counts["n_heads"] if default == "n_heads" else default)
            if type(value) is not int or value < 1:  # a per-layer list (as some GGUFs have) is refused too
                raise ConfigError(f"{str(self.path)!r}: GGUF metadata {arch}.{key} is "
                                  f"{'missing' if value is None else repr(value)[:60]}; a llama GGUF holds "
                                  f"a positive integer there")
            counts[field] = value
        numbers = {}
        for field, key, default in (("rope_theta", "rope.freq_base", 10000.0),
                                    ("norm_eps", "attention.layer_norm_rms_epsilon", 1e-5)):
            value = self._value(f"{arch}.{key}", default)
            if type(value) not in (int, float) or not value > 0:
                raise ConfigError(f"{str(self.path)!r}: GGUF metadata {arch}.{key} is {repr(value)[:60]}; "
                                  f"it must be a positive number")
            numbers[field] = float(value)
        cfg = LlamaConfig(**counts, **numbers, vocab_size=int(self._tensors["tok_embeddings.weight"].shape[1]),
                          tie_embeddings="output.weight" not in self._tensors, qkv_bias=arch == "qwen2",
                          qk_norm="layers.0.attention.q_norm.weight" in self._tensors, **self._qwen3_moe_fields(arch))
        problem = structure_problem(cfg, lambda field: f"{arch}.{_COUNTS.get(field, ('attention.key_length',))[0]}")
        if problem:
            raise ConfigError(f"{str(self.path)!r}: GGUF metadata {problem}")
        cfg.rope_scaling = self._rope_scaling(lambda k, d=None: self._value(f"{arch}.{k}", d), cfg.head_dim)
        return cfg

    def _qwen3_moe_fields(self, arch: str) -> dict:
        """Qwen3's own head size and the mixture-of-experts counts, as llama.cpp writes them."""
        fields = {}
        for field, key in (("head_dim", "attention.key_length"), ("n_experts", "expert_count"),
                           ("experts_per_token", "expert_used_count"), ("moe_ffn_dim", "expert_feed_forward_length")):
            value = self._value(f"{arch}.{key}")
            if value is None:
                continue
            if type(value) is not int or value < 1:
                raise ConfigError(f"{str(self.path)!r}: GGUF metadata {arch}.{key} is {repr(value)[:60]}; it must be "
                                  f"a positive integer")
            fields[field] = value
        if not fields.get("n_experts"):
            return {k: v for k, v in fields.items() if k == "head_dim"}
        # llama.cpp renormalises the k weights of Mixtral and Qwen3-MoE unless the file says not to.
        fields["router_renorm"] = bool(self._value(f"{arch}.expert_weights_norm", True))
        shared = self._tensors.get("layers.0.feed_forward.shared.w1.weight")
        if shared is not None:  # [dim, n_shared · moe_ffn_dim] in ggml's order
            width = fields.get("moe_ffn_dim") or self._value(f"{arch}.feed_forward_length")
            fields["n_shared_experts"] = max(1, int(shared.shape[1]) // width)
        return fields

    def _rope_scaling(self, a, head_dim: int) -> str | None:
        """Rope scaling as llama.cpp stores it: a rope_freqs tensor (Llama 3.1's scaling, one
        divisor per frequency) or `rope.scaling.type` linear with its factor."""
        import json

        from gguf.quants import dequantize

        kind = a("rope.scaling.type", "none")
        factor = a("rope.scaling.factor", 1.0) or 1.0
        if type(factor) not in (int, float) or not factor > 0:
            raise ConfigError(f"{str(self.path)!r}: GGUF metadata rope.scaling.factor is {repr(factor)[:60]}; "
                              f"it must be a positive number")
        factor = float(factor)
        if kind == "linear" and factor == 1.0:
            kind = "none"
        if kind not in ("none", "linear") or (kind == "linear" and self._rope_freqs is not None):
            raise ConfigError(f"{str(self.path)!r}: rope scaling {kind!r} is not supported; llmsplit reads "
                              f"linear scaling and Llama 3's rope_freqs")
        if kind == "linear":
            return json.dumps({"rope_type": "linear", "factor": factor})
        if self._rope_freqs is None:
            return None
        t = self._rope_freqs
        divisors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)
        half_head = head_dim // 2
        if divisors.size != half_head:
            raise ConfigError(f"{str(self.path)!r}: rope_freqs holds {divisors.size} values, not one per rotary "
                              f"frequency ({half_head})")
        return json.dumps({"rope_type": "factors", "factors": [float(x) for x in divisors]})

    def names(self) -> list[str]:
        from .hf import expected_names

        return expected_names(self.config)

    def packed_kind(self, name: str) -> str | None:
        """How `read_packed` keeps `name`: "int4", "q8_0", or None (widened)."""
        from .. import quant

        t = self._tensors.get(name) or self._tensors["tok_embeddings.weight"]
        if t.tensor_type.name not in quant.PACKED_GGUF_TYPES or not quant.is_matmul_weight(name):
            return None
        return "q8_0" if t.tensor_type.name == "Q8_0" else "int4"

    def read_packed(self, name: str, shard: tuple[int, int, int] | None = None):
        """The tensor kept packed (`quant.PackedWeight`), straight from its blocks, or None
        for a type that is widened (`quant.formats` says which and why)."""
        from .. import quant

        if self.packed_kind(name) is None:
            return None
        t = self._tensors.get(name) or self._tensors["tok_embeddings.weight"]
        cols, rows = t.shape
        heads = {"wq": self.config.n_heads, "wk": self.config.n_kv_heads}.get(name.split(".")[-2]) \
            if self._permuted else None
        order = torch.arange(rows) if heads is None else unpermute_from_gguf(torch.arange(rows), heads)
        dim, index, parts = shard or (0, 0, 1)
        if dim == 0:
            order = order[index * rows // parts:(index + 1) * rows // parts]
        raw = t.data.reshape(rows, -1)  # [rows, bytes per row]

        def groups(chunk: slice) -> quant.formats.Groups:
            picked = order[chunk].numpy()
            g = quant.from_gguf_blocks(t.tensor_type.name, raw[picked], len(picked), cols)
            # The chunk's file pages leave the resident set as soon as it is converted: a 49k-token
            # embedding's 30 MB of blocks would otherwise stay mapped in beside its packed copy.
            self._file.release(t, int(picked.min()) * raw.shape[1], (int(picked.max()) + 1) * raw.shape[1])
            if dim == 0:
                return g
            try:
                return g.column_chunk(index, parts)
            except ValueError as e:
                raise ConfigError(f"{str(self.path)!r}: {name} cannot be split {parts} ways packed: {e}; "
                                  f"use another --tp, or --quantize none to widen it") from None

        w = quant.PackedWeight.from_row_chunks(len(order), groups)
        self._file.release(t)
        return w

    def read(self, name: str, shard: tuple[int, int, int] | None = None) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self._tensors.get(name) or self._tensors["tok_embeddings.weight"]  # tied head
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists dimensions innermost first
        values = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if not values.flags.writeable:  # float32 tensors come back as views of the read-only map
            values = values.copy()
        w = torch.from_numpy(values).reshape(shape)
        if self._permuted and name.endswith(("wq.weight", "wq.bias")):
            w = unpermute_from_gguf(w, self.config.n_heads)
        elif self._permuted and name.endswith(("wk.weight", "wk.bias")):
            w = unpermute_from_gguf(w, self.config.n_kv_heads)
        if shard is not None:
            dim, index, parts = shard
            w = w.chunk(parts, dim)[index].contiguous()
        self._file.release(t)
        return w

    def read_region(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The block of `name` at `offsets` of shape `sizes` (a DTensor shard, as HFWeights
        reads it); GGUF blocks are dequantized whole, then cut."""
        return _region(self.read(name), offsets, sizes)


def _region(w: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(offsets, sizes)):
        w = w.narrow(dim, start, size)
    return w.contiguous()


def gguf_tokenizer(value, path: Path):
    """A `tokenizers` tokenizer from GGUF metadata: byte-level BPE ("gpt2", with merges) or
    SentencePiece ("llama", tokens with scores, rebuilt as a Unigram model with byte fallback,
    which picks the same pieces in the common case)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    from .tokenizer import HFTokenizer

    kind = value("tokenizer.ggml.model")
    tokens = value("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise ConfigError(f"{str(path)!r} carries no tokenizer; llmsplit needs tokenizer.ggml.* metadata")
    types = value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges") or []]
        tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
        pre = value("tokenizer.ggml.pre", "default")
        steps = [pre_tokenizers.Digits(individual_digits=True)] if pre == "smollm" else []
        if pre in ("llama-bpe", "llama3", "qwen2", "deepseek-llm"):
            # Llama 3 / Qwen2 split text with their own pattern before the byte mapping.
            pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+")
            from tokenizers import Regex

            steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        else:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = value("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = value("tokenizer.ggml.unknown_token_id", 0)
        tok = Tokenizer(models.Unigram([(t, float(s)) for t, s in zip(tokens, scores)], unk_id=int(unk),
                                       byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        raise ConfigError(f"{str(path)!r}: tokenizer model {kind!r} is not supported; llmsplit reads gpt2 and llama")
    # Control and user-defined tokens (types 3 and 4) must never be split into pieces.
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty in (3, 4)])
    wrapped = HFTokenizer.from_tokenizer(tok, name=str(path))
    bos, eos = value("tokenizer.ggml.bos_token_id"), value("tokenizer.ggml.eos_token_id")
    wrapped.bos_id = int(bos) if bos is not None else wrapped.bos_id
    wrapped.eos_id = int(eos) if eos is not None else wrapped.eos_id
    wrapped.add_bos = bool(value("tokenizer.ggml.add_bos_token", kind == "llama"))
    wrapped.chat_template = value("tokenizer.chat_template")
    return wrapped
