"""Mixture-of-experts bookkeeping for the training loop: tokens per expert of every MoE layer
over a step (logged in metrics.jsonl as `tokens_per_expert`, one list per layer, summed over
micro-batches and data-parallel ranks), and the layers' load-balancing loss, which the trainer
adds to each micro-batch's loss times `train.moe_aux_loss`.

Read from the MoE modules by forward hooks, from outside the plain model. Activation
checkpointing runs a layer's forward again inside the backward; those recomputations are not
counted (`torch._C._current_graph_task_id()` is -1 outside the autograd engine, the test torch's
own checkpointing uses), so a step counts each token once whatever the memory savers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.llama import plain_name
from ..models.moe import MoE


class ExpertStats:
    def __init__(self, model: torch.nn.Module, n_layers: int, n_experts: int, device: torch.device,
                 bias_rate: float = 0.0):
        self.counts = torch.zeros(n_layers, n_experts, dtype=torch.long, device=device)
        self.aux: list[torch.Tensor] = []
        self.aux_sum = torch.zeros((), device=device)  # the trainer's sum of this rank's weighted aux losses
        self.active = n_experts > 0
        self.bias_rate = bias_rate
        self.layers: dict[int, MoE] = {}  # this rank's MoE layers (a pipeline stage holds some)
        for name, module in model.named_modules():
            if isinstance(module, MoE):
                layer = int(plain_name(name).split(".")[1])  # layers.<i>.feed_forward
                self.layers[layer] = module
                module.register_forward_hook(lambda m, args, out, i=layer: self._seen(m, i))

    def _seen(self, moe: MoE, layer: int) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside the backward (activation checkpointing)
        self.counts[layer] += moe.tokens_per_expert.to(self.counts.device)
        self.aux.append(moe.aux_loss)

    def _balance(self) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: after each step, raise the bias of every
        expert that got fewer than the mean of the step's tokens (all ranks together, so every
        replica moves alike) by train.moe_bias_rate, lower the others'."""
        for layer, moe in self.layers.items():
            load = self.counts[layer].float()
            moe.expert_bias += self.bias_rate * torch.sign(load.mean() - load).to(moe.expert_bias.device)

    def take_aux(self) -> torch.Tensor | None:
        """The sum of the load-balancing losses of the layers run since the last call."""
        aux, self.aux = self.aux, []
        return torch.stack(aux).sum() if aux else None

    def step_record(self, dp: int, tp: int = 1) -> dict:
        """{"tokens_per_expert": [[...] per layer]} of the step, summed over every rank (each
        layer is held by one pipeline stage of each replica; the tp ranks of a replica all route
        its tokens, so that sum is divided by tp; context-parallel ranks route disjoint shares),
        and "moe_aux_loss", the global mean of the weighted load-balancing loss where it trains
        (train.moe_aux_loss > 0, refused with pipeline stages) over the `dp` ranks that compute
        it apart (data × context parallel); then reset. A collective: every rank calls it."""
        if not self.active:
            return {}
        dist.all_reduce(self.counts)
        self.counts //= tp
        record = {"tokens_per_expert": self.counts.tolist()}
        if self.bias_rate:
            self._balance()
        if self.aux_sum.item():
            dist.all_reduce(self.aux_sum)
            record["moe_aux_loss"] = self.aux_sum.item() / (dp * tp)
        self.counts.zero_()
        self.aux_sum.zero_()
        self.aux = []
        return record
