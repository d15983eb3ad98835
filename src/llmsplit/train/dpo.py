"""Direct Preference Optimization (Rafailov et al. 2023) as the trainer's objective, with TRL's
DPOTrainer's loss, options and logged figures.

The reference model is the policy as it starts (the base, or model.hf, or the adapters of
lora.init): its log-probs of every pair's chosen and rejected reply are computed once, before the
first step, by a forward-only pass of the same model under the same layout (TRL's
`precompute_ref_log_probs`). That keeps no second copy of the weights under any layout (ZeRO-3,
tensor and pipeline parallel, LoRA, QLoRA alike) and costs one forward pass over the data. The
table, two floats a pair, travels in each checkpoint, so a resume under any layout continues
with the same reference.

A pair's rows sit side by side in every micro-batch (data/preference.py), and their targets end
with the pair's index: the loss finds the pair's reference wherever the layout computes it, on
the pipeline's last stage too.
"""

from __future__ import annotations

import base64
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from ..data.loader import IGNORE
from ..data.preference import NO_PAIR
from .evaluate import forward_passes
from .objectives import last_calls_only, token_logps

# The per-pair figures summed over a step (then divided by its pairs), under TRL's names.
FIGURES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected")
_STATE_KEYS = {"train": "dpo_reference", "eval": "dpo_eval_reference"}


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each row's scored tokens, summed; how many) from logits [rows, seq, vocab]
    and targets [rows, seq + 1] (IGNORE: not scored; the last column is the pair's index)."""
    tokens = targets[:, :-1]
    return token_logps(logits, tokens).sum(-1), (tokens != IGNORE).sum(-1)


def dpo_losses(chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
               beta: float, kind: str = "sigmoid", label_smoothing: float = 0.0) -> torch.Tensor:
    """The loss of each pair from the policy's and the reference's log-probs of its replies."""
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if kind == "ipo":
        return (logits - 1 / (2 * beta)) ** 2
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


class PreferenceObjective:
    def __init__(self, dpo, device: torch.device):
        self.beta, self.kind, self.smoothing = dpo.beta, dpo.loss, dpo.label_smoothing
        self.device = device
        self.tables: dict[str, torch.Tensor] = {}  # "train" / "eval": [pairs, 2] reference log-probs
        self.reading = "train"  # the table the loss reads
        self.filling: torch.Tensor | None = None  # during the reference pass: the table being computed
        # Per loss call since the last record: [pairs, then FIGURES summed over them].
        self.pending: list[torch.Tensor] = []

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
        logps, counts = sequence_logps(logits, targets)
        if self.kind == "ipo":  # IPO compares the replies' mean token log-probs (as TRL does)
            logps = logps / counts.clamp(min=1)
        chosen, rejected, pair = logps[0::2], logps[1::2], targets[0::2, -1]
        real = pair != NO_PAIR
        if self.filling is not None:
            self.filling[pair[real]] = torch.stack([chosen, rejected], -1).detach()[real].float()
            return logps.sum() * 0
        ref = self.tables[self.reading][pair.clamp(min=0)]
        losses = dpo_losses(chosen, rejected, ref[:, 0], ref[:, 1], self.beta, self.kind, self.smoothing)
        with torch.no_grad():
            reward_c, reward_r = self.beta * (chosen - ref[:, 0]), self.beta * (rejected - ref[:, 1])
            figures = torch.stack([torch.ones_like(chosen), reward_c, reward_r, (reward_c > reward_r).float(),
                                   chosen, rejected], -1)
            self.pending.append((figures * real[:, None]).sum(0))
        return (losses * real).sum() / denominator

    def pipeline_calls(self, n_microbatches: int):
        return last_calls_only(self.pending, n_microbatches)

    def carry(self, batch):
        return batch  # a pair's index is in its targets already (data/preference.py)

    def prepare(self, trainer, resumed_state: dict | None) -> None:
        """The reference log-probs: from the checkpoint resumed, else computed now (a
        collective: every rank calls it, before any optimizer step)."""
        samplers = {"train": trainer.sampler, "eval": trainer.eval_sampler}
        for name, sampler in samplers.items():
            if sampler is None:
                continue
            saved = (resumed_state or {}).get(_STATE_KEYS[name])
            if saved is not None:
                table = np.frombuffer(base64.b64decode(saved), dtype=np.float32).reshape(-1, 2)
                assert len(table) == sampler.n_windows, "resume_check refuses other data"
                self.tables[name] = torch.from_numpy(table.copy()).to(self.device)
                continue
            trainer.hangs.where = f"computing the DPO reference log-probs ({name} pairs)"
            self.filling = torch.zeros(sampler.n_windows, 2, device=self.device)
            try:
                for _ in forward_passes(trainer, sampler):
                    pass
                self.tables[name] = trainer.pm.global_sum(self.filling)
            finally:
                self.filling = None

    @contextmanager
    def evaluating(self):
        """Around an evaluation: the held-out pairs' reference, and figures of their own."""
        kept = self.pending
        self.reading, self.pending = "eval", []
        try:
            yield
        finally:
            self.reading, self.pending = "train", kept

    def _figures(self, pm) -> dict:
        sums = torch.stack(self.pending).sum(0) if self.pending else torch.zeros(1 + len(FIGURES), device=self.device)
        sums = pm.global_sum(sums)
        self.pending = []
        pairs = max(float(sums[0]), 1.0)
        out = {name: float(value) / pairs for name, value in zip(FIGURES, sums[1:])}
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def step_record(self, pm) -> dict:
        """The step's figures, averaged over its pairs on every rank (a collective)."""
        return self._figures(pm)

    def eval_record(self, loss: float, pm) -> dict:
        figures = self._figures(pm)
        return {"eval_loss": loss, **{f"eval_{name}": figures[name] for name in ("rewards/accuracies",
                                                                                  "rewards/margins")}}

    def checkpoint_state(self) -> dict:
        return {_STATE_KEYS[name]: base64.b64encode(table.float().cpu().numpy().tobytes()).decode()
                for name, table in self.tables.items()}
