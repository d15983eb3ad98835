"""Serving under load: `llmsplit serve` with 1, 8 and 24 concurrent streaming clients
against the same server answering one request at a time.

Each client sends its requests back to back (streaming, greedy, a fixed number of new tokens
with EOS ignored, so every answer has the same length); throughput is all generated tokens
over the wall time, latency is per request, time to first token is when its first text
chunk arrives. The peer here is the one-at-a-time server: continuous batching is worth what
it adds over it. Full mode serves SmolLM2-135M-Instruct (the GGUF the inference benchmark
uses); quick mode a small random Llama.
"""

from __future__ import annotations

import json
import os
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

TITLE = "Serving: continuous batching under concurrent clients (llmsplit serve, CPU, fp32)"
PROMPT = "Write a short story about a lighthouse keeper."


def _start(model: Path, log: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "llmsplit", "serve", "--model", str(model), "--port", "0",
                                 "--max-batch", str(max_batch), "--max-context", "256"],
                                stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 300
    while not (m := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"llmsplit serve did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, m.group(1)


def _one(url: str, new: int) -> tuple[float, float, int]:
    """(latency s, time to first token s, completion tokens) of one streaming request."""
    import httpx

    body = {"prompt": PROMPT, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:  # text, or the end of an answer without any
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    assert tokens == new, tokens
    return time.perf_counter() - t0, first, tokens


def _load(url: str, clients: int, per_client: int, new: int) -> dict:
    results, errors = [], []

    def client():
        try:
            for _ in range(per_client):
                results.append(_one(url, new))
        except Exception as e:  # reported below; a thread cannot raise into the benchmark
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    lat = sorted(r[0] for r in results)
    ttft = sorted(r[1] for r in results)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"clients": clients, "requests": len(results), "tokens_per_s": sum(r[2] for r in results) / wall,
            "p50_latency_s": statistics.median(lat), "p95_latency_s": pct(lat, 0.95),
            "p50_ttft_s": statistics.median(ttft), "p95_ttft_s": pct(ttft, 0.95)}


def main(quick: bool = False) -> dict:
    levels, per_client, new = ((2,), 1, 8) if quick else ((1, 8, 24), 2, 32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gguf = None if quick else _smollm_gguf(tmp)
        model, label = ((gguf, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)") if gguf is not None
                        else (_random_llama(tmp), "random Llama, 4 layers, dim 256"))
        rows = []
        for clients in levels:
            # One at a time is the same server with a batch of one; the others batch everyone.
            for max_batch in sorted({1, clients}):
                proc, url = _start(model, tmp / f"serve-{clients}-{max_batch}.log", max_batch)
                try:
                    _one(url, 2)  # warm-up
                    row = _load(url, clients, per_client, new)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(120)
                row["max_batch"] = max_batch
                rows.append(row)
                print(f"{clients} clients, max batch {max_batch}: {row['tokens_per_s']:.1f} tokens/s",
                      file=sys.stderr)
    serial = {r["clients"]: r for r in rows if r["max_batch"] == 1}
    batched = {r["clients"]: r for r in rows if r["max_batch"] == r["clients"]}
    return {"model": label, "new_tokens": new, "per_client": per_client, "threads": os.cpu_count(),
            "rows": [batched[c] for c in levels], "serial": [serial[c] for c in levels],
            "speedup": {c: batched[c]["tokens_per_s"] / serial[c]["tokens_per_s"] for c in levels}}


def to_markdown(r: dict) -> list[str]:
    out = [f"{r['model']}; each client sends {r['per_client']} streaming requests back to back, greedy, "
           f"{r['new_tokens']} new tokens each (EOS ignored); one server per row.", "",
           "| clients | server | requests | tokens/s | vs one at a time | p50 latency s | p95 latency s "
           "| p50 TTFT s | p95 TTFT s |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for batched, serial in zip(r["rows"], r["serial"]):
        for row, name in ((serial, "one at a time"), (batched, "continuous batching")):
            if name == "continuous batching" and row is serial:
                continue
            ratio = row["tokens_per_s"] / serial["tokens_per_s"]
            out.append(f"| {row['clients']} | {name} | {row['requests']} | {row['tokens_per_s']:.1f} | "
                       f"{'**' if row is batched else ''}{ratio:.2f}x{'**' if row is batched else ''} | "
                       f"{row['p50_latency_s']:.2f} | {row['p95_latency_s']:.2f} | {row['p50_ttft_s']:.2f} | "
                       f"{row['p95_ttft_s']:.2f} |")
    return out
