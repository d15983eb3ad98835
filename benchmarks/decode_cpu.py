"""CPU time per decoded token at batch 1: llmsplit packed and fp32 against llama.cpp on the same
GGUF file, and where llmsplit's packed step goes (torch.profiler, the int4 kernel per shape).

`python -m benchmarks.decode_cpu --gguf FILE.gguf [--rounds 2] [--threads 1] [--compile] [--profile]`
`python -m benchmarks.decode_cpu --gguf FILE.gguf --batches 1,2,4,8,16 [--plot docs/img/decode_batch.png]`
`python -m benchmarks.decode_cpu --gguf FILE.gguf --kernels [--threads 1]` (one-row int4 kernels per shape)

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

from .llama_cpp import BIN, repack_flags

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
                        "-r", "1", *repack_flags("llama-bench"), "-o", "json"])

    return (cpu(NEW + 16) - cpu(16)) / NEW * 1e3


def llama_cpp_batch_ms(path: str, threads: int, batch: int) -> float:
    """CPU ms per token of `batch` sequences decoding together (llama-batched-bench)."""
    def cpu(n: int) -> float:
        return _cpu_of([str(BIN / "llama-batched-bench"), "-m", path, "-t", str(threads), "-c", "4096",
                        *repack_flags("llama-batched-bench"), "-npp", "8", "-ntg", str(n), "-npl", str(batch)])

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


def ours_ms(path: str, quantize: str | None, profile: bool = False, compile: bool = False,
            aten_int4: bool = False) -> float:
    """`aten_int4`: PyTorch's int4 kernel at one row too, not int4_matmul.cpp (LLMSPLIT_INT4_KERNEL=0)."""
    from llmsplit.quant import kernels

    os.environ["LLMSPLIT_INT4_KERNEL"] = "0" if aten_int4 else "1"
    kernels.forget_native_int4()
    try:
        return _ours_ms(path, quantize, profile, compile)
    finally:
        os.environ.pop("LLMSPLIT_INT4_KERNEL")
        kernels.forget_native_int4()


def _ours_ms(path: str, quantize: str | None, profile: bool, compile: bool) -> float:
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
    kernel = [e for e in events if e.key in ("aten::_weight_int4pack_mm_for_cpu", "llmsplit::int4_mm")]
    print(f"profile, {n} tokens: {sum(e.count for e in events) / n:.0f} ops a token; int4 kernel "
          f"{sum(e.self_cpu_time_total for e in kernel) / total:.0%} of the ops' self time", flush=True)
    for e in sorted(kernel, key=lambda e: -e.self_cpu_time_total):
        print(f"  int4 {e.input_shapes[:2]}: {e.count / n:.1f} calls a token, "
              f"{e.self_cpu_time_total / total:.1%}", flush=True)


def kernel_table() -> None:
    """ms of CPU per one-row call, int4_matmul.cpp against aten's int4 kernel, on SmolLM2-135M's
    shapes with random weights: copies of each weight are cycled through (~64 MB, past the L3
    cache) so every call reads its weight from memory, as a decode step does."""
    import torch

    from llmsplit.quant import kernels
    from llmsplit.quant.formats import Groups

    if not kernels.native_int4_available():
        print("int4_matmul.cpp is not built on this machine (no compiler, or no AVX-512 VNNI/VBMI)")
        return
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    shapes = {"gate/up [3072, 576]": (3072, 576, False), "down [576, 1536]": (576, 1536, False),
              "q/k/v [960, 576]": (960, 576, False), "o [576, 576]": (576, 576, False),
              "head Q8_0 [49152, 576]": (49152, 576, True)}
    print(f"| one row, {torch.get_num_threads()} thread(s), weights cold | aten int4 ms | int4_matmul.cpp ms "
          "| ratio | GB/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (rows, inn, doubled) in shapes.items():
        cols = inn * (2 if doubled else 1)
        gen = torch.Generator().manual_seed(0)
        copies = [kernels.pack_int4(Groups(torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8),
                                           torch.rand(rows, cols // 32, generator=gen) * 0.02,
                                           torch.rand(rows, cols // 32, generator=gen) * 0.02, 32, doubled))
                  for _ in range(max(2, int(128e6 // (rows * cols))))]
        x = torch.randn(1, inn)
        xb = (torch.cat([x, x], 1) if doubled else x).bfloat16()
        calls = {"aten": lambda p, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, 32, sz),
                 "c": lambda p, sz: torch.ops.llmsplit.int4_mm(x, p, sz, rows, 32)}
        ms = {}
        for label, call in calls.items():
            times = []
            for _ in range(5):
                start = clock()
                for p, sz in copies:
                    call(p, sz)
                times.append((clock() - start) / len(copies) * 1e3)
            ms[label] = sorted(times)[2]
        print(f"| {name} | {ms['aten']:.3f} | {ms['c']:.3f} | {ms['aten'] / ms['c']:.2f} | "
              f"{rows * cols / 2 / 1e6 / ms['c']:.1f} |", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true", help="also profile the packed step (last round)")
    p.add_argument("--compile", action="store_true", help="also measure the compiled packed and fp32 steps")
    p.add_argument("--kernels", action="store_true", help="only the one-row int4 kernels per shape, cold weights")
    p.add_argument("--rows", help="only these rows, by name, comma-separated "
                                  "(e.g. 'llama.cpp,llmsplit packed compiled')")
    p.add_argument("--batches", help="aggregate decode at these batch sizes instead, e.g. 1,2,4,8,16")
    p.add_argument("--plot", help="with --batches: draw tokens per CPU-second against batch size to this PNG")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.kernels:
        kernel_table()
        return 0
    if a.batches:
        by_batch(a)
        return 0
    rows = {"llama.cpp": lambda last: llama_cpp_ms(a.gguf, a.threads),
            "llmsplit packed": lambda last: ours_ms(a.gguf, None, a.profile and last),
            "llmsplit packed (aten int4 kernel)": lambda last: ours_ms(a.gguf, None, aten_int4=True),
            "llmsplit fp32": lambda last: ours_ms(a.gguf, "none")}
    if a.compile:
        rows["llmsplit packed compiled"] = lambda last: ours_ms(a.gguf, None, compile=True)
        rows["llmsplit packed compiled (aten int4 kernel)"] = lambda last: ours_ms(a.gguf, None, compile=True,
                                                                                  aten_int4=True)
        rows["llmsplit fp32 compiled"] = lambda last: ours_ms(a.gguf, "none", compile=True)
    if not (BIN / "llama-bench").exists():
        print(f"llama-bench not found in {BIN}: llama.cpp's row is left out", file=sys.stderr)
        del rows["llama.cpp"]
    if a.rows:
        wanted = a.rows.split(",")
        if unknown := set(wanted) - set(rows):
            p.error(f"--rows: no row named {', '.join(sorted(unknown))}; the rows are {', '.join(rows)}")
        rows = {name: rows[name] for name in wanted}
    for r in range(a.rounds):
        for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
            ms = rows[name](r == a.rounds - 1)
            print(f"round {r + 1} {name}: {ms:.2f} ms CPU a token ({1e3 / ms:.1f} tokens per CPU-second), "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
