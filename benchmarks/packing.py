"""`python -m benchmarks.packing`: packed rows against one padded conversation per row, on
conversations whose lengths vary 10x (25 to 250 tokens), single process, fp32, the `tiny`
preset's sizes. Both train on the same conversations with the same mask; the figure is tokens
that carry loss per second of forward + backward + AdamW step, and the padding share of
each batch (packed: of all rows). Packed rows restart positions per conversation and use the block-diagonal mask
(models/llama.py: document_mask); padded rows use plain causal attention."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

SEQ, BATCH, STEPS, WARMUP = 256, 8, 5, 1


def documents(n: int = 400):
    from llmsplit.data.chat import Documents

    rng = np.random.default_rng(0)
    lengths = rng.integers(25, 251, n)
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
    from llmsplit.train.trainer import token_loss

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


def main(argv) -> None:
    from llmsplit.data.packing import PackedSampler
    from llmsplit.models.llama import LlamaConfig, Transformer
    from llmsplit.models.presets import PRESETS

    torch.manual_seed(0)
    docs = documents()
    cfg = LlamaConfig(**{**PRESETS["tiny"], "max_seq_len": SEQ})
    packed = PackedSampler(docs, SEQ, BATCH, seed=0)
    results = {}
    for name in ("padded", "packed", "padded", "packed"):
        model = Transformer(cfg)
        model.init_weights(0)
        if name == "packed":
            batches = [packed.rows(list(range(s * BATCH, (s + 1) * BATCH))) for s in range(STEPS + WARMUP)]
            pad = packed.padding_fraction()
        else:
            batches = [padded_rows(docs, list(range(s * BATCH, (s + 1) * BATCH))) for s in range(STEPS + WARMUP)]
            lengths = np.diff(docs.offsets)[:(STEPS + WARMUP) * BATCH]
            pad = 1 - float(np.minimum(lengths - 1, SEQ).sum()) / (len(lengths) * SEQ)
        rate = run(model, batches)
        results.setdefault(name, []).append((rate, pad))
    print(f"tiny preset ({sum(p.numel() for p in Transformer(cfg).parameters()) / 1e6:.1f}M), rows of {SEQ} tokens, "
          f"batch {BATCH}, {STEPS} timed steps, conversations of 25-250 tokens, {torch.get_num_threads()} threads")
    print("| rows | tokens with loss / s (per round) | padding share |\n| --- | ---: | ---: |")
    for name, rounds in results.items():
        print(f"| {name} | {', '.join(f'{r:.0f}' for r, _ in rounds)} | {rounds[0][1]:.1%} |")
    ratio = statistics.median(r for r, _ in results["packed"]) / statistics.median(r for r, _ in results["padded"])
    print(f"packed / padded: {ratio:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
