"""Serving under load, side by side: `llmsplit serve` against its previous engine (a checkout
of an older commit, `LLMSPLIT_PREVIOUS_SRC`, default /work/wt/prev/src, run with the same flags) and llama.cpp's
`llama-server` (`LLAMA_SERVER`, default the peers build) on the same GGUF file, with as many
slots as llmsplit has batch rows.

Each of 32 clients sends one streaming request (a seeded workload: prompts of 16-1,024
random token ids, 16-256 new tokens, greedy, EOS ignored, so every server does the same
work); systems alternate round by round and medians are reported. Throughput is every
output token over the wall time, TTFT is when a request's first text chunk arrives, ITL
(inter-token latency) the gaps between a stream's later chunks, all streams' gaps together:
what a longer --max-num-batched-tokens costs the streams already running. For
llmsplit alone: KV waste ((reserved - used) / reserved, sampled from /metrics during the
load), a shared 1,000-token system prompt (second request's TTFT against the first's),
100 json_schema responses validated, and the same load on a KV pool sized for 8 sequences
(every request completes; preemptions counted). Full mode serves SmolLM2-135M-Instruct;
quick mode a small random Llama with a lighter load.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .infer import _random_llama, _smollm_gguf
from .llama_cpp import llama_cpp_setting, repack_flags

TITLE = "Serving: 32 concurrent clients, mixed prompt and answer lengths (CPU, 2 threads)"
BUDGET = 512  # llmsplit's --max-num-batched-tokens here
NARROW_KV = "bfloat16"  # the second llmsplit row's --kv-dtype
# SERVE_BUDGETS=1024,2048: a row for llmsplit at each of these --max-num-batched-tokens too (the
# trade a budget makes: prompts fill in fewer steps, while each running stream waits a longer step).
EXTRA_BUDGETS = [int(b) for b in os.environ.get("SERVE_BUDGETS", "").split(",") if b.strip()]
# LLAMA_SERVER_SETTINGS="-b 512 -ub 512;-np 16": a llama-server row with each of these flag sets too, the
# same tuning effort as SERVE_BUDGETS gives llmsplit (its batch -b, micro-batch -ub, slots -np).
LLAMA_SETTINGS = [s.split() for s in os.environ.get("LLAMA_SERVER_SETTINGS", "").split(";") if s.strip()]
PREVIOUS = Path(os.environ.get("LLMSPLIT_PREVIOUS_SRC", "/work/wt/prev/src"))
# SERVE_SPECULATIVE=ngram: a row for llmsplit with --speculative ngram too (issue 46: throughput
# under many streams no lower than without; SERVE_CLIENTS=16 for the 16 streams).
SPECULATIVE = os.environ.get("SERVE_SPECULATIVE", "")
CLIENTS = int(os.environ.get("SERVE_CLIENTS", "32"))
EXTRAS = os.environ.get("SERVE_EXTRAS", "1") != "0"  # 0: no prefix / json_schema / small-pool runs after the rounds
# SERVE_ONLY="llmsplit,previous engine": run only these rows (names as in the table).
ONLY = {name.strip() for name in os.environ.get("SERVE_ONLY", "").split(",") if name.strip()}
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", Path.home() / ".cache/llmsplit-peers/llama_cpp_python-0.3.36"
                                                                 "/build/bin/llama-server"))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]},
                                                         "maxItems": 3}},
          "required": ["name", "age", "languages"], "additionalProperties": False}


def _start(cmd: list[str], log: Path, env: dict | None = None, ready=r"at (http://127\.0\.0\.1:\d+)/v1",
           url: str | None = None) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 600
    while not (m := re.search(ready, log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{cmd[0]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, url or m.group(1)


def _prime(start, log: Path) -> str:
    """Pay --compile auto's one-time cost before the rounds, as a user's first start does: serve
    until the background build of this configuration's decode step is stored and swapped in
    (each round's start then compiles from it). Returns how the start line says it decodes."""
    proc, _ = start(log)
    try:
        deadline = time.monotonic() + 1800
        while not re.search(r"\(decode (compiled|eager);|swapped in", text := log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the compiled decode step was not stored:\n{text[-2000:]}")
            time.sleep(2)
        return "compiled (built and swapped in)" if "swapped in" in text else _decode_mode(text)
    finally:
        _stop(proc)


def _decode_mode(log_text: str) -> str:
    """What serve's start line says of its decode steps (compiled, or eager)."""
    m = re.search(r"\(decode ([^;]+);", log_text)
    return m.group(1) if m else "unknown"


def _llmsplit(model: Path, log: Path, src: Path, batch: int, context: int, *flags: str):
    return _start([sys.executable, "-m", "llmsplit", "serve", "--model", str(model), "--port", "0", "--max-batch",
                   str(batch), "--max-context", str(context), "--max-queue", "256", *flags], log,
                  env={"PYTHONPATH": str(src), "OMP_NUM_THREADS": "2"})


def _llama_server(model: Path, log: Path, batch: int, context: int, *flags: str):
    """llama-server at its defaults (repacking off only on an AMX CPU: llama_cpp.repack_flags) with
    `batch` slots of `context` tokens each, or `-np N` of `flags`' slots; `flags` its tuning."""
    port = 8900 + random.randrange(90)
    at = flags.index("-np") if "-np" in flags else None
    slots = batch if at is None else int(flags[at + 1])
    rest = flags if at is None else flags[:at] + flags[at + 2:]
    return _start([str(LLAMA_SERVER), "-m", str(model), "-t", "2", "-np", str(slots), "-c", str(slots * context),
                   "--port", str(port), "--host", "127.0.0.1", *repack_flags("llama-server"), *rest], log,
                  ready=r"listening on http", url=f"http://127.0.0.1:{port}")


def workload(n: int, seed: int, vocab: int, prompt=(16, 1024), new=(16, 256)) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(200, vocab - 1) for _ in range(rng.randint(*prompt))], rng.randint(*new))
            for _ in range(n)]


