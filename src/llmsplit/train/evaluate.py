"""Evaluation on held-out data (data.eval_source or data.eval_fraction, every train.eval_every
steps and after the last): the mean loss over its tokens that carry loss and its perplexity,
the same for every layout (the held-out rows are split over data-parallel ranks like a training
batch, and go through the pipeline schedule forward-only). Also the data's share of tokens with
loss and of padding, for the summary."""

from __future__ import annotations

import math

import torch

from ..parallel.parallel_model import full_tensor


def evaluate(trainer) -> dict:
    """{"eval_loss", "eval_ppl"} over every held-out row (a collective: every rank calls it)."""
    pm, sampler = trainer.pm, trainer.eval_sampler
    total, count = 0.0, 0
    kept = trainer.denominator
    with torch.no_grad():
        for batch, loss_tokens in sampler.eval_batches(trainer.dp_rank, trainer.dp_size):
            batch = batch.to(trainer.device)
            trainer.use_denominator(loss_tokens)
            if pm.pipeline is not None:
                loss_sum = pm.pipeline_step(batch.inputs, batch.targets, batch.positions, forward_only=True)
            else:
                loss_sum = torch.zeros((), device=trainer.device)
                for i in range(0, len(batch), trainer.micro_batch):
                    mb = batch[i:i + trainer.micro_batch]
                    with pm.loss_context(), pm.forward_context():
                        loss_sum += full_tensor(trainer.loss(trainer.forward(mb), mb.targets).detach())
            total += pm.global_loss(loss_sum) * loss_tokens
            count += loss_tokens
    trainer.denominator = kept
    loss = total / max(count, 1)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}


def data_summary(trainer, history: list[dict]) -> dict:
    """summary.json's data figures: the share of target tokens that carry loss (and, for
    packed rows, of padding), and the last evaluation's loss and perplexity."""
    out = {"loss_token_fraction": trainer.sampler.loss_fraction()}
    padding = getattr(trainer.sampler, "padding_fraction", None)
    if padding is not None:
        out["padding_fraction"] = padding()
        out["truncated_documents"] = trainer.sampler.truncated
    evaluated = [r for r in history if "eval_loss" in r]
    if evaluated:
        out["eval_loss"], out["eval_ppl"] = evaluated[-1]["eval_loss"], evaluated[-1]["eval_ppl"]
    return out
