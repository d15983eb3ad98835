"""Packed int4/int8 weights against the float32 path, on SmolLM2-135M-Instruct's Q4_1 GGUF.

`python -m benchmarks.quant --gguf FILE.gguf [--tokens 4096] [--rounds 3] [--threads 2]`
prints a markdown report:
- quality: greedy tokens over 64 new tokens and the mean NLL over `--tokens` tokens of
  pydoc_data.topics (chunks of 512), the GGUF kept packed against the same file dequantized
  to float32 (`quantize="none"`); the packed rows both through the prompt path
  (widened to bf16 tile by tile, bf16 GEMM) and through each decode kernel (aten's int4
  kernel, int4_matmul.cpp: forced for every row count);
  then the float32 model quantized at load, int8 and int4, by perplexity;
- memory: the bytes of parameters and buffers each loaded model holds, and the peak RSS
  of a process that only loads the model (against the file size);
- speed: decode tokens/s (`--new-tokens`, 128, after a 200-token prompt) and prompt tokens/s (a
  512-token prompt) at `--threads` threads, packed and float32 in alternating rounds, medians.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

import torch


class FloatOnly:
    """A weight source without `read_packed`: the GGUF dequantized to float32, as an fp32
    checkpoint would load, so `quantize="int8"|"int4"` quantizes every weight at load."""

    def __init__(self, source):
        self._s = source
        self.config, self.tokenizer = source.config, source.tokenizer
        self.eos_ids, self.dtype = source.eos_ids, source.dtype

    def names(self):
        return self._s.names()

    def read(self, name, shard=None):
        return self._s.read(name, shard)


def _text_ids(tokenizer, n: int) -> list[int]:
    """The first n + 1 tokens of pydoc's topics. Encodes a prefix of the text, doubled until it
    gives 64 tokens more than asked: the same ids as encoding it whole (pre-tokenization is local,
    so only the cut word can differ), without the ~85 MiB of RSS the whole text's encoding left in
    a process whose peak RSS a benchmark reports."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = 8 * (n + 65)
    while True:
        ids = tokenizer.encode(text[:chars])
        if len(ids) > n + 64 or chars >= len(text):
            return ids[:n + 1]
        chars *= 2


def mean_nll(m, ids: list[int], chunk: int = 512) -> float:
    total, count = 0.0, 0
    for i in range(0, len(ids) - 1, chunk):
        piece = torch.tensor([ids[i:i + chunk + 1]])
        logits = m.logits(piece[:, :-1])[0]
        total += torch.nn.functional.cross_entropy(logits, piece[0, 1:], reduction="sum").item()
        count += piece.shape[1] - 1
    return total / count


def quality(path: str, n_tokens: int) -> dict:
    import llmsplit
    from llmsplit.io.weights import open_weights
    from llmsplit.quant import held_bytes, kernels

    ref, packed = llmsplit.load(path, quantize="none"), llmsplit.load(path)
    prompt = "Write a short story about a robot who learns to paint."
    a = ref.generate(prompt, max_new_tokens=64, ignore_eos=True)
    b = packed.generate(prompt, max_new_tokens=64, ignore_eos=True)
    ta, tb = ref.tokenizer.encode(a), packed.tokenizer.encode(b)
    same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
    ids = _text_ids(ref.tokenizer, n_tokens)
    r = {"greedy_same": a == b, "greedy_first_diff": same, "tokens": len(ids) - 1,
         "nll_fp32": mean_nll(ref, ids), "nll_packed_prompt_path": mean_nll(packed, ids)}
    limits = kernels.KERNEL_MAX_ROWS, kernels.NATIVE_MAX_ROWS
    try:
        kernels.KERNEL_MAX_ROWS, kernels.NATIVE_MAX_ROWS = 1 << 30, 0  # every row through aten's int4 kernel
        r["nll_packed_kernel"] = mean_nll(packed, ids)
        if kernels.native_int4_available():  # every row through int4_matmul.cpp (int4 weights)
            kernels.NATIVE_MAX_ROWS = 1 << 30
            r["nll_packed_native"] = mean_nll(packed, ids)
    finally:
        kernels.KERNEL_MAX_ROWS, kernels.NATIVE_MAX_ROWS = limits
    r["bytes_fp32"], r["bytes_packed"] = held_bytes(ref.runner.model), held_bytes(packed.runner.model)
    for mode in ("int8", "int4"):
        m = llmsplit.load(path, quantize=mode, source=FloatOnly(open_weights(path)))
        r[f"nll_{mode}"], r[f"bytes_{mode}"] = mean_nll(m, ids), held_bytes(m.runner.model)
        m.close()
    ref.close()
    packed.close()
    return r


# VmHWM/VmRSS of the process image, read after the imports and after the load in one process
# (1 sequence of 256 tokens: the KV cache stays small). getrusage's ru_maxrss gave the same
# number for every run here. A load imports neither torch._dynamo nor sympy (~70 MiB of library
# code; tests/test_infer_cli.py checks), so they are not imported here either.
_RSS = """
import sys, llmsplit, torch, gguf, tokenizers, numpy
import llmsplit.infer.api, llmsplit.io.gguf, llmsplit.quant
from llmsplit.io.weights import open_weights
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
base = status('VmRSS')
src = open_weights(sys.argv[1])
opened = status('VmRSS') - base
m = llmsplit.load(sys.argv[1], source=src, max_batch=1, max_context=256,
                  quantize=None if sys.argv[2] == "default" else sys.argv[2])
print(opened, status('VmHWM') - base)
"""