def _one(url: str, prompt, new: int) -> tuple[float, float, int, list[float]]:
    """(latency s, time to first token s, completion tokens, the gaps s between its text
    chunks after the first: inter-token latency, a chunk being a token's text or, where the
    server held text back, the tokens since) of one streaming request."""
    import httpx

    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens, gaps, last = None, 0, [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk, now = json.loads(line[6:]), time.perf_counter()
            if chunk.get("choices"):
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return time.perf_counter() - t0, first, tokens, gaps


def _metrics(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^llmsplit_(\w+) (\S+)$", text, re.M)}


def _load(url: str, jobs, watch_kv: bool = False) -> dict:
    results, errors, waste, done = [], [], [], threading.Event()

    def client(prompt, new):
        try:
            results.append(_one(url, prompt, new))
        except Exception as e:  # reported below; a thread cannot raise into the benchmark
            errors.append(repr(e))

    def watch():
        while not done.wait(0.5):
            m = _metrics(url)
            if m.get("kv_tokens_reserved"):
                waste.append(1 - m["kv_tokens_used"] / m["kv_tokens_reserved"])

    threads = [threading.Thread(target=client, args=job) for job in jobs]
    watcher = threading.Thread(target=watch) if watch_kv else None
    t0 = time.perf_counter()
    for t in threads + ([watcher] if watcher else []):
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done.set()
    ttft = sorted(r[1] for r in results if r[1] is not None)
    itl = sorted(g for r in results for g in r[3])
    out = {"requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
           "tokens_per_s": sum(r[2] for r in results) / wall, "wall_s": wall,
           "p50_ttft_s": _median(ttft), "p99_ttft_s": _p99(ttft), "p50_itl_s": _median(itl), "p99_itl_s": _p99(itl)}
    if waste:
        out["kv_waste"] = statistics.median(waste)
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _p99(sorted_values: list[float]) -> float | None:
    return sorted_values[min(len(sorted_values) - 1, int(0.99 * len(sorted_values)))] if sorted_values else None


def _prefix(url: str, vocab: int) -> dict:
    rng = random.Random(7)
    system = [rng.randrange(200, vocab - 1) for _ in range(1000)]
    first = _one(url, system + [rng.randrange(200, vocab - 1) for _ in range(12)], 4)[1]
    second = _one(url, system + [rng.randrange(200, vocab - 1) for _ in range(12)], 4)[1]
    return {"first_ttft_s": first, "second_ttft_s": second, "ratio": first / second}


def _json_schema(url: str, n: int) -> dict:
    import httpx
    import jsonschema

    valid, lock = [], threading.Lock()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}

    def ask(i):
        body = {"messages": [{"role": "user", "content": f"Describe programmer number {i} as JSON."}],
                "response_format": fmt, "max_tokens": 120, "temperature": 0.7, "seed": i}
        text = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800).json()["choices"][0]["message"][
            "content"]
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            ok = True
        except (ValueError, jsonschema.ValidationError):
            ok = False
        with lock:
            valid.append(ok)

    for start in range(0, n, 32):
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(start, min(n, start + 32))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"valid": sum(valid), "asked": n}


