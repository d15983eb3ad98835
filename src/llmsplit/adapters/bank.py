"""Several LoRA adapters served over one base model at once (as S-LoRA and vLLM's multi-LoRA
serving do it): the base weights stay as they are, and each adapted projection adds to every
token's row the update of the adapter that token's sequence asked for,

    out[rows of k] += (x[rows of k] @ A_k^T) @ B_k^T * scale_k,

so requests for different adapters (and for the base) share one batch and one forward, and
an adapter costs its own A and B, not a copy of the model.

Applied from outside the plain model with a forward hook on each adapted `nn.Linear`, whatever
that layer's weight is stored as (float or packed). Without a grouped LoRA kernel on CPU
(punica's SGMV is CUDA-only), each projection stacks the A of all its adapters into one
[R, in] matrix and their B (scale folded in) into one [out, R], and runs them on every row
with the columns of other adapters masked out:

    out += ((x @ A_all^T) * [adapter of the row == adapter of the column]) @ B_all^T.

Two matmuls per projection whatever the mix of adapters, no indexing and no Python branch on
which adapters a step holds, so a compiled decode graph (`--compile`) serves every mix
without recompiling; the cost is the served adapters' ranks summed (R) on every row, small
beside the projection itself (R of a few dozen against its thousands of inputs). A step
whose rows are all on the base skips the hooks' work (eager; a compiled step is given zeros).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AdapterBank:
    """The adapters one model serves: adapter k (1, 2, ...) is `names[k - 1]`; 0 is the base."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self._rows: torch.Tensor | None = None  # the adapter of each row of this step (set_rows)

    def attach(self, model: nn.Module, adapters: list[dict[str, torch.Tensor]], scales: list[float],
               devices: dict[str, torch.device], dtype: torch.dtype) -> None:
        """Hook the adapters (each {"layers.i.attention.wq.lora_a": A, ...lora_b: B}, as a LoRA
        run's checkpoint holds them, sliced like the layer where it is split) onto `model`'s
        projections; `devices`: unit -> the device its layer computes on."""
        per_layer: dict[str, list] = {}
        for k, (state, scale) in enumerate(zip(adapters, scales), 1):
            for name, a in state.items():
                if not name.endswith(".lora_a"):
                    continue
                layer = name[:-len(".lora_a")]
                b = state[f"{layer}.lora_b"]
                out_f, in_f = model.get_submodule(layer).weight.shape  # (checked against the model when read)
                assert a.shape[1] == in_f and b.shape[0] == out_f and a.shape[0] == b.shape[1], (layer, a.shape, b.shape)
                per_layer.setdefault(layer, []).append((k, a, b * scale))
        self.stacked = []  # per adapted layer: (A_all [R, in], B_all [out, R], adapter of each of the R columns)
        for layer, entries in per_layer.items():
            dev = devices[".".join(layer.split(".")[:2])]
            owner = torch.cat([torch.full((a.shape[0],), k) for k, a, _ in entries]).to(dev)
            stack = (torch.cat([a for _, a, _ in entries]).to(dev, dtype).contiguous(),
                     torch.cat([b for _, _, b in entries], dim=1).to(dev, dtype).contiguous(), owner)
            self.stacked.append(stack)
            # First among the layer's hooks: a row-parallel layer's partial update is then summed
            # by its tensor-parallel all-reduce (a hook registered before) with its partial product.
            model.get_submodule(layer).register_forward_hook(
                lambda module, args, out, stack=stack: self._add(args[0], out, *stack), prepend=True)
        self.adapted = sorted({layer.split(".")[1] for layer in per_layer}, key=int)  # layer ids with adapters
        self.layers = list(per_layer)  # the adapted projections, in the order of `stacked`

    @torch.no_grad()
    def replace(self, state: dict[str, torch.Tensor], scale: float) -> None:
        """Overwrite the one adapter of this bank in place with `state` (as `attach` takes it):
        GRPO's policy after each optimizer step (posttrain/handover.py), with the hooks, and a
        compiled graph's static inputs, left as they are."""
        assert len(self.names) == 1, "replace: a bank of one adapter"
        for layer, (a, b, _) in zip(self.layers, self.stacked):
            a.copy_(state[f"{layer}.lora_a"])
            b.copy_(state[f"{layer}.lora_b"] * scale)

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """The adapter of each token row of the next forward ([tokens], 0 for the base), in the
        order the forward flattens them; None: every row on the base."""
        self._rows = rows

    def _add(self, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             owner: torch.Tensor) -> torch.Tensor:
        if self._rows is None:
            return out
        x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        mask = self._rows.to(x.device)[:, None] == owner[None, :]
        o2.add_(F.linear(F.linear(x2, a) * mask.to(x2.dtype), b))
        return out
