"""Speculative decoding against none, side by side in one process: decode tokens/s of
`llmsplit.load(..., speculative="ngram")`, with `--draft` of a draft model's proposals
(`speculative=PATH`, e.g. one distilled with train.teacher: docs/guide.md), and of the default
engine on the same GGUF file,
greedy (so both produce the same tokens, which the benchmark checks), prompts in the model's
chat template.

`python -m benchmarks.speculative --gguf FILE.gguf [--rounds 3] [--tokens 4] [--max-new-tokens 128]
[--draft DRAFT --draft-tokens 3] [--compile now] [--llama-server]`

Two prompt sets: `grounded` (the answer quotes its input: edit this code, copy a passage,
answer from a document), where prompt lookup finds what comes next, and `open` (chat without
a text to quote), where it rarely does and should cost little. Decode tokens/s counts the
tokens after the first over the time after the first (the prompt's time is the same on both
sides). Rounds alternate the order; each round prints as measured with the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

CODE = '''def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config


def merge_configs(base, override):
    merged = dict(base)
    for key, value in override.items():
        merged[key] = value
    return merged
'''
DOCUMENT = ("The lighthouse at Point Arena was built in 1870 and rebuilt in 1907 after the earthquake of 1906 "
            "damaged its tower beyond repair. The new tower, 115 feet tall, was the first in the United States "
            "built of reinforced concrete. Its first-order Fresnel lens, made in France, was lit by a kerosene "
            "lamp until 1940, when electric light replaced it. Today the lighthouse is a museum, and visitors can "
            "climb the 145 steps to the top of the tower.")
GROUNDED = [
    f"Add a docstring to each function of this code and return the whole code:\n\n{CODE}",
    f"Rename the variable `config` to `settings` in this code and return the whole code:\n\n{CODE}",
    f"Here is a text:\n\n{DOCUMENT}\n\nCopy the text exactly, word for word.",
    f"Document:\n{DOCUMENT}\n\nAnswer from the document, quoting its sentences: when was the tower rebuilt, "
    f"what is it built of, and what lit its lens?",
]
OPEN = ["Write a short story about a cat who learns to fly.", "What are three tips for staying productive?",
        "Explain how a rainbow forms.", "Write a poem about the sea."]


def decode_rate(m, ids: list[int], max_new: int) -> tuple[float, list[int]]:
    """(decode tokens/s, tokens) of one greedy answer."""
    from llmsplit.infer.engine import SamplingParams

    marks: list[float] = []
    m.engine.on_latency = lambda first, _s: marks.append(time.perf_counter())
    seq = m.engine.new_sequence(ids, SamplingParams(max_new))
    m.engine.generate([seq])
    return (len(marks) - 1) / (marks[-1] - marks[0]), seq.tokens


class LlamaServer:
    """llama.cpp's llama-server on the same GGUF file (benchmarks/serve.py starts it: its defaults,
    one slot, `-t` 2), with `flags` (e.g. `--spec-type ngram-simple`, its prompt lookup); decode
    tokens/s as its own timings give them (`predicted_per_second`: the tokens generated over the
    time after the prompt), greedy, EOS ignored, the same token ids as llmsplit's side."""

    def __init__(self, gguf: str, log: Path, *flags: str):
        from .serve import _llama_server

        self.proc, self.url = _llama_server(Path(gguf), log, 1, 2048, *flags)

    def decode_rate(self, ids: list[int], max_new: int) -> tuple[float, list[int]]:
        import httpx

        body = {"prompt": ids, "n_predict": max_new, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True}
        reply = httpx.post(f"{self.url}/completion", json=body, timeout=600).json()
        return reply["timings"]["predicted_per_second"], reply.get("tokens", [])

    def close(self) -> None:
        from .serve import _stop

        _stop(self.proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4, help="--speculative-tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft", help="also a draft model's proposals (--speculative PATH)")
    p.add_argument("--draft-tokens", type=int, default=3, help="--speculative-tokens with --draft")
    p.add_argument("--llama-server", action="store_true",
                   help="also llama.cpp's llama-server without and with --spec-type ngram-simple (its prompt lookup)")
    p.add_argument("--compile", choices=("off", "now"), default="off",
                   help="now: every side decodes compiled (what --compile auto gives once its build is stored)")
    a = p.parse_args()
    import llmsplit

    common = dict(max_batch=1, max_context=1024, compile=a.compile)
    models = {"none": llmsplit.load(a.gguf, **common),
              "ngram": llmsplit.load(a.gguf, **common, speculative="ngram", speculative_tokens=a.tokens)}
    if a.draft:
        models["draft"] = llmsplit.load(a.gguf, **common, speculative=a.draft, speculative_tokens=a.draft_tokens)
    peers = {}
    if a.llama_server:
        logs = Path(tempfile.mkdtemp(prefix="spec-llama-"))
        peers = {"llama.cpp": LlamaServer(a.gguf, logs / "none.log"),
                 "llama.cpp ngram-simple": LlamaServer(a.gguf, logs / "ngram.log", "--spec-type", "ngram-simple")}
    try:
        _rounds(a, models, peers)
    finally:
        for peer in peers.values():
            peer.close()


def _rounds(a, models: dict, peers: dict) -> None:
    from llmsplit.infer.chat import chat_prompt

    sides = {**models, **peers}
    sets = {"grounded": GROUNDED, "open": OPEN}
    ids = {name: [chat_prompt([{"role": "user", "content": q}], models["none"].tokenizer)[0] for q in qs]
           for name, qs in sets.items()}
    rates: dict[tuple, list] = {}
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'default')}, k={a.tokens} (draft {a.draft_tokens}), "
          f"{a.max_new_tokens} new tokens, compile {a.compile}")
    for r in range(a.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in sets:
            for side in order:
                results = [sides[side].decode_rate(q, a.max_new_tokens) if side in peers
                           else decode_rate(models[side], q, a.max_new_tokens) for q in ids[name]]
                rates.setdefault((name, side), []).append(statistics.median(x for x, _ in results))
                rates.setdefault((name, side, "tokens"), []).append([t for _, t in results])
            same = all(rates[(name, side, "tokens")][-1] == rates[(name, "none", "tokens")][-1] for side in models)
            measured = ", ".join(f"{side} {rates[(name, side)][-1]:.1f}" for side in sides)
            print(f"round {r} {name:8s} order {'/'.join(order)}: {measured} tokens/s (median of {len(ids[name])} "
                  f"prompts), same tokens: {same}, load {os.getloadavg()[0]:.2f}", flush=True)
    for name in sets:
        none = statistics.median(rates[(name, "none")])
        print(f"{name}: none {none:.1f} tokens/s; " + ", ".join(
            f"{side} {statistics.median(rates[(name, side)]):.1f} ({statistics.median(rates[(name, side)]) / none:.2f}x)"
            for side in sides if side != "none"))
        if "ngram" in models and "llama.cpp ngram-simple" in peers:
            theirs = statistics.median(rates[(name, "llama.cpp ngram-simple")])
            print(f"{name}: llmsplit ngram / llama.cpp ngram-simple: "
                  f"{statistics.median(rates[(name, 'ngram')]) / theirs:.2f}x")
    for side in models:
        if side != "none":
            print(models[side].engine.speculation.summary())


if __name__ == "__main__":
    main()
