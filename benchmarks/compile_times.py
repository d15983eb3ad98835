"""`python -m benchmarks.compile_times [MODEL]`: how long `llmsplit.load(compile=True)` takes with
a cold and a warm inductor cache, and how many graphs 20 realistic requests compile after it
(issue 23: none may). MODEL defaults to SmolLM2-135M-Instruct's Q4_1 GGUF (downloaded as in
`benchmarks/infer.py`). Each load runs in a fresh process; the cold one in an empty
TORCHINDUCTOR_CACHE_DIR, the warm one reusing it. Not part of `python -m benchmarks`: a cold
compile takes minutes, which its quick mode (run by the tests) cannot afford;
tests/test_infer_split.py::test_compiled_decode_step checks the same on a tiny model.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(source: str) -> dict:
    """In this process: load with compile=True, then 20 requests of 1-1,000-token prompts and
    1-256 new tokens at batch 1 to 4."""
    import torch
    from torch._dynamo.utils import counters

    import llmsplit
    from llmsplit.infer.engine import SamplingParams

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    t0 = time.perf_counter()
    model = llmsplit.load(source, device_map="cpu", compile=True, max_context=1400, max_batch=4)
    load_s = time.perf_counter() - t0
    at_load = counters["stats"]["unique_graphs"]
    rng, vocab = random.Random(0), model.config.vocab_size
    for i in range(20):
        requests = [([rng.randrange(100, vocab) for _ in range(rng.choice([1, 2, 3, 40, 200, 1000]))],
                     SamplingParams(rng.choice([1, 2, 9, 30, 256 if i % 5 == 0 else 3]), ignore_eos=True))
                    for _ in range([1, 2, 4, 3][i % 4])]
        model.engine.generate([model.engine.new_sequence(p, sp) for p, sp in requests])
    return {"load_s": load_s, "graphs_at_load": at_load, "graphs_after_requests": counters["stats"]["unique_graphs"],
            "load_average": os.getloadavg()[0]}


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = argv[0] if argv else None
        if source is None:
            from .infer import _smollm_gguf

            source = str(_smollm_gguf(Path(tmp)))
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        code = f"import json, benchmarks.compile_times as c; print(json.dumps(c.measure({source!r})))"
        for cache in ("cold", "warm"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 cwd=Path(__file__).parent.parent, check=True)
            print(cache, json.loads(out.stdout.strip().splitlines()[-1]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
