"""CPU time per decoded token at batch 1: llmsplit packed and fp32 against llama.cpp on the same
GGUF file, and where llmsplit's packed step goes (torch.profiler, the int4 kernel per shape).

`python -m benchmarks.decode_cpu --gguf FILE.gguf [--rounds 2] [--threads 1] [--compile] [--profile]`
`python -m benchmarks.decode_cpu --gguf FILE.gguf --batches 1,2,4,8,16 [--plot docs/img/decode_batch.png]`

CPU time, not wall time: on a machine whose other tenants hold the load above its cores, the
same run's tokens/s moves 4x between minutes, its CPU time much less. Ours: `time.process_time`
around `generate` (128 new tokens after an 8-token prompt, minus a 1-token run); llama.cpp:
the rusage of `llama-bench -p 0 -n 144` minus `-n 16` (load, warm-up and the first tokens
cancel). Rounds alternate; each row prints as it is measured, with the load average.
`--compile` adds the compiled rows (`llmsplit.load(compile=True)`, packed and fp32): their
compile happens at load, outside the measured CPU time (the first load of each compiles for
minutes; later ones read torch's on-disk cache).
`--batches` measures aggregate decode of B sequences generated together instead (B different
8-token prompts, 128 new tokens each; llama.cpp: `llama-batched-bench -npp 8 -npl B`, the
same two-length difference), for llama.cpp, llmsplit packed eager and compiled: tokens per
CPU-second against B, medians of the rounds, optionally plotted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from .llama_cpp import BIN

NEW = 128


def _cpu_of(cmd: list[str]) -> float:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{cmd[0]} failed")
    return usage.ru_utime + usage.ru_stime


def llama_cpp_ms(path: str, threads: int) -> float:
    def cpu(n: int) -> float:
        return _cpu_of([str(BIN / "llama-bench"), "-m", path, "-t", str(threads), "-p", "0", "-n", str(n),
                        "-r", "1", "--repack", "0", "-o", "json"])

    return (cpu(NEW + 16) - cpu(16)) / NEW * 1e3


def llama_cpp_batch_ms(path: str, threads: int, batch: int) -> float:
    """CPU ms per token of `batch` sequences decoding together (llama-batched-bench)."""
    def cpu(n: int) -> float:
        return _cpu_of([str(BIN / "llama-batched-bench"), "-m", path, "-t", str(threads), "-c", "4096",
                        "--no-repack", "-npp", "8", "-ntg", str(n), "-npl", str(batch)])

    return (cpu(NEW + 16) - cpu(16)) / (NEW * batch) * 1e3


def ours_batch_ms(path: str, batches: list[int], compile: bool) -> dict[int, float]:
    """CPU ms per token of B sequences generated together, for each B in `batches` (one load)."""
    import torch

    import llmsplit
    from benchmarks.quant import _text_ids

    m = llmsplit.load(path, max_context=160, max_batch=max(batches), prefix_caching=False, compile=compile)
    ids = _text_ids(m.tokenizer, 8 * max(batches))

    def cpu(b: int, n: int) -> float:
        start = time.process_time()
        m.generate(torch.tensor([ids[i * 8:i * 8 + 8] for i in range(b)]), max_new_tokens=n, ignore_eos=True)
        return time.process_time() - start

    cpu(2, 4)  # warm
    return {b: (cpu(b, NEW + 1) - cpu(b, 1)) / (NEW * b) * 1e3 for b in batches}


def by_batch(a) -> None:
    import statistics

    batches = [int(b) for b in a.batches.split(",")]
    rows = {"llama.cpp": lambda: {b: llama_cpp_batch_ms(a.gguf, a.threads, b) for b in batches},
            "llmsplit packed": lambda: ours_batch_ms(a.gguf, batches, False),
            "llmsplit packed compiled": lambda: ours_batch_ms(a.gguf, batches, True)}
    got: dict[str, list[dict[int, float]]] = {name: [] for name in rows}
    for r in range(a.rounds):
        for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
            got[name].append(rows[name]())
            print(f"round {r + 1} {name}: " + ", ".join(f"B={b} {1e3 / ms:.1f}" for b, ms in got[name][-1].items())
                  + f" tokens per CPU-second, load {os.getloadavg()[0]:.1f}", flush=True)
    med = {name: [1e3 / statistics.median(x[b] for x in rs) for b in batches] for name, rs in got.items()}
    print(f"| batch (sequences), {a.threads} thread(s), medians of {a.rounds} | " + " | ".join(map(str, batches)) + " |")
    print("| --- |" + " ---: |" * len(batches))
    for name, values in med.items():
        print(f"| {name}, tokens per CPU-second | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    if a.plot:
        from benchmarks.plots import lines

        lines(a.plot, f"SmolLM2-135M Q4_1 decode, {a.threads} thread(s): aggregate tokens per CPU-second",
              "sequences decoding together", "tokens per CPU-second", batches, med)


def ours_ms(path: str, quantize: str | None, profile: bool = False, compile: bool = False) -> float:
    import llmsplit

    m = llmsplit.load(path, max_context=640, max_batch=1, prefix_caching=False, quantize=quantize, compile=compile)
    prompt = m.tokenizer.encode("The history of the city of Rome begins")[:8]

    def cpu(n: int) -> float:
        start = time.process_time()
        m.generate(prompt, max_new_tokens=n, ignore_eos=True)
        return time.process_time() - start

    cpu(4)  # warm
    ms = (cpu(NEW + 1) - cpu(1)) / NEW * 1e3
    if profile:
        _profile(m, prompt)
    return ms


def _profile(m, prompt, n: int = 64) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        m.generate(prompt, max_new_tokens=n, ignore_eos=True)
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    kernel = [e for e in events if e.key == "aten::_weight_int4pack_mm_for_cpu"]
    print(f"profile, {n} tokens: {sum(e.count for e in events) / n:.0f} ops a token; int4 kernel "
          f"{sum(e.self_cpu_time_total for e in kernel) / total:.0%} of the ops' self time", flush=True)
    for e in sorted(kernel, key=lambda e: -e.self_cpu_time_total):
        print(f"  int4 {e.input_shapes[:2]}: {e.count / n:.1f} calls a token, "
              f"{e.self_cpu_time_total / total:.1%}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also profile the packed step (last round)")
    p.add_argument("--compile", action="store_true", help="also measure the compiled packed and fp32 steps")
    p.add_argument("--batches", help="aggregate decode at these batch sizes instead, e.g. 1,2,4,8,16")
    p.add_argument("--plot", help="with --batches: draw tokens per CPU-second against batch size to this PNG")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.batches:
        by_batch(a)
        return 0
    rows = {"llama.cpp": lambda last: llama_cpp_ms(a.gguf, a.threads),
            "llmsplit packed": lambda last: ours_ms(a.gguf, None, a.profile and last),
            "llmsplit fp32": lambda last: ours_ms(a.gguf, "none")}
    if a.compile:
        rows["llmsplit packed compiled"] = lambda last: ours_ms(a.gguf, None, compile=True)
        rows["llmsplit fp32 compiled"] = lambda last: ours_ms(a.gguf, "none", compile=True)
    if not (BIN / "llama-bench").exists():
        print(f"llama-bench not found in {BIN}: llama.cpp's row is left out", file=sys.stderr)
        del rows["llama.cpp"]
    for r in range(a.rounds):
        for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
            ms = rows[name](r == a.rounds - 1)
            print(f"round {r + 1} {name}: {ms:.2f} ms CPU a token ({1e3 / ms:.1f} tokens per CPU-second), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
