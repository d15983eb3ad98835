"""Decode tokens/s on a quiet and on a loaded machine, by OpenMP wait policy and thread count.

PyTorch's CPU build runs its parallel regions on libgomp. Between regions libgomp's threads
spin (GOMP_SPINCOUNT, 300,000 pause loops by default, milliseconds on these CPUs) before
they sleep. On a quiet machine the spin saves a wake-up per region; when another process
wants the cores, a thread that spins burns the time slice its partner needs to reach the
barrier, and 2-thread decode collapsed (issue 23). Each setting below runs in a fresh
process (libgomp reads its variables once, at load), first on the quiet machine, then while
a second 2-thread decode job (libgomp's defaults, 2 fixed threads, as an unaware neighbour
would run) shares the cores; rounds alternate the order of the settings. The fixed rows set
OMP_NUM_THREADS, which turns llmsplit's thread tuner off (`llmsplit/threads.py`); the last
row is llmsplit as it runs by default, the tuner choosing 2 threads or 1 as it decodes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TITLE = "Decode under CPU contention: OpenMP wait policy and threads (batch 1, eager)"
# (name, environment, threads); the first is libgomp's own default, the baseline of the ratios.
SETTINGS = [
    ("libgomp default (spin 300k), 2 threads", {"OMP_NUM_THREADS": "2"}, 2),
    ("OMP_WAIT_POLICY=PASSIVE, 2 threads", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}, 2),
    ("1 thread", {"OMP_NUM_THREADS": "1"}, 1),
    ("OMP_PROC_BIND=close OMP_PLACES=cores (threads pinned), 2 threads",
     {"OMP_NUM_THREADS": "2", "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, 2),
    ("llmsplit default: 2 threads, tuned as it decodes", {}, 2),
]
_OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES")


def decode_rate(source: str, threads: int, seconds: float, new: int, forever: bool = False) -> float:
    """Tokens/s of greedy batch-1 decode after a short prompt, over at most `new` tokens or
    `seconds` (whichever ends first; under contention a token can take a second)."""
    import torch

    import llmsplit
    from llmsplit.infer.engine import SamplingParams

    torch.set_num_threads(threads)
    # As `llmsplit generate` loads (the tuner turns itself off where OMP_NUM_THREADS is set).
    model = llmsplit.load(source, device_map="cpu", max_batch=1, max_context=new + 16, tune_threads=True)
    ids = model.tokenizer.encode("The capital of France is")
    model.generate(ids, max_new_tokens=4, ignore_eos=True)  # warm-up
    while True:
        engine = model.engine
        seq = engine.new_sequence(ids, SamplingParams(new, ignore_eos=True))
        engine.waiting.append(seq)
        engine.step()  # prefill and the first token: not decode
        start, first = time.perf_counter(), len(seq.tokens)
        while seq.finish_reason is None and time.perf_counter() - start < seconds:
            engine.step()
        rate = (len(seq.tokens) - first) / (time.perf_counter() - start)
        engine.abort(seq)
        if not forever:
            return rate


def _worker_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _OMP_KEYS}
    return {**env, **extra}  # exactly this setting, whatever this shell had set


def _measure(source: str, env: dict, threads: int, seconds: float, new: int) -> float:
    code = (f"import json, benchmarks.threads as b; print(json.dumps(b.decode_rate({source!r}, {threads}, "
            f"{seconds}, {new})))")
    out = subprocess.run([sys.executable, "-c", code], env=_worker_env(env), capture_output=True, text=True,
                         cwd=Path(__file__).parent.parent, timeout=600)
    if out.returncode:
        raise RuntimeError(f"decode worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _start_neighbour(source: str, settle_s: float) -> subprocess.Popen:
    code = f"import benchmarks.threads as b; b.decode_rate({source!r}, 2, 1e9, 10**9, forever=True)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=_worker_env({"OMP_NUM_THREADS": "2"}),
                            cwd=Path(__file__).parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(settle_s)  # past its imports and load: decoding when the measurement starts
    return proc


def _source(tmp: Path, quick: bool) -> tuple[str, str]:
    from .infer import _random_llama, _smollm_gguf

    gguf = None if quick else _smollm_gguf(tmp)
    if gguf is not None:
        return str(gguf), "SmolLM2-135M-Instruct (Q4_1 GGUF, its int4 weights kept packed: the default load)"
    return str(_random_llama(tmp)), "random Llama, 4 layers, dim 256"


def main(quick: bool = False, rounds: int = 3, only: tuple[int, ...] | None = None) -> dict:
    """`only`: indices into SETTINGS to run (default all; the first is the ratios' baseline)."""
    rounds, seconds, new = (1, 1.0, 8) if quick else (rounds, 14.0, 512)
    settings = SETTINGS[-1:] if quick else [SETTINGS[i] for i in (only or range(len(SETTINGS)))]
    with tempfile.TemporaryDirectory() as tmp:
        source, label = _source(Path(tmp), quick)
        rates, loads = quiet_and_loaded(settings, rounds, source, 2 if quick else 8, "tokens/s",
                                        lambda setting, _: _measure(source, setting[1], setting[2], seconds, new))
    return {"model": label, "rounds": rounds, "seconds": seconds, "new": new,
            **summary(settings, rates, loads, speed=lambda rate: rate)}


def quiet_and_loaded(settings: list, rounds: int, source: str, settle_s: float, unit: str, measure) -> tuple:
    """Every setting measured alone, then beside the neighbour (`_start_neighbour`), the order
    of the settings alternating round by round; `measure(setting, tag)` gives one figure
    (`tag` names the round, condition and place). Returns ({(name, condition): figures},
    {condition: load averages})."""
    figures = {(name, cond): [] for name, *_ in settings for cond in ("quiet", "loaded")}
    loads = {"quiet": [], "loaded": []}
    for r in range(rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for cond in ("quiet", "loaded"):
            neighbour = _start_neighbour(source, settle_s) if cond == "loaded" else None
            try:
                for i, setting in enumerate(order):
                    figures[setting[0], cond].append(measure(setting, f"{r}-{cond}-{i}"))
                    loads[cond].append(os.getloadavg()[0])
                    print(f"round {r + 1} {cond}: {setting[0]} {figures[setting[0], cond][-1]:.3g} {unit} "
                          f"(load {loads[cond][-1]:.1f})", file=sys.stderr)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
    return figures, loads


def summary(settings: list, figures: dict, loads: dict, speed) -> dict:
    """Medians and the ratios of the report: `speed(figure)` turns a median into a speed
    (tokens/s as they are; a step time into its inverse). The first setting is the baseline."""
    med = {k: statistics.median(v) for k, v in figures.items()}
    fast = {k: speed(v) for k, v in med.items()}
    base = settings[0][0]
    return {"settings": [s[0] for s in settings], "figures": {f"{n}|{c}": v for (n, c), v in figures.items()},
            "median": {f"{n}|{c}": v for (n, c), v in med.items()},
            "quiet_vs_default": {n: fast[n, "quiet"] / fast[base, "quiet"] for n, *_ in settings},
            "loaded_vs_quiet": {n: fast[n, "loaded"] / fast[n, "quiet"] for n, *_ in settings},
            "loaded_vs_default_quiet": {n: fast[n, "loaded"] / fast[base, "quiet"] for n, *_ in settings},
            "load_average": {c: statistics.median(v) for c, v in loads.items()}}


def to_markdown(r: dict) -> list[str]:
    rows = [f"{r['model']}; greedy decode at batch 1 after a 6-token prompt, at most {r['new']} tokens or "
            f"{r['seconds']:.0f} s per measurement; median of {r['rounds']} alternating rounds, each setting in a "
            f"fresh process. Loaded: a second 2-thread decode job (libgomp defaults) runs beside it. Median load "
            f"average: quiet {r['load_average']['quiet']:.1f}, loaded {r['load_average']['loaded']:.1f}.", "",
            *table(r, "tokens/s", "quiet vs libgomp default", lambda rate: f"{rate:.2f}")]
    return rows


def table(r: dict, unit: str, quiet_ratio: str, figure) -> list[str]:
    """The markdown table of a `summary`: each setting's two medians (`figure` formats one)
    and its three ratios."""
    rows = [f"| setting | quiet {unit} | loaded {unit} | {quiet_ratio} | loaded vs own quiet | "
            "loaded vs default quiet |", "|---|---|---|---|---|---|"]
    for n in r["settings"]:
        rows.append(f"| {n} | {figure(r['median'][f'{n}|quiet'])} | {figure(r['median'][f'{n}|loaded'])} | "
                    f"{r['quiet_vs_default'][n]:.2f}x | {r['loaded_vs_quiet'][n]:.2f}x | "
                    f"{r['loaded_vs_default_quiet'][n]:.2f}x |")
    return rows
