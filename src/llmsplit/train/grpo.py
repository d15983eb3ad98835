"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath) as the trainer's
objective: the loss of a step's completions given their advantages, with TRL's GRPOTrainer's
loss, options and logged figures.

What this module does not do is produce the completions: posttrain/ (the room above training
and inference) generates them with the engine holding the current policy, scores them with the
reward functions, and hands each step's rows here with `set_rollouts`. The rows' targets carry,
after the token targets, the row's index in the step (like DPO's pair index, data/preference.py),
so the loss finds the row's advantage and reference log-probs wherever the layout computes it.

One optimizer step per generation batch (TRL's default num_iterations=1): the "old" policy
of the clipped ratio is the current one, so the ratio is 1 and no token is clipped; the
gradient is then the advantage times the gradient of the token's log-prob, which is what the
clipped form reduces to. The clipped form is kept so the figures (clip_ratio) mean what TRL's do.
"""

from __future__ import annotations

import torch

from ..data.loader import IGNORE
from .objectives import NextTokenObjective, last_calls_only, token_logps

GRPO_FIGURES = ("kl", "clip_ratio")  # token means over the step, as TRL logs them


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """Each completion's reward against its group's (the `group` completions of one prompt):
    (r - mean) / (std + 1e-4), std unbiased, as TRL's GRPOTrainer computes them."""
    grouped = rewards.view(-1, group)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + 1e-4)).flatten()


def grpo_token_losses(logps: torch.Tensor, advantages: torch.Tensor, epsilon: float, beta: float,
                      ref_logps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL, clipped) per token [rows, seq]: the clipped surrogate of PPO with the rows'
    advantages, plus beta times the k3 estimate of KL to the reference (Schulman 2020), as TRL."""
    old = logps.detach()
    ratio = torch.exp(logps - old)
    a = advantages[:, None]
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    loss = -torch.min(ratio * a, clipped_ratio * a)
    clipped = ((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0))
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        if beta:
            loss = loss + beta * kl
    return loss, kl, clipped


class GroupRelativeObjective(NextTokenObjective):
    """The next-token objective's hooks (nothing to prepare, checkpoint or wrap), with GRPO's
    loss and figures."""

    def __init__(self, grpo, device: torch.device):
        self.epsilon, self.beta, self.kind = grpo.epsilon, grpo.beta, grpo.loss
        self.device = device
        self.advantages: torch.Tensor | None = None  # [rows of the step]
        self.ref_logps: torch.Tensor | None = None  # [rows of the step, row width], or None (beta 0)
        self.pending: list[torch.Tensor] = []  # per loss call: (tokens, kl, clipped) summed

    def set_rollouts(self, advantages: torch.Tensor, ref_logps: torch.Tensor | None) -> None:
        """The step's rows: their advantages and, with a reference, its log-prob of every target."""
        self.advantages = advantages.to(self.device, torch.float32)
        self.ref_logps = None if ref_logps is None else ref_logps.to(self.device, torch.float32)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
        """"grpo": each completion's mean token loss, summed over this rank's rows (the
        denominator, its share of the step's completions, makes that the step's mean);
        "dr_grpo": token losses summed (the denominator counts max_completion_tokens per
        completion, Liu et al. 2025's constant normaliser)."""
        tokens, row = targets[:, :-1], targets[:, -1]
        mask = (tokens != IGNORE).float()
        logps = token_logps(logits, tokens)
        ref = None if self.ref_logps is None else self.ref_logps[row, :tokens.shape[1]]
        losses, kl, clipped = grpo_token_losses(logps, self.advantages[row], self.epsilon, self.beta, ref)
        with torch.no_grad():
            self.pending.append(torch.stack([mask.sum(), (kl * mask).sum(), (clipped * mask).sum()]))
        if self.kind == "dr_grpo":
            return (losses * mask).sum() / denominator
        return ((losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / denominator

    def pipeline_calls(self, n_microbatches: int):
        return last_calls_only(self.pending, n_microbatches)

    def step_record(self, pm) -> dict:
        """KL and clip ratio as token means over the step, on every rank (a collective)."""
        sums = torch.stack(self.pending).sum(0) if self.pending else torch.zeros(3, device=self.device)
        sums = pm.global_sum(sums)
        self.pending = []
        tokens = max(float(sums[0]), 1.0)
        record = {"clip_ratio": float(sums[2]) / tokens}
        if self.ref_logps is not None:  # TRL logs KL only when a reference is kept
            record["kl"] = float(sums[1]) / tokens
        return record

    def eval_record(self, loss: float, pm) -> dict:
        return {}  # GRPO's evaluation is the held-out reward (posttrain/grpo.py)
