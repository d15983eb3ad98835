"""Structured output libraries on SmolLM2-135M's vocabulary (49,152 tokens): how long the
tokenizer set-up and a schema's compile take, and what a token's mask costs (computed, then
applied to a logits row), for xgrammar and outlines-core. The numbers behind the choice in
docs/serving.md. Run by hand (`python -m benchmarks.grammars`; needs both libraries and the
GGUF file, which it fetches like benchmarks/infer.py).
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmsplit.io.gguf import GGUFWeights

from .infer import _smollm_gguf

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "tags"]}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"]})


def xgrammar_cost(hf, tok, V, ids):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf), vocab_size=V,
                                              stop_token_ids=[tok.eos_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    t1 = time.perf_counter()
    cg = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    t2 = time.perf_counter()
    compiler.compile_builtin_json_grammar()  # what json_object could use
    t3 = time.perf_counter()
    m = xgr.GrammarMatcher(cg)
    mask = xgr.allocate_token_bitmask(1, V)
    logits = torch.randn(1, V)
    times = []
    for i in ids:
        a = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        times.append(time.perf_counter() - a)
        assert m.accept_token(i), i
    return {"setup_s": t1 - t0, "schema_compile_s": t2 - t1, "json_compile_s": t3 - t2,
            "mask_ms_median": 1e3 * statistics.median(times), "mask_ms_max": 1e3 * max(times)}

def outlines_cost(hf, tok, V, ids):
    import outlines_core as o
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import allocate_token_bitmask, apply_token_bitmask_inplace
    t0 = time.perf_counter()
    # Byte-level BPE: outlines-core wants each token's bytes, which GPT-2's byte-to-character table gives back.
    back = {c: b for b, c in _byte_chars().items()}
    vocab = {}
    for text, i in hf.get_vocab(with_added_tokens=True).items():
        if i != tok.eos_id:
            key = bytes(back[c] for c in text) if all(c in back for c in text) else text.encode()
            vocab.setdefault(key, []).append(i)
    voc = o.Vocabulary(tok.eos_id, vocab)
    t1 = time.perf_counter()
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    index = o.Index(regex, voc)
    t2 = time.perf_counter()
    g = o.Guide(index)
    mask = allocate_token_bitmask(V)
    logits = torch.randn(1, V)
    times = []
    for i in ids:
        a = time.perf_counter()
        g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        apply_token_bitmask_inplace(logits, mask)
        times.append(time.perf_counter() - a)
        g.advance(i)
    return {"setup_s": t1 - t0, "schema_compile_s": t2 - t1, "mask_ms_median": 1e3 * statistics.median(times[2:]),
            "mask_ms_max": 1e3 * max(times[2:]), "first_mask_ms (torch.compile of the kernel)": 1e3 * times[0]}


def _byte_chars() -> dict[int, str]:
    """GPT-2's table: byte -> the printable character byte-level BPE writes it as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(moved)}}


def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tok = GGUFWeights(_smollm_gguf(Path(tmp))).tokenizer
    hf = tok.backend
    V = hf.get_vocab_size(with_added_tokens=True)
    ids = tok.encode(TEXT)
    print(f"vocabulary {V}, answer {len(ids)} tokens", file=sys.stderr)
    print("xgrammar", xgrammar_cost(hf, tok, V, ids))
    print("outlines-core", outlines_cost(hf, tok, V, ids))


if __name__ == "__main__":
    main()
