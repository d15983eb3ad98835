"""Deterministic, layout-independent batches.

Sample `i` of the run (counting across steps) is window `perm_e[i mod W]` of epoch
`e = i div W`, where the corpus is cut into W non-overlapping windows of seq_len + 1
tokens and `perm_e` is a permutation drawn from (seed, e). Step `s` is samples
`s·B .. s·B + B − 1` of the global batch B, and data-parallel rank r takes its
contiguous slice. Nothing depends on the world size, and the position in the data is
the step number alone, so resuming at step s continues the same sequence exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import ConfigError


class BatchSampler:
    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ConfigError(f"the training data has {len(tokens)} tokens, fewer than data.seq_len + 1 = "
                              f"{seq_len + 1}; add data or lower data.seq_len")
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_windows, generator=g).numpy()}
        return self._perms[epoch]

    def window_ids(self, step: int) -> list[int]:
        """Window index of every sample in the global batch of `step`."""
        out = []
        for i in range(step * self.global_batch, (step + 1) * self.global_batch):
            out.append(int(self._perm(i // self.n_windows)[i % self.n_windows]))
        return out

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """[global_batch / dp, seq_len + 1] tokens for one data-parallel rank."""
        assert self.global_batch % dp_size == 0
        per = self.global_batch // dp_size
        ids = self.window_ids(step)[dp_rank * per:(dp_rank + 1) * per]
        rows = [np.asarray(self.tokens[w * self.seq_len:(w + 1) * self.seq_len + 1], dtype=np.int64)
                for w in ids]
        return torch.from_numpy(np.stack(rows))

    def state_dict(self, next_step: int) -> dict:
        return {"seed": self.seed, "next_step": next_step, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "n_windows": self.n_windows}
