"""Evaluation on held-out data (data.eval_source or data.eval_fraction, every train.eval_every
steps and after the last): the mean loss over its tokens that carry loss and its perplexity,
the same for every layout (the held-out rows are split over data-parallel ranks like a training
batch, and go through the pipeline schedule forward-only). Also the data's share of tokens with
loss and of padding, for the summary."""

from __future__ import annotations

import torch

from ..parallel.parallel_model import full_tensor


def evaluate(trainer) -> dict:
    """The objective's evaluation record ({"eval_loss", "eval_ppl"} for next-token loss) over
    every held-out row (a collective: every rank calls it)."""
    pm = trainer.pm
    total, count = 0.0, 0
    with trainer.objective.evaluating():
        for loss_sum, loss_tokens in forward_passes(trainer, trainer.eval_sampler):
            total += pm.global_loss(loss_sum) * loss_tokens
            count += loss_tokens
        return trainer.objective.eval_record(total / max(count, 1), pm)


def forward_passes(trainer, sampler):
    """Forward passes alone over every row of `sampler` once (`eval_batches`), without
    gradients: (this rank's loss sum, the global batch's loss tokens) per global batch. The
    trainer's loss denominator is the batch's meanwhile, and restored after."""
    pm = trainer.pm
    kept = trainer.denominator
    try:
        with torch.no_grad():
            for batch, loss_tokens in sampler.eval_batches(trainer.dp_rank, trainer.dp_size):
                batch = trainer.local_rows(batch.to(trainer.device))
                trainer.use_denominator(loss_tokens)
                if pm.pipeline is not None:
                    loss_sum = trainer.pipeline_step(batch, forward_only=True)
                else:
                    loss_sum = torch.zeros((), device=trainer.device)
                    rows = len(batch) * trainer.micro_batch // trainer.per_rank  # a pair is two rows (DPO)
                    for i in range(0, len(batch), rows):
                        mb = batch[i:i + rows]
                        with pm.loss_context(), pm.forward_context():
                            loss_sum += full_tensor(trainer.loss(trainer.forward(mb), mb.targets).detach())
                yield loss_sum, loss_tokens
    finally:
        trainer.denominator = kept


def data_summary(trainer, history: list[dict]) -> dict:
    """summary.json's data figures: the share of target tokens that carry loss (and, for
    packed rows, of padding), and the last evaluation's loss and perplexity."""
    fraction = getattr(trainer.sampler, "loss_fraction", None)  # prompts (GRPO) have none
    out = {"loss_token_fraction": fraction()} if fraction is not None else {}
    padding = getattr(trainer.sampler, "padding_fraction", None)
    if padding is not None:
        out["padding_fraction"] = padding()
        out["truncated_documents"] = trainer.sampler.truncated
    evaluated = [r for r in history if any(key.startswith("eval_") for key in r)]
    if evaluated:
        out.update({key: value for key, value in evaluated[-1].items() if key.startswith("eval_")})
    return out