def peak_rss(path: str, quantize: str) -> tuple[int, int]:
    """(RSS after opening the file, peak RSS after the load), both above the imports."""
    out = subprocess.run([sys.executable, "-c", _RSS, path, quantize], capture_output=True, text=True, check=True)
    opened, peak = out.stdout.split()[-2:]
    return int(opened), int(peak)


def speed(path: str, threads: int, rounds: int, new: int = 128) -> dict:
    import llmsplit

    torch.set_num_threads(threads)
    models = {"packed": llmsplit.load(path, max_context=1024), "fp32": llmsplit.load(path, quantize="none",
                                                                                      max_context=1024)}
    ids = _text_ids(models["fp32"].tokenizer, 1024)
    prompt, long_prompt = ids[:200], ids[:512]
    out = {k: {"decode": [], "prompt": []} for k in models}
    loads = []
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(reversed(models))):
            m = models[name]
            m.generate(prompt, max_new_tokens=2, ignore_eos=True)  # warm
            t0 = time.perf_counter()
            m.generate(prompt, max_new_tokens=1, ignore_eos=True)
            t1 = time.perf_counter()
            m.generate(prompt, max_new_tokens=new + 1, ignore_eos=True)
            t2 = time.perf_counter()
            out[name]["decode"].append(new / ((t2 - t1) - (t1 - t0)))
            t0 = time.perf_counter()
            m.logits(torch.tensor([long_prompt]))
            out[name]["prompt"].append(len(long_prompt) / (time.perf_counter() - t0))
            loads.append(os.getloadavg()[0])
    for m in models.values():
        m.close()
    return {"rounds": out, "load": (min(loads), max(loads))}


def report(path: str, q: dict, s: dict, rss: dict, threads: int) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    ppl = lambda nll: f"{math.exp(nll):.3f}"  # noqa: E731
    lines = [f"File {os.path.basename(path)} ({mib(os.path.getsize(path))}); torch {torch.__version__}.", "",
             "| | mean NLL | perplexity | Δ vs fp32 | weights held |", "| --- | ---: | ---: | ---: | ---: |"]
    base = q["nll_fp32"]
    rows = [("GGUF dequantized to fp32 (`quantize=\"none\"`)", "nll_fp32", "bytes_fp32"),
            ("GGUF kept packed, prompt path (bf16 tiles, bf16 GEMM)", "nll_packed_prompt_path", "bytes_packed"),
            ("GGUF kept packed, aten's int4 kernel on every row (bf16 in)", "nll_packed_kernel", "bytes_packed"),
            ("GGUF kept packed, int4_matmul.cpp on every row (int16 in)", "nll_packed_native", "bytes_packed"),
            ("fp32 quantized at load: int8 (per row)", "nll_int8", "bytes_int8"),
            ("fp32 quantized at load: int4 (groups of 32)", "nll_int4", "bytes_int4")]
    for label, key, b in rows:
        if key not in q:
            continue
        lines.append(f"| {label} | {q[key]:.5f} | {ppl(q[key])} | {q[key] - base:+.5f} "
                     f"({100 * (math.exp(q[key] - base) - 1):+.2f}% ppl) | {mib(q[b])} |")
    greedy = "identical" if q["greedy_same"] else f"first differs at token {q['greedy_first_diff']}"
    lines += ["", f"NLL over {q['tokens']} tokens of pydoc_data.topics in chunks of 512. Greedy, 64 new tokens, "
              f"packed vs dequantized: {greedy}.",
              "", f"Peak RSS of a load (1 × 256-token KV cache) above the imports: packed {mib(rss['packed'][1])}, "
              f"fp32 {mib(rss['none'][1])}; opening the file (reader and tokenizer) is {mib(rss['packed'][0])} of "
              f"it.", "",
              f"| {threads} threads | decode tokens/s (median) | per round | prompt tokens/s, 512 (median) "
              f"| per round |",
              "| --- | ---: | --- | ---: | --- |"]
    for name, r in s["rounds"].items():
        per_round = ", ".join(f"{x:.1f}" for x in r["decode"])
        lines.append(f"| {name} | {statistics.median(r['decode']):.1f} | {per_round} | "
                     f"{statistics.median(r['prompt']):.0f} | {', '.join(f'{x:.0f}' for x in r['prompt'])} |")
    ratio = statistics.median(s["rounds"]["packed"]["decode"]) / statistics.median(s["rounds"]["fp32"]["decode"])
    lines += [f"| **decode ratio packed / fp32** | **{ratio:.2f}** | | | |", "",
              f"Load average during the rounds: {s['load'][0]:.1f}–{s['load'][1]:.1f}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per round")
    p.add_argument("--skip-quality", action="store_true", help="only memory and speed")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.skip_quality:
        s = speed(a.gguf, a.threads, a.rounds, a.new_tokens)
        print(s, file=sys.stderr, flush=True)
        return 0
    q = quality(a.gguf, a.tokens)
    print(q, file=sys.stderr, flush=True)  # the slow part's numbers, whatever happens next
    rss = {"none": peak_rss(a.gguf, "none"), "packed": peak_rss(a.gguf, "default")}
    print(rss, file=sys.stderr, flush=True)
    s = speed(a.gguf, a.threads, a.rounds, a.new_tokens)
    print(report(a.gguf, q, s, rss, a.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
