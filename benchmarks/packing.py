"""`python -m benchmarks.packing [--quick]`: packed rows against one padded conversation per row,
on conversations whose lengths vary 10x (25 to 250 tokens), single process, fp32, the `tiny`
preset's sizes. All arms train on the same conversations with the same mask; the figure is
tokens that carry loss per second of forward + backward + AdamW step, and the padding share of
the rows trained on. Packed rows restart positions per conversation and use the block-diagonal mask
(models/llama.py: document_mask); padded rows use plain causal attention.

Two padded arms, the same conversations drawn the same way into the same batches: padded to the
longest row of each batch (what a collator that pads per batch does, as users' do: the
headline ratio), and padded to 256 (fixed, every row as wide as a packed row).

Two length distributions, both varying 10x: uniform on 25-250, and log-uniform on 25-250
(as many conversations of 25-79 tokens as of 79-250: right-skewed, as chat datasets' lengths
are). At equal cost per token position the ratio is bounded by (1 - packed padding) / (1 -
padded padding), printed beside each; a ratio above it means a packed position cost less than a
padded one (attention grows with the row's width, so narrower padded rows cost less per position).
Each arm trains on rows drawn at random (seeded) from the whole dataset, not the first ones
(best-fit decreasing puts the longest conversations in the first rows)."""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

TITLE = "Packed chat rows vs padded rows (padded to each batch's longest row, and to 256 fixed)"
SEQ, BATCH, STEPS, WARMUP = 256, 8, 8, 1
# Arm keys, in the order they run and print; "packed" is the numerator of every ratio.
ARMS = {"longest": "padded to the longest row of each batch", "fixed": "padded to 256 (fixed)",
        "packed": "packed"}


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


def row_width(lengths, longest: bool) -> int:
    """Input positions of a padded batch of conversations of these lengths: SEQ, or the longest
    row's (a conversation of n tokens gives n - 1 inputs; `documents` makes none over SEQ)."""
    return int(max(lengths)) - 1 if longest else SEQ


def padded_rows(docs, ids, longest: bool = False):
    from llmsplit.data.loader import IGNORE, Batch

    width = row_width(np.diff(docs.offsets)[ids], longest)
    inputs = torch.zeros(len(ids), width, dtype=torch.long)
    targets = torch.full((len(ids), width), IGNORE, dtype=torch.long)
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


def measure(spread: str, rounds: int, steps: int) -> tuple[dict, dict]:
    """({arm: [rate per round]}, {arm: padding share of the rows trained on}) for one length
    distribution; the arms run in alternating order round by round (A B C, C B A)."""
    from llmsplit.data.packing import PackedSampler
    from llmsplit.models.llama import Transformer

    torch.manual_seed(0)
    docs = documents(spread=spread)
    cfg = _config()
    packed = PackedSampler(docs, SEQ, BATCH, seed=0)
    n = (steps + WARMUP) * BATCH
    rng = np.random.default_rng(1)
    doc_ids = rng.permutation(len(docs.offsets) - 1)[:n]
    row_ids = rng.permutation(len(packed.first) - 1)[:n]
    # Both padded arms: the same conversations in the same batches, so only the width differs.
    inputs = float((np.diff(docs.offsets)[doc_ids] - 1).sum())
    per_batch = np.diff(docs.offsets)[doc_ids].reshape(-1, BATCH)
    in_rows = sum(int(packed.lengths[packed.order[packed.first[r]:packed.first[r + 1]]].sum()) for r in row_ids)
    pads = {arm: 1 - inputs / (BATCH * sum(row_width(b, arm == "longest") for b in per_batch))
            for arm in ("longest", "fixed")}
    pads["packed"] = 1 - in_rows / (n * (SEQ + 1))
    rates = {arm: [] for arm in ARMS}
    for r in range(rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]):
            model = Transformer(cfg)
            model.init_weights(0)
            ids = row_ids if arm == "packed" else doc_ids
            make = packed.rows if arm == "packed" else (lambda chunk: padded_rows(docs, chunk, arm == "longest"))
            batches = [make([int(i) for i in ids[s * BATCH:(s + 1) * BATCH]]) for s in range(steps + WARMUP)]
            rates[arm].append(run(model, batches))
    return rates, pads


def main(quick: bool = False, rounds: int = 3, steps: int = STEPS) -> dict:
    from llmsplit.models.llama import Transformer

    if quick:
        rounds, steps = 1, 1
    result = {"params": sum(p.numel() for p in Transformer(_config()).parameters()), "rounds": rounds,
              "steps": steps, "threads": torch.get_num_threads(), "spreads": {}}
    for spread in ("uniform", "log-uniform"):
        rates, pads = measure(spread, rounds, steps)
        median = {arm: statistics.median(per_round) for arm, per_round in rates.items()}
        result["spreads"][spread] = {
            "rates": rates, "pads": pads,
            # packed / arm, and its bound at equal cost per token position (see the docstring)
            "ratio": {arm: median["packed"] / median[arm] for arm in ("longest", "fixed")},
            "bound": {arm: (1 - pads["packed"]) / (1 - pads[arm]) for arm in ("longest", "fixed")}}
    return result


def to_markdown(r: dict) -> list[str]:
    lines = [f"tiny preset ({r['params'] / 1e6:.1f}M), rows of at most {SEQ} tokens, batch {BATCH}, {r['steps']} "
             f"timed steps, {r['rounds']} alternating round(s), conversations of 25-250 tokens, {r['threads']} "
             "threads, fp32. Ratio: packed / that arm, median over rounds; bound: the ratio at equal cost per "
             "token position.", "",
             "| lengths | rows | tokens with loss / s (per round) | padding share | packed / this | bound |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for spread, s in r["spreads"].items():
        for arm, label in ARMS.items():
            ratio = f"{s['ratio'][arm]:.2f}x" if arm in s["ratio"] else ""
            bound = f"{s['bound'][arm]:.2f}x" if arm in s["bound"] else ""
            lines.append(f"| {spread} | {label} | {', '.join(f'{x:.0f}' for x in s['rates'][arm])} | "
                         f"{s['pads'][arm]:.1%} | {ratio} | {bound} |")
    lines.append("")
    lines += [f"- {spread}: **packed / padded to the longest row of each batch {s['ratio']['longest']:.2f}x** "
              f"(bound {s['bound']['longest']:.2f}x); packed / padded to 256 (fixed) {s['ratio']['fixed']:.2f}x "
              f"(bound {s['bound']['fixed']:.2f}x)" for spread, s in r["spreads"].items()]
    return lines


if __name__ == "__main__":
    print("\n".join(to_markdown(main(quick="--quick" in sys.argv[1:]))))
