"""What the engine hands the runner each step: where the new keys go, where each sequence's
keys are, and the attention mask (`Step`); or several such parts packed in one row
(`PackedStep`). Built by the block manager from its tables; applied by every process that
holds layers (runner/kv_cache.py) to its own storage. The one engine type a runner imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Step:
    start: int | torch.Tensor  # position of each sequence's first new token (an int when shared)
    slots: torch.Tensor  # [b * s] pool slot of every new token, row-major
    gather: torch.Tensor  # [b, width] pool slot of every key position (padding points anywhere)
    mask: torch.Tensor | None  # [b, 1, s, width] bool, or None when the model's causal rules apply

    @staticmethod
    def masked(start: torch.Tensor, n_new: int, gather: torch.Tensor) -> "Step":
        """The step with a start position [b] per sequence and the mask that keeps each query
        to its own sequence's past."""
        new = start[:, None] + torch.arange(n_new)  # positions of the new tokens
        mask = torch.arange(gather.shape[1])[None, None, :] <= new[:, :, None]  # [b, s, width]
        return Step(start, gather.gather(1, new).reshape(-1), gather, mask[:, None])

    @staticmethod
    def one_token_rows(parts: list["Step"]) -> "Step":
        """Steps of one-token rows (a batch of decodes, a sequence's proposals being verified)
        as one masked [b, 1] step: what a compiled decode graph and the paged decode kernel
        take, so that verifying k proposals costs one decode step of k + 1 rows, not an eager
        fused step (which, against a compiled decode, cost more than the tokens it saved)."""
        rows = [part.per_sequence() for part in parts]
        width = max(r.gather.shape[1] for r in rows)
        # Padding points at slot 0, which the mask hides (as _gather's own padding).
        gather = torch.cat([torch.nn.functional.pad(r.gather, (0, width - r.gather.shape[1])) for r in rows])
        return Step.masked(torch.cat([r.start for r in rows]), 1, gather)

    def per_sequence(self) -> "Step":
        """This step in the masked form (one start per sequence), whether or not its
        sequences share a position: what a compiled batched decode step takes, so that one
        graph serves every batch (issue 23)."""
        if self.mask is not None:
            return self
        b, width = self.gather.shape
        return Step.masked(torch.full((b,), self.start), self.slots.numel() // b, self.gather)


@dataclass
class PackedStep:
    """Several sequences' new tokens packed into one row [1, T]: a fused step, the prefill
    chunks of some sequences next to the decode tokens of others (as vLLM and nano-vllm run
    them). The weights are then read once for every token of the step, and attention runs
    part by part, each part against its own sequences' keys (without a varlen attention
    kernel on CPU, one masked attention over all of them would cost T x every key)."""
    positions: torch.Tensor  # [T] position of each new token, for the rotary tables
    slots: torch.Tensor  # [T] pool slot of each new token
    parts: list[Step]  # in row order: a batch of decodes (one row each), or one sequence's chunk
    pick: torch.Tensor  # [n] rows whose logits are wanted (each part's sequences' last tokens)

    @staticmethod
    def pack(parts: list[Step], first_rows: list[int | None] | None = None) -> "PackedStep":
        """Each part's sequences' last rows are picked, or with `first_rows[i]` = k, rows k to
        the last of part i (one sequence's chunk of a prompt being scored)."""
        positions, pick, row = [], [], 0
        for i, part in enumerate(parts):
            b, n = part.gather.shape[0], part.slots.numel() // part.gather.shape[0]
            start = part.start if isinstance(part.start, torch.Tensor) else torch.full((b,), part.start)
            positions.append((start[:, None] + torch.arange(n)).reshape(-1))
            k = first_rows[i] if first_rows else None
            pick.append(row + n - 1 + n * torch.arange(b) if k is None else row + torch.arange(k, n))
            row += b * n
        return PackedStep(torch.cat(positions), torch.cat([p.slots for p in parts]), parts, torch.cat(pick))