def _stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()


def main(quick: bool = False) -> dict:
    clients, rounds = (4, 1) if quick else (CLIENTS, int(os.environ.get("SERVE_ROUNDS", "2")))
    prompt, new = ((8, 48), (4, 16)) if quick else ((16, 1024), (16, 256))
    context = prompt[1] + new[1]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = None if quick else _smollm_gguf(tmp)
        model, label, vocab = ((gguf, "SmolLM2-135M-Instruct (Q4_1 GGUF: llmsplit keeps it packed, the previous "
                                      "engine widens it to fp32, llama-server runs it as it is)", 49152)
                               if gguf is not None else (_random_llama(tmp), "random Llama, 4 layers, dim 256", 300))
        here = Path(__file__).resolve().parent.parent / "src"
        # A step's budget: the running streams keep their pace while the 32 prompts fill, oldest first.
        budget = ("--max-num-batched-tokens", str(BUDGET))
        systems = {"llmsplit": lambda log: _llmsplit(model, log, here, clients, context, *budget)}
        if not quick:  # half the bytes of keys and values read a step (llama-server's cache is f16)
            systems[f"llmsplit --kv-dtype {NARROW_KV}"] = lambda log: _llmsplit(
                model, log, here, clients, context, *budget, "--kv-dtype", NARROW_KV)
        if SPECULATIVE:
            systems[f"llmsplit --speculative {SPECULATIVE}"] = lambda log: _llmsplit(
                model, log, here, clients, context, *budget, "--speculative", SPECULATIVE)
        for tokens in EXTRA_BUDGETS:
            systems[f"llmsplit --max-num-batched-tokens {tokens}"] = lambda log, tokens=tokens: _llmsplit(
                model, log, here, clients, context, "--max-num-batched-tokens", str(tokens))
        if not quick and (PREVIOUS / "llmsplit").is_dir():  # the same flags as the llmsplit row
            systems["previous engine"] = lambda log: _llmsplit(model, log, PREVIOUS, clients, context, *budget)
        if not quick and gguf is not None and LLAMA_SERVER.exists():
            systems["llama-server"] = lambda log: _llama_server(model, log, clients, context)
            for flags in LLAMA_SETTINGS:
                systems[f"llama-server {' '.join(flags)}"] = lambda log, flags=flags: _llama_server(
                    model, log, clients, context, *flags)
        if ONLY:  # SERVE_ONLY: a side-by-side of some rows (e.g. a change against the commit before it)
            systems = {name: start for name, start in systems.items() if name in ONLY}
        for name, start in systems.items():
            if name.startswith("llmsplit") and not quick:
                print(f"{name}: {_prime(start, tmp / f'{name}-prime.log')} after priming", file=sys.stderr)
        runs: dict[str, list[dict]] = {name: [] for name in systems}
        loads = []
        for r in range(rounds):
            jobs = workload(clients, seed=r, vocab=vocab, prompt=prompt, new=new)
            loads.append(os.getloadavg()[0])
            order = list(systems.items())
            # Alternating: every system sees every round's load, first on even rounds, last on odd ones.
            for name, start in (order if r % 2 == 0 else order[::-1]):
                proc, url = start(tmp / f"{name}-{r}.log")
                try:
                    _one(url, jobs[0][0][:8], 2)  # warm-up
                    runs[name].append(_load(url, jobs, watch_kv=name == "llmsplit"))
                    if name.startswith("llmsplit"):
                        runs[name][-1]["decode"] = _decode_mode((tmp / f"{name}-{r}.log").read_text())
                finally:
                    _stop(proc)
                print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr)
        extra = {"prefix": None, "json_schema": None, "small_pool": None}
        if not quick and EXTRAS:
            proc, url = _llmsplit(model, tmp / "extra.log", here, clients, context, *budget)
            try:
                # The json_schema check needs xgrammar (the server's) and jsonschema (this side's).
                checkable = all(importlib.util.find_spec(m) for m in ("xgrammar", "jsonschema"))
                extra["prefix"], extra["json_schema"] = _prefix(url, vocab), _json_schema(url, 100) if checkable else None
            finally:
                _stop(proc)
        if quick or EXTRAS:  # A pool for 8 whole sequences under 32 clients: blocks on demand, preemption, no failure.
            proc, url = _llmsplit(model, tmp / "small.log", here, clients, context, *budget, "--kv-tokens",
                                  str(8 * context))
            try:
                extra["small_pool"] = _load(url, workload(clients, seed=99, vocab=vocab, prompt=prompt, new=new))
                extra["small_pool"]["preemptions"] = _metrics(url)["preemptions_total"]
            finally:
                _stop(proc)
        print(f"extra: {extra}", file=sys.stderr)
    keys = ("tokens_per_s", "p50_ttft_s", "p99_ttft_s", "p50_itl_s", "p99_itl_s")
    summary = {name: {k: _median([x[k] for x in rs if x[k] is not None]) for k in keys}
               for name, rs in runs.items()}
    wastes = [x["kv_waste"] for x in runs["llmsplit"] if "kv_waste" in x]
    summary["llmsplit"]["kv_waste"] = statistics.median(wastes) if wastes else None
    return {"model": label, "clients": clients, "rounds": rounds, "prompt": prompt, "new": new,
            "order": list(systems), "summary": summary, "runs": runs, "extra": extra, "loadavg": loads, "missing": [
                n for n in ("previous engine", "llama-server") if n not in systems]}


