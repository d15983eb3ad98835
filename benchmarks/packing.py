"""`python -m benchmarks.packing`: packed rows against one padded conversation per row, on
conversations whose lengths vary 10x (25 to 250 tokens), single process, fp32, the `tiny`
preset's sizes. Both train on the same conversations with the same mask; the figure is tokens
that carry loss per second of forward + backward + AdamW step, and the padding share of
the rows trained on. Packed rows restart positions per conversation and use the block-diagonal mask
(models/llama.py: document_mask); padded rows use plain causal attention.

Two length distributions, both varying 10x: uniform on 25-250, and log-uniform on 25-250
(as many conversations of 25-79 tokens as of 79-250: right-skewed, as chat datasets' lengths
are). At equal cost per row the ratio is bounded by (1 - packed padding) / (1 - padded
padding), printed beside each; a ratio above it means a packed row cost less than a padded
one. Each arm trains on rows drawn at random (seeded) from the whole dataset, not the first
ones (best-fit decreasing puts the longest conversations in the first rows)."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

SEQ, BATCH, STEPS, WARMUP = 256, 8, 8, 1


def documents(n: int = 400, spread: str = "uniform"):
    from llmsplit.data.chat import Documents

    rng = np.random.default_rng(0)
    if spread == "uniform":
        lengths = rng.integers(25, 251, n)
    else:  # log-uniform: exp of a uniform draw between log 25 and log 251
        lengths = np.exp(rng.uniform(np.log(25), np.log(251), n)).astype(np.int64)
    tokens = rng.integers(0, 256, int(lengths.sum()))
    mask = (rng.random(len(tokens)) < 0.5).astype(np.uint8)
    return Documents(tokens, mask, np.concatenate([[0], np.cumsum(lengths)]))


def padded_rows(docs, ids):
    from llmsplit.data.loader import IGNORE, Batch

    inputs = torch.zeros(len(ids), SEQ, dtype=torch.long)
    targets = torch.full((len(ids), SEQ), IGNORE, dtype=torch.long)
    for r, d in enumerate(ids):
        a, b = int(docs.offsets[d]), int(docs.offsets[d + 1])
        t = torch.from_numpy(np.asarray(docs.tokens[a:b], dtype=np.int64))
        m = torch.from_numpy(np.asarray(docs.mask[a + 1:b])).bool()
        inputs[r, :b - a - 1] = t[:-1]
        targets[r, :b - a - 1] = torch.where(m, t[1:], IGNORE)
    return Batch(inputs, targets)


def run(model, batches) -> float:
    """Tokens with loss per second over the timed steps."""
    from llmsplit.train.objectives import token_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss_tokens = [], 0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        kw = {} if batch.positions is None else {"positions": batch.positions}
        token_loss(model(batch.inputs, **kw), batch.targets, max(batch.loss_tokens(), 1)).backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
            loss_tokens += batch.loss_tokens()
    return loss_tokens / sum(times)


def _config():
    from llmsplit.models.llama import LlamaConfig
    from llmsplit.models.presets import PRESETS

    return LlamaConfig(**{**PRESETS["tiny"], "max_seq_len": SEQ})


def measure(spread: str, rounds: int = 3) -> tuple[dict, dict]:
    """({"padded"|"packed": [rate per round]}, {same: padding share of the rows trained on})
    for one length distribution."""
    from llmsplit.data.packing import PackedSampler
    from llmsplit.models.llama import Transformer

    torch.manual_seed(0)
    docs = documents(spread=spread)
    cfg = _config()
    packed = PackedSampler(docs, SEQ, BATCH, seed=0)
    n = (STEPS + WARMUP) * BATCH
    rng = np.random.default_rng(1)
    doc_ids = rng.permutation(len(docs.offsets) - 1)[:n]
    row_ids = rng.permutation(len(packed.first) - 1)[:n]
    lengths = np.diff(docs.offsets)[doc_ids]
    in_rows = sum(int(packed.lengths[packed.order[packed.first[r]:packed.first[r + 1]]].sum()) for r in row_ids)
    pads = {"padded": 1 - float(np.minimum(lengths - 1, SEQ).sum()) / (n * SEQ), "packed": 1 - in_rows / (n * (SEQ + 1))}
    rates = {}
    for name in ("padded", "packed") * rounds:
        model = Transformer(cfg)
        model.init_weights(0)
        ids = row_ids if name == "packed" else doc_ids
        make = packed.rows if name == "packed" else (lambda chunk: padded_rows(docs, chunk))
        batches = [make([int(i) for i in ids[s * BATCH:(s + 1) * BATCH]]) for s in range(STEPS + WARMUP)]
        rates.setdefault(name, []).append(run(model, batches))
    return rates, pads


def main(argv) -> None:
    from llmsplit.models.llama import Transformer

    print(f"tiny preset ({sum(p.numel() for p in Transformer(_config()).parameters()) / 1e6:.1f}M), rows of {SEQ} tokens, "
          f"batch {BATCH}, {STEPS} timed steps, conversations of 25-250 tokens, {torch.get_num_threads()} threads")
    print("| lengths | rows | tokens with loss / s (per round) | padding share |\n| --- | --- | ---: | ---: |")
    ratios = {}
    for spread in ("uniform", "log-uniform"):
        rates, pads = measure(spread)
        for name, per_round in rates.items():
            print(f"| {spread} | {name} | {', '.join(f'{r:.0f}' for r in per_round)} | {pads[name]:.1%} |")
        median = {name: statistics.median(per_round) for name, per_round in rates.items()}
        ratios[spread] = (median["packed"] / median["padded"], (1 - pads["packed"]) / (1 - pads["padded"]))
    for spread, (ratio, bound) in ratios.items():
        print(f"{spread}: packed / padded {ratio:.2f}x (equal cost per row would give {bound:.2f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
