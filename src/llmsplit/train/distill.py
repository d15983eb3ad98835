"""Knowledge distillation (`train.teacher`, Hinton et al. 2015): the student learns the
teacher's whole next-token distribution, not only the data's next token. Small draft models for
speculative decoding are made this way (a draft is worth what it agrees with its model).

The teacher is frozen and held whole on each rank, in the run's compute dtype, whatever the
student's layout: under ZeRO-3, tensor and pipeline parallel the student is split and the
teacher is not (it is the smaller cost: no gradients, no optimizer state, one forward pass).
Its logits are computed per micro-batch where the loss is (the loop, or the pipeline's last
stage, which sees only the targets): the rows' input tokens, and a packed row's positions,
travel after the targets (`carry`), as DPO's pair index does.

Per token that carries loss: distill_weight x T^2 x KL(teacher_T || student_T) + (1 -
distill_weight) x cross-entropy, T the temperature (T^2 keeps the gradient's scale as T
varies); summed and divided as the next-token loss is. Evaluations report the next-token loss
alone, so eval_loss and eval_ppl stay comparable with any other run's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..data.loader import IGNORE, Batch
from ..errors import ConfigError
from ..io.weights import open_weights
from ..models.llama import Transformer
from ..models.weight_shapes import model_params
from .init_from import load_pretrained
from .objectives import NextTokenObjective, last_calls_only, token_loss

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_teacher(path: str, tokenizer, student_vocab: int) -> int:
    """Before any worker starts: the teacher opens, and gives every token of the data's
    tokenizer the same id (its logits are compared with the student's id by id). Returns its
    parameter count (read from its metadata, as the planner counts it)."""
    source = open_weights(path, what="train.teacher")
    theirs = source.tokenizer
    if theirs.vocab_fingerprint != tokenizer.vocab_fingerprint:
        raise ConfigError(f"train.teacher={path!r} has another tokenizer ({theirs.name}, {theirs.vocab_size} tokens) "
                          f"than the data ({tokenizer.name}, {tokenizer.vocab_size} tokens); distil from a model with "
                          f"the data's tokenizer, or set data.tokenizer to the teacher's")
    common = min(source.config.vocab_size, student_vocab)
    if tokenizer.vocab_size > common:
        raise ConfigError(f"train.teacher={path!r} scores {source.config.vocab_size} tokens and the student "
                          f"{student_vocab}, fewer than the tokenizer's {tokenizer.vocab_size}; give the student a "
                          f"vocabulary that covers the tokenizer's")
    return model_params(source.config)


def load_teacher(path: str, device: torch.device, dtype: torch.dtype) -> Transformer:
    """The teacher, whole, frozen, in `dtype` on `device` (a GGUF's packed blocks widened)."""
    source = open_weights(path, what="train.teacher")
    with torch.device(device):
        teacher = Transformer(source.config)
    load_pretrained(teacher, source)
    return teacher.to(dtype).eval().requires_grad_(False)


def distill_kl(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 x KL(teacher || student) of the softened distributions, summed over the tokens whose
    target carries loss; over the vocabulary both score (a padded head's extra rows left out)."""
    vocab = min(student.shape[-1], teacher.shape[-1])
    s = F.log_softmax(student[..., :vocab].float() / temperature, -1)
    t = F.log_softmax(teacher[..., :vocab].float() / temperature, -1)
    per_token = (t.exp() * (t - s)).sum(-1)
    return (per_token * (targets != IGNORE)).sum() * temperature ** 2


class DistillObjective(NextTokenObjective):
    def __init__(self, train, device: torch.device):
        self.teacher = load_teacher(train.teacher, device, _DTYPES[train.precision])
        self.weight, self.temperature = train.distill_weight, train.distill_temperature
        self.plain = False  # while evaluating: the next-token loss alone
        self.pending: list[torch.Tensor] = []  # per loss call: [KL sum, cross-entropy sum, tokens]

    def carry(self, batch: Batch) -> Batch:
        """The rows with their inputs (and a packed row's positions) after the targets."""
        extra = [batch.inputs] + ([batch.positions] if batch.positions is not None else [])
        return Batch(batch.inputs, torch.cat([batch.targets, *extra], 1), batch.positions, batch.doc_ids)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, denominator: float) -> torch.Tensor:
        width = logits.shape[1]
        hard = targets[:, :width]
        if self.plain:
            return token_loss(logits, hard, denominator)
        inputs, positions = targets[:, width:2 * width], targets[:, 2 * width:]
        with torch.no_grad():
            teacher = self.teacher(inputs, positions=positions if positions.numel() else None)
        # Under tensor parallel the student's logits are split over the vocabulary; the teacher's whole.
        student = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        kl = distill_kl(student, teacher, hard, self.temperature)
        ce = token_loss(student, hard, 1.0)
        self.pending.append(torch.stack([kl.detach(), ce.detach(), (hard != IGNORE).sum().to(kl.dtype)]))
        return (self.weight * kl + (1 - self.weight) * ce) / denominator

    def pipeline_calls(self, n_microbatches: int):
        return last_calls_only(self.pending, n_microbatches)

    @contextmanager
    def evaluating(self):
        """Around an evaluation: the next-token loss alone, and no figures kept."""
        kept, self.pending, self.plain = self.pending, [], True
        try:
            yield
        finally:
            self.pending, self.plain = kept, False

    def step_record(self, pm) -> dict:
        """The step's KL to the teacher and next-token loss, per token over every rank (a collective)."""
        device = self.teacher.norm.weight.device
        sums = torch.stack(self.pending).sum(0) if self.pending else torch.zeros(3, device=device)
        self.pending = []
        kl, ce, tokens = pm.global_sum(sums).tolist()
        return {"distill_kl": kl / max(tokens, 1.0), "distill_ce": ce / max(tokens, 1.0)}