def to_markdown(r: dict) -> list[str]:
    s = r["summary"]
    out = [f"{r['model']}; {r['clients']} clients at once, one streaming request each, prompts of "
           f"{r['prompt'][0]}-{r['prompt'][1]} token ids and {r['new'][0]}-{r['new'][1]} new tokens (seeded, greedy, "
           f"EOS ignored); llmsplit with --max-num-batched-tokens {BUDGET}; medians of {r['rounds']} alternating rounds; 1-min load average at each round's start: "
           f"{', '.join(f'{x:.2f}' for x in r['loadavg'])}; round 0 ran {', '.join(r.get('order', []))}, "
           f"round 1 the reverse; {llama_cpp_setting()}, {r['clients']} slots unless -np says.", "",
           "| server | output tokens/s | llmsplit ÷ this | TTFT p50 s | TTFT p99 s | ITL p50 s | ITL p99 s |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in s.items():
        out.append(f"| {name} | {row['tokens_per_s']:.1f} | {s['llmsplit']['tokens_per_s'] / row['tokens_per_s']:.2f}x "
                   f"| {_seconds(row['p50_ttft_s'], 2)} | {_seconds(row['p99_ttft_s'], 2)} "
                   f"| {_seconds(row['p50_itl_s'], 3)} | {_seconds(row['p99_itl_s'], 3)} |")
    for name in r["missing"]:
        out.append(f"| {name} | not run (not found, or quick mode) | | | | | |")
    e, waste = r["extra"], s["llmsplit"]["kv_waste"]
    out += ["", f"- KV waste under that load (llmsplit, /metrics every 0.5 s): "
                f"{'not sampled' if waste is None else f'{100 * waste:.1f}% of reserved slots'}."]
    if e.get("prefix"):
        p = e["prefix"]
        out.append(f"- Shared 1,000-token system prompt: first TTFT {p['first_ttft_s']:.2f} s, second "
                   f"{p['second_ttft_s']:.3f} s ({p['ratio']:.1f}x faster).")
    j, small = e["json_schema"], e["small_pool"]
    if j:
        out.append(f"- json_schema: {j['valid']} / {j['asked']} responses parse and validate against their schema.")
    if small:
        out.append(f"- KV pool for 8 sequences, {r['clients']} clients: {small['requests']} completed, "
                   f"{small['errors']} errors, {small['preemptions']:.0f} preemptions, {small['tokens_per_s']:.1f} tokens/s.")
    return out


def _seconds(x: float | None, digits: int) -> str:
    """A latency cell; none measured (a stream of a single chunk: the quick mode's random
    model has tokens that decode to no text) shows as a dash."""
    return "-" if x is None else f"{x:.{digits}f}"


def plot(r: dict, out_dir) -> list:
    from .plots import bars

    names = list(r["summary"])
    return [bars(Path(out_dir) / "serve.png", f"{r['model']}: {r['clients']} clients", names,
                 [("output tokens/s", [r["summary"][n]["tokens_per_s"] for n in names]),
                  ("TTFT p50 s", [r["summary"][n]["p50_ttft_s"] for n in names])])]
