"""llmsplit (GGUF kept packed) against llama.cpp on the same Q4_1 file, side by side.

`python -m benchmarks.llama_cpp --gguf FILE.gguf [--rounds 2] [--threads 2] [--compile] [--omp-passive]` prints a
markdown table (`--compile`: llmsplit's packed rows load with `compile=True`, compiled outside
the timings). Rounds alternate llama.cpp and llmsplit, each run in a fresh process (so each peak RSS
is its own); medians. Rows, greedy, EOS ignored:
- decode tokens/s at batch 1 (128 new tokens after a short prompt; llama-bench's tg128);
- prompt processing tokens/s of a 512-token prompt (llama-bench's pp512; ours: the prefill of
  `generate(..., max_new_tokens=1)` with the prefix cache off);
- aggregate decode tokens/s of 16 sequences of 128 new tokens (llama-batched-bench's S_TG at
  16; ours: 16 prompts generated together, minus their prefill);
- peak RSS of the process (llama.cpp: the benchmark tool's; ours: the Python process's,
  torch included, at llama-bench's context: one sequence of 640 tokens), and our fp32 path's
  decode for the ratio the issue asks (≥ 3×); with `--compile`, the packed path's decode and peak
  RSS without it too (no dynamo/inductor in that process).
The llama.cpp binaries: ~/.cache/llmsplit-peers/llama_cpp_python-0.3.36/build/bin (built from
the llama-cpp-python sdist, /work/shared/REFERENCES.md); a missing tool is reported, not built.
llama.cpp runs at its defaults (weights repacked for the CPU at load), except on a CPU with
AMX, where its AMX repacking segfaulted in `ggml::cpu::amx::tensor_traits::compute_forward`
(gdb backtrace, on the Xeon VMs these benchmarks first ran on): there repacking is off
(`repack_flags`), and each table says which it was, with the CPU's flags (`llama_cpp_setting`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

from llmsplit import native

BIN = Path.home() / ".cache/llmsplit-peers/llama_cpp_python-0.3.36/build/bin"
AMX = ("amx_tile", "amx_int8", "amx_bf16")
NEW, PROMPT, SEQS = 128, 512, 16

_OURS = r"""
import json, sys, time, torch
import llmsplit
from benchmarks.quant import _text_ids
path, threads, quantize, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
compile = sys.argv[5] == "1"
torch.set_num_threads(threads)
batch = "batch16" in rows  # its own process: 16 sequences' KV cache would count in the batch-1 RSS
m = llmsplit.load(path, quantize=None if quantize == "default" else quantize, prefix_caching=False,
                  max_batch=16 if batch else 1, max_context=160 if batch else 640, compile=compile)
ids = _text_ids(m.tokenizer, 1024)
out = {}
def timed(prompt, n):
    t = time.perf_counter(); m.generate(prompt, max_new_tokens=n, ignore_eos=True); return time.perf_counter() - t
short = ids[:8]
timed(short, 4)  # warm
if "decode" in rows:
    out["decode"] = 128 / (timed(short, 129) - timed(short, 1))
if "prompt" in rows:
    timed(ids[1:513], 1)
    out["prompt"] = 512 / timed(ids[:512], 1)
if not batch:  # the same context as llama-bench's (512 + 128 tokens, one sequence)
    out["rss_mib"] = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
if "batch16" in rows:
    prompts = [m.tokenizer.decode(ids[i * 8:i * 8 + 8]) for i in range(16)]
    out["batch16"] = 16 * 128 / (timed(prompts, 129) - timed(prompts, 1))
