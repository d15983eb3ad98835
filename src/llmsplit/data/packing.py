"""Packing: whole documents (conversations) laid into rows of seq_len + 1 tokens, so that no row
is mostly padding however much their lengths vary.

Rows are filled best-fit decreasing: documents longest first (ties in their order), each into
the row with the least room that still holds it (the first such row). For lengths spread 10x that leaves a few percent of padding
where laying them in order and starting a row when the next does not fit (torchtune's
PackedDataset) left a quarter (benchmarks/packing.py). It depends on the data alone, so the
rows are the same for every layout, and the sampler shuffles rows as it does for text. The rest
of a row is padding, which carries no loss. A document longer than a row is cut to it (counted
in `truncated`).

Each row carries the position of every token within its document; the model restarts rotary
positions there and never lets attention cross from one document into another, so a packed
row computes exactly what its documents would alone: a document's last token does not predict
the next document's first, and a document's first token is never a target.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..errors import ConfigError
from .chat import Documents
from .loader import IGNORE, Batch, BatchSampler


class PackedSampler(BatchSampler):
    def __init__(self, docs: Documents, seq_len: int, global_batch: int, seed: int, pad_id: int = 0):
        self.docs, self.pad_id = docs, pad_id
        row = seq_len + 1
        self.starts = np.asarray(docs.offsets[:-1], dtype=np.int64)
        self.lengths = np.minimum(np.diff(np.asarray(docs.offsets, dtype=np.int64)), row)
        self.truncated = int((np.diff(np.asarray(docs.offsets)) > row).sum())
        # Row r holds documents order[first[r]:first[r + 1]].
        self.order, self.first = _best_fit_decreasing(self.lengths, row)
        self.row_loss = self._row_loss()
        super().__init__(docs.tokens, seq_len, global_batch, seed)

    def _count_rows(self) -> int:
        if len(self.first) < 2:
            raise ConfigError("the training data holds no document with tokens; add data")
        return len(self.first) - 1

    def _row_loss(self) -> np.ndarray:
        """Tokens that carry loss in each row: targets 1 .. length-1 of each of its documents."""
        mask = self.docs.mask
        if mask is None:
            per_doc = np.maximum(self.lengths - 1, 0)
        else:
            cum = np.concatenate([[0], np.cumsum(np.asarray(mask, dtype=np.int64))])
            ends = self.starts + self.lengths
            per_doc = np.where(self.lengths > 1, cum[ends] - cum[np.minimum(self.starts + 1, ends)], 0)
        return np.add.reduceat(per_doc[self.order], self.first[:-1])

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [seq_len + 1], targets [seq_len], positions [seq_len]) of row `r`."""
        size = self.seq_len + 1
        tokens = np.full(size, self.pad_id, dtype=np.int64)
        loss = np.zeros(size, dtype=bool)
        positions = np.zeros(size, dtype=np.int64)
        at = 0
        for d in self.order[self.first[r]:self.first[r + 1]]:
            a, n = self.starts[d], self.lengths[d]
            tokens[at:at + n] = self.docs.tokens[a:a + n]
            loss[at + 1:at + n] = True if self.docs.mask is None else self.docs.mask[a + 1:a + n] != 0
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(size - at)  # padding: a document of its own, without loss
        targets = np.where(loss[1:], tokens[1:], IGNORE)
        return tokens[:-1], targets, positions[:-1]

    def rows(self, ids: list[int]) -> Batch:
        parts = [self.row(r) for r in ids]
        inputs, targets, positions = (torch.from_numpy(np.stack([p[i] for p in parts])) for i in range(3))
        return Batch(inputs, targets, positions)

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        raise AssertionError("packed rows are Batches: use batch()")

    def loss_tokens(self, step: int) -> int:
        return int(self.row_loss[self.window_ids(step)].sum())

    def loss_fraction(self) -> float:
        return float(self.row_loss.sum()) / (self.n_windows * self.seq_len)

    def padding_fraction(self) -> float:
        return 1.0 - float(self.lengths.sum()) / (self.n_windows * (self.seq_len + 1))


def _best_fit_decreasing(lengths: np.ndarray, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(documents in row order, index in it of each row's first document, then their number).
    Rows are found by their free space (a heap of row indices per amount), so placing a document
    costs at most `row` look-ups, not one per row; empty documents are left out."""
    by_free: list[list[int]] = [[] for _ in range(row + 1)]
    rows: list[list[int]] = []
    for d in sorted(np.flatnonzero(lengths), key=lambda d: (-int(lengths[d]), int(d))):
        n = int(lengths[d])
        free = next((f for f in range(n, row + 1) if by_free[f]), None)
        if free is None:
            r, free = len(rows), row
            rows.append([])
        else:
            r = heapq.heappop(by_free[free])  # the first row (lowest index) with exactly this much room
        rows[r].append(int(d))
        heapq.heappush(by_free[free - n], r)
    order = np.asarray([d for r in rows for d in r], dtype=np.int64)
    first = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return order, first
