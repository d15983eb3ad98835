"""What a run minimises (`train.objective`), as one object the trainer asks for the loss of a
micro-batch wherever the layout computes it (the loop, or the pipeline's last stage), for the
figures a step adds to metrics.jsonl, and for what an evaluation reports.

"sft" is the next-token loss every run trained with before; "dpo" is train/dpo.py; "grpo" is
train/grpo.py (its rows come from posttrain/, which generates them with the engine).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F


def token_loss(logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
    """Cross-entropy summed over the tokens that carry loss (targets IGNORE, -100, carry none),
    divided by the rank's share of the global batch's such tokens: micro-batch gradients then
    add up to the batch mean, and the data-parallel average of those is the global mean.
    fp32 over the vocabulary whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), reduction="sum") / denominator


def token_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-prob of each target token [rows, seq] (0 where IGNORE), fp32 over the vocabulary;
    under tensor parallel the logits stay split over the vocabulary (loss_parallel computes
    the per-token cross-entropy on the shards, replicated)."""
    per_token = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten(), reduction="none")
    if hasattr(per_token, "to_local"):
        per_token = per_token.to_local()
    return -per_token.view(tokens.shape)


@contextmanager
def last_calls_only(pending: list, n_microbatches: int):
    """Around one pipeline step of an objective that keeps figures per loss call in `pending`:
    of the loss calls the step makes, only the last `n_microbatches` are the micro-batches'.
    torch's schedule calls the loss once more, on a dummy forward pass, when it first prepares
    its backward (again after a forward-only evaluation), and that call's figures are dropped."""
    start = len(pending)
    yield
    pending[start:] = pending[start:][-n_microbatches:]


class NextTokenObjective:
    """Supervised fine-tuning and pre-training: the mean token loss."""

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
        return token_loss(logits, targets, denominator)

    def prepare(self, trainer, resumed_state: dict | None) -> None:
        """Before the first step: nothing to compute for this objective."""

    def carry(self, batch):
        """The rows as the loss needs them: as they are (distillation adds its teacher's inputs)."""
        return batch

    def evaluating(self):
        return nullcontext()

    def pipeline_calls(self, n_microbatches: int):
        return nullcontext()

    def step_record(self, pm) -> dict:
        return {}

    def eval_record(self, loss: float, pm) -> dict:
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}

    def checkpoint_state(self) -> dict:
        return {}


def build_objective(cfg, device: torch.device):
    if cfg.train.objective == "dpo":
        from .dpo import PreferenceObjective

        return PreferenceObjective(cfg.dpo, device)
    if cfg.train.objective == "grpo":
        from .grpo import GroupRelativeObjective

        return GroupRelativeObjective(cfg.grpo, device)
    if cfg.train.teacher:
        from .distill import DistillObjective

        return DistillObjective(cfg.train, device)
    return NextTokenObjective()