print(json.dumps(out))
"""


def repack_flags(tool: str) -> list[str]:
    """llama.cpp as its users run it (repacking on) unless the CPU has AMX (see the docstring).
    llama-bench spells the switch `--repack 0`, the other tools `--no-repack`."""
    if not native.cpu_flags() & set(AMX):
        return []
    return ["--repack", "0"] if tool == "llama-bench" else ["--no-repack"]


def llama_cpp_setting() -> str:
    """The line each table prints beside llama.cpp's numbers: its repacking and why."""
    flags = native.cpu_flags()
    simd = " ".join(sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")))
    simd = simd or "no AVX flags"
    if flags & set(AMX):
        return f"llama.cpp with repacking off (`--no-repack`): its AMX repack segfaults on this CPU ({simd})"
    return f"llama.cpp at its defaults, weights repacked (this CPU has no AMX: {simd})"


def _run(cmd: list[str], env=None) -> tuple[str, float]:
    """(stdout, peak RSS in MiB) of one child process."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            text=True, env=env)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode})")
    return out, usage.ru_maxrss / 1024


def llama_cpp(path: str, threads: int) -> dict:
    r = {}
    out, rss = _run([str(BIN / "llama-bench"), "-m", path, "-t", str(threads), "-p", str(PROMPT), "-n", str(NEW),
                     "-r", "1", "-o", "json", *repack_flags("llama-bench")])
    for test in json.loads(out):
        r["prompt" if test["n_prompt"] else "decode"] = test["avg_ts"]
    r["rss_mib"] = rss
    if (BIN / "llama-batched-bench").exists():
        out, _ = _run([str(BIN / "llama-batched-bench"), "-m", path, "-t", str(threads), "-c", "4096",
                       *repack_flags("llama-batched-bench"), "-npp", "8", "-ntg", str(NEW), "-npl", str(SEQS)])
        for line in out.splitlines():  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | ...
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) >= 8 and cells[2] == str(SEQS) and re.fullmatch(r"[\d.]+", cells[7]):
                r["batch16"] = float(cells[7])
    return r


def ours(path: str, threads: int, quantize: str, rows: str, compile: bool = False, passive: bool = False) -> dict:
    """llmsplit's rows in a fresh process, libgomp's default wait policy (threads spin at a
    barrier, as llama.cpp's do) unless `passive` (OMP_WAIT_POLICY=PASSIVE: for a machine whose
    other tenants hold the cores; on a quiet one it costs 2.8x at 2 threads, compiled decode
    15.3 against 5.45 ms a token)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(["src", "."]))
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out, _ = _run([sys.executable, "-c", _OURS, path, str(threads), quantize, rows, str(int(compile))], env=env)
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="load llmsplit's packed rows with compile=True")
    p.add_argument("--omp-passive", action="store_true",
                   help="llmsplit's processes with OMP_WAIT_POLICY=PASSIVE "
                        "(a machine whose other tenants hold the cores)")
    a = p.parse_args(argv)
    results: dict[str, list[dict]] = {"llama.cpp": [], "llmsplit": [], "llmsplit fp32": []}
    if a.compile:  # the packed path without torch.compile too: its decode, and its RSS without dynamo/inductor
        results["llmsplit eager"] = []
    loads = []
    for r in range(a.rounds):
        order = list(results) if r % 2 == 0 else list(reversed(results))
        for name in order:
            if name == "llama.cpp":
                results[name].append(llama_cpp(a.gguf, a.threads))
            elif name == "llmsplit eager":
                results[name].append(ours(a.gguf, a.threads, "default", "decode", False, a.omp_passive))
            else:
                fp32 = name.endswith("fp32")
                r = ours(a.gguf, a.threads, "none" if fp32 else "default", "decode" if fp32 else "decode,prompt",
                         a.compile and not fp32, a.omp_passive)
                if not fp32:
                    r.update(ours(a.gguf, a.threads, "default", "batch16", a.compile, a.omp_passive))
                results[name].append(r)
            loads.append(os.getloadavg()[0])
            print(name, results[name][-1], file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(x[k] for x in rs if k in x) for k in rs[0]} for n, rs in results.items()}
    lc, us = med["llama.cpp"], med["llmsplit"]
    ours_label = "llmsplit (packed, compiled)" if a.compile else "llmsplit (packed)"
    lines = [f"| {a.threads} threads, medians of {a.rounds} | llama.cpp | {ours_label} | llmsplit / llama.cpp | bar |",
             "| --- | ---: | ---: | ---: | --- |"]
    for key, label, bar, unit in (("decode", "decode tokens/s, batch 1", 1.0, ""),
                                  ("prompt", "prompt tokens/s, 512 tokens", 1.0, ""),
                                  ("batch16", "aggregate decode tokens/s, 16 sequences", 1.5, ""),
                                  ("rss_mib", "peak RSS, MiB", 1.3, " (at most)")):
        if key not in lc:
            lines.append(f"| {label} | not built | {us.get(key, 0):.1f} | | ≥ {bar}× |")
            continue
        ratio = us[key] / lc[key]
        ok = ratio <= bar if key == "rss_mib" else ratio >= bar
        lines.append(f"| {label} | {lc[key]:.1f} | {us[key]:.1f} | {ratio:.2f} | {'≤' if key == 'rss_mib' else '≥'} "
                     f"{bar}×{unit}: {'met' if ok else 'not met'} |")
    fp = med["llmsplit fp32"]["decode"]
    lines += ["", f"llmsplit fp32 path decode: {fp:.1f} tokens/s; packed / fp32 = {us['decode'] / fp:.2f} (bar ≥ 3×).",
              f"Load average during the rounds: {min(loads):.1f}–{max(loads):.1f}; {llama_cpp_setting()}.",
              f"Command: `python -m benchmarks.llama_cpp {' '.join(argv if argv is not None else sys.argv[1:])}`, "
              f"rounds alternating (round 0: {', '.join(results)}; round 1 the reverse)."]
    if "llmsplit eager" in med:
        eager = med["llmsplit eager"]
        lines.insert(-1, f"llmsplit packed without --compile: decode {eager['decode']:.1f} tokens/s "
                         f"({eager['decode'] / lc['decode']:.2f}× llama.cpp), peak RSS {eager['rss_mib']:.1f} MiB "
                         f"({eager['rss_mib'] / lc['rss_mib']:.2f}× llama.cpp).")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
