"""`--kv-dtype int8` and `--kv-dtype bfloat16` against the compute-dtype KV cache on one
model: pool bytes per token, mean NLL of 1,024 tokens of `pydoc_data.topics` read back
through the pool (64-token chunks, so every chunk attends to the earlier ones' keys and
values from the pool), and greedy agreement over 64 new tokens on four short prompts.

`python -m benchmarks.kv_int8 --model SmolLM2-135M-Instruct.Q4_1.gguf [--threads 2]`
"""

from __future__ import annotations

import argparse
import os
import sys

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "List three prime numbers:"]


def nll_through_the_pool(m, ids, chunk: int = 64) -> float:
    import torch
    import torch.nn.functional as F

    pool, logits = m.engine.pool, []
    for start in range(0, ids.numel(), chunk):
        part = ids[start:start + chunk]
        pool.append(0, part.numel())
        logits.append(m.runner.forward(part[None], pool.step([0], part.numel()), last_only=False)[0].float())
    pool.free(0)
    return F.cross_entropy(torch.cat(logits)[:-1], ids[1:]).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    import torch

    import llmsplit
    from llmsplit.infer.choices import KV_DTYPES

    from .quant import _text_ids

    torch.set_num_threads(a.threads)
    models = {kv or "compute dtype": llmsplit.load(a.model, max_context=1100, max_batch=1, kv_dtype=kv)
              for kv in (None, *KV_DTYPES)}
    ids = torch.tensor(_text_ids(next(iter(models.values())).tokenizer, 1023))
    nll = {}
    for name, m in models.items():
        c = m.runner.cache
        nll[name] = nll_through_the_pool(m, ids)
        print(f"{name}: {c.nbytes() / c.k[min(c.k)].shape[0]:.0f} pool bytes a token, mean NLL {nll[name]:.5f} "
              f"({ids.numel()} tokens), load {os.getloadavg()[0]:.1f}", flush=True)
    base = [models["compute dtype"].generate(q, max_new_tokens=64, ignore_eos=True) for q in PROMPTS]
    for kv in KV_DTYPES:
        same = [models[kv].generate(q, max_new_tokens=64, ignore_eos=True) == b for q, b in zip(PROMPTS, base)]
        differ = ", ".join(repr(q) for q, s in zip(PROMPTS, same) if not s) or "none"
        print(f"NLL {kv} - compute dtype: {nll[kv] - nll['compute dtype']:+.5f}; greedy 64 tokens identical on "
              f"{sum(same)}/{len(same)} prompts ({differ} differ)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
