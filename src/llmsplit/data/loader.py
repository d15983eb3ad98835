"""Deterministic, layout-independent batches.

Sample `i` of the run (counting across steps) is row `perm_e[i mod W]` of epoch
`e = i div W`, where the data is cut into W rows of seq_len + 1 tokens and `perm_e` is a
permutation drawn from (seed, e). Step `s` is samples `s·B .. s·B + B − 1` of the global
batch B, and data-parallel rank r takes its contiguous slice. Nothing depends on the world
size, and the position in the data is the step number alone, so resuming at step s
continues the same sequence exactly.

Plain text is one stream cut into non-overlapping windows (`BatchSampler`); chat data packs
whole conversations into rows (`packing.PackedSampler`), with a loss mask and positions that
restart at each conversation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError

IGNORE = -100  # the target of a token that carries no loss (F.cross_entropy's ignore_index)


@dataclass
class Batch:
    """Rows of one step: `inputs` and `targets` [n, seq_len] (targets IGNORE where no loss),
    `positions` [n, seq_len] restarting at each document of a packed row, or None for rows
    that are one stream each (positions 0, 1, ... and plain causal attention). A context-parallel
    rank's share of the rows (parallel.context_parallel.shard_rows) has its tokens' global
    positions, and `doc_ids`, each token's document, for packed rows."""

    inputs: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor | None = None
    doc_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def _each(self, f) -> Batch:
        return Batch(*(None if t is None else f(t) for t in (self.inputs, self.targets, self.positions, self.doc_ids)))

    def __getitem__(self, rows: slice) -> Batch:
        return self._each(lambda t: t[rows])

    def to(self, device) -> Batch:
        return self._each(lambda t: t.to(device))

    def loss_tokens(self) -> int:
        return int((self.targets != IGNORE).sum())

    @staticmethod
    def cat(parts: list[Batch]) -> Batch:
        positions = None if parts[0].positions is None else torch.cat([p.positions for p in parts])
        return Batch(torch.cat([p.inputs for p in parts]), torch.cat([p.targets for p in parts]), positions)


class BatchSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.n_windows = self._count_rows()
        if self.n_windows < 1:
            raise ConfigError(f"the training data has {len(tokens)} tokens, fewer than data.seq_len + 1 = "
                              f"{seq_len + 1}; add data or lower data.seq_len")
        self._perms: dict[int, np.ndarray] = {}

    def _count_rows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_windows, generator=g).numpy()}
        return self._perms[epoch]

    def window_ids(self, step: int) -> list[int]:
        """Row index of every sample in the global batch of `step`."""
        out = []
        for i in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(i // self.n_windows)[i % self.n_windows]))
        return out

    def _rank_ids(self, step: int, dp_rank: int, dp_size: int) -> list[int]:
        assert self.global_batch % dp_size == 0
        per = self.global_batch // dp_size
        return self.window_ids(step)[dp_rank * per:(dp_rank + 1) * per]

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """[global_batch / dp, seq_len + 1] tokens for one data-parallel rank (one stream per row)."""
        rows = [np.asarray(self.tokens[w * self.seq_len:(w + 1) * self.seq_len + 1], dtype=np.int64)
                for w in self._rank_ids(step, dp_rank, dp_size)]
        return torch.from_numpy(np.stack(rows))

    def rows(self, ids: list[int]) -> Batch:
        """The rows `ids` (in that order) as a Batch."""
        tokens = torch.from_numpy(np.stack([np.asarray(self.tokens[w * self.seq_len:(w + 1) * self.seq_len + 1],
                                                       dtype=np.int64) for w in ids]))
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def batch(self, step: int, dp_rank: int, dp_size: int) -> Batch:
        """This data-parallel rank's share of the global batch of `step`."""
        return self.rows(self._rank_ids(step, dp_rank, dp_size))

    def loss_tokens(self, step: int) -> int:
        """Tokens that carry loss in the whole global batch of `step` (every rank computes the
        same number from the data: the loss's denominator, without a collective)."""
        return self.global_batch * self.seq_len

    def loss_fraction(self) -> float:
        """The share of all target tokens of the data that carry loss."""
        return 1.0

    def eval_batches(self, dp_rank: int, dp_size: int):
        """Every row once, in order, in global batches (the last one filled with rows that carry
        no loss): (this rank's Batch, tokens with loss in the global batch) per global batch."""
        per = self.global_batch // dp_size
        for first in range(0, self.n_windows, self.global_batch):
            ids = list(range(first, min(first + self.global_batch, self.n_windows)))
            mine = ids[dp_rank * per:(dp_rank + 1) * per]
            rows = self.rows(mine or ids[:1])
            rows = rows if mine else Batch(rows.inputs, torch.full_like(rows.targets, IGNORE), rows.positions)
            if len(rows) < per:
                filler = rows[:1]
                filler = Batch(filler.inputs, torch.full_like(filler.targets, IGNORE), filler.positions)
                rows = Batch.cat([rows] + [filler] * (per - len(rows)))
            yield rows, self.rows(ids).loss_tokens()

    def state_dict(self, next_step: int) -> dict:
        return {"seed": self.seed, "next_step": next_step, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "n_windows": self.n_windows}
