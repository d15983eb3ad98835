"""The samplers a run's [data] section asks for: training rows (GRPO: prompts), and the held-out
rows that evaluation reads (data.eval_source, or the last data.eval_fraction of the source)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..config import DataSection
from ..errors import ConfigError
from ..io.token_file import read_token_documents
from .chat import Documents, encode_chat_files
from .corpus import check_tokenizer, expand_glob, load_tokens
from .loader import BatchSampler
from .packing import PackedSampler
from .preference import PreferencePairs, PreferenceSampler, check_preference_files, read_preference_files
from .prompts import PromptSampler, check_prompt_files, read_prompt_files


def build_samplers(data: DataSection, global_batch: int, seed: int, tokenizer, objective: str = "sft",
                   width_multiple: int | None = None):
    """(training sampler, evaluation sampler or None). `width_multiple`: DPO's rows are cut to the
    longest of their batch rounded up to it (None: data.seq_len wide)."""
    if objective == "dpo":
        return _preference_samplers(data, global_batch, seed, tokenizer, width_multiple)
    if data.format == "chat":
        docs = load_chat_documents(data.source, data.loss_on, tokenizer)
        held = load_chat_documents(data.eval_source, data.loss_on, tokenizer, "data.eval_source") \
            if data.eval_source else None
        if data.eval_fraction > 0:
            docs, held = _split_documents(docs, data.eval_fraction)
        pad = tokenizer.eos_id or 0
        make = lambda d: PackedSampler(d, data.seq_len, global_batch, seed, pad)
    else:
        docs = load_tokens(data.source, tokenizer)
        held = load_tokens(data.eval_source, tokenizer) if data.eval_source else None
        if data.eval_fraction > 0:
            cut = len(docs) - max(data.seq_len + 1, int(len(docs) * data.eval_fraction))
            docs, held = docs[:cut], docs[cut:]
        make = lambda d: BatchSampler(d, data.seq_len, global_batch, seed)
    return make(docs), (make(held) if held is not None else None)


def _preference_samplers(data: DataSection, global_batch: int, seed: int, tokenizer, width_multiple: int | None):
    """DPO's pairs (data/preference.py); held out like conversations, the last pairs."""
    pairs = read_preference_files(jsonl_files(data.source, "data.source"), tokenizer)
    held = read_preference_files(jsonl_files(data.eval_source, "data.eval_source"), tokenizer, "data.eval_source") \
        if data.eval_source else None
    if data.eval_fraction > 0:
        cut = _held_out_cut(len(pairs), data.eval_fraction, "pairs")
        held = PreferencePairs(pairs.chosen[cut:], pairs.rejected[cut:])
        pairs = PreferencePairs(pairs.chosen[:cut], pairs.rejected[:cut])
    pad = tokenizer.eos_id or 0
    make = lambda p: PreferenceSampler(p, data.seq_len, global_batch, seed, pad, width_multiple)
    return make(pairs), (make(held) if held is not None else None)


def build_prompt_samplers(data: DataSection, prompts_per_step: int, seed: int, tokenizer):
    """GRPO's prompts (data/prompts.py): (training sampler, sampler of the held-out prompts or
    None), held out like DPO's pairs (the last ones); the held-out sampler's step is all of them."""
    prompts = read_prompt_files(jsonl_files(data.source, "data.source", "grpo"), tokenizer)
    held = read_prompt_files(jsonl_files(data.eval_source, "data.eval_source", "grpo"), tokenizer,
                             "data.eval_source") if data.eval_source else None
    if data.eval_fraction > 0:
        cut = _held_out_cut(len(prompts), data.eval_fraction, "prompts")
        prompts, held = prompts[:cut], prompts[cut:]
    return (PromptSampler(prompts, prompts_per_step, seed),
            PromptSampler(held, len(held), seed) if held is not None else None)


def _held_out_cut(n: int, fraction: float, what: str) -> int:
    """Where the last `fraction` of n rows (at least one) begins; at least one row stays to train."""
    cut = n - max(1, math.ceil(n * fraction))
    if cut < 1:
        raise ConfigError(f"data.eval_fraction={fraction} holds out all {n} {what}; lower it or add data")
    return cut


def check_prompt_source(data: DataSection) -> None:
    """The prompt rows' shape, checked by the launcher before any worker starts."""
    check_prompt_files(jsonl_files(data.source, "data.source", "grpo"))
    if data.eval_source:
        check_prompt_files(jsonl_files(data.eval_source, "data.eval_source", "grpo"), "data.eval_source")


def check_preference_source(data: DataSection) -> None:
    """The preference rows' shape, checked by the launcher before any worker starts."""
    check_preference_files(jsonl_files(data.source, "data.source"))
    if data.eval_source:
        check_preference_files(jsonl_files(data.eval_source, "data.eval_source"), "data.eval_source")


# What each objective that reads JSONL rows reads, for the message refusing other files.
JSONL_ROWS = {"dpo": "rows of \"prompt\", \"chosen\" and \"rejected\"",
              "grpo": "rows with a \"prompt\" (text or messages)"}


def jsonl_files(source: str, key: str, objective: str = "dpo") -> list[Path]:
    if source.startswith("text:"):
        return expand_glob(source[len("text:"):], key)
    if not source.endswith(".jsonl"):
        raise ConfigError(f"{key}={source!r} is not a .jsonl file; train.objective=\"{objective}\" reads JSONL "
                          f"{JSONL_ROWS[objective]}")
    return [Path(source)]


def load_chat_documents(source: str, loss_on: str, tokenizer, key: str = "data.source") -> Documents:
    """Conversations from .jsonl files (tokenized now) or a token file `llmsplit prepare` wrote
    from them; with loss_on="all" every token carries loss."""
    if source.endswith(".jsonl") or source.startswith("text:"):
        files = expand_glob(source[len("text:"):], key) if source.startswith("text:") else [Path(source)]
        if not files[0].is_file():
            raise ConfigError(f"{key}={source!r} does not exist; pass a .jsonl file of conversations")
        return encode_chat_files(files, tokenizer, loss_on)
    tokens, mask, offsets, header = read_token_documents(source, key)
    check_tokenizer(source, header, tokenizer)
    if header.get("format") != "chat" or mask is None:
        raise ConfigError(f"{key}={source!r} holds plain text, not conversations; prepare it with "
                          f"`llmsplit prepare --format chat` or set data.format=\"text\"")
    if loss_on == "assistant" and header.get("loss_on", "assistant") != "assistant":
        raise ConfigError(f"{key}={source!r} was prepared with --loss-on {header['loss_on']}; prepare it again "
                          f"with --loss-on assistant or set data.loss_on=\"{header['loss_on']}\"")
    return Documents(tokens, None if loss_on == "all" else mask, offsets)


def _split_documents(docs: Documents, fraction: float) -> tuple[Documents, Documents]:
    """The last `fraction` of the documents (at least one) held out, the rest kept."""
    n = len(docs)
    held = max(1, math.ceil(n * fraction))
    if held >= n:
        raise ConfigError(f"data.eval_fraction={fraction} holds out all {n} documents; lower it or add data")
    cut = int(docs.offsets[n - held])
    keep_offsets = np.asarray(docs.offsets[:n - held + 1], dtype=np.int64)
    held_offsets = np.asarray(docs.offsets[n - held:], dtype=np.int64) - cut
    mask = docs.mask
    return (Documents(docs.tokens[:cut], None if mask is None else mask[:cut], keep_offsets),
            Documents(docs.tokens[cut:], None if mask is None else mask[cut:], held_offsets))
