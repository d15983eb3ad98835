"""Several LoRA adapters served over one base model at once (as S-LoRA and vLLM's multi-LoRA
serving do it): the base weights stay as they are, and each adapted projection adds to every
token's row the update of the adapter that token's sequence asked for,

    out[rows of k] += (x[rows of k] @ A_k^T) @ B_k^T * scale_k,

so requests for different adapters (and for the base) share one batch and one forward, and
an adapter costs its own A and B, not a copy of the model.

Applied from outside the plain model with a forward hook on each adapted `nn.Linear`, whatever
that layer's weight is stored as (float or packed). Without a grouped LoRA kernel on CPU
(punica's SGMV is CUDA-only), the step's tokens are grouped by adapter once per step
(`set_rows`) and each group runs two small matmuls per projection: a step whose rows all ask
for one adapter runs them on the whole batch without indexing, and rows of the base cost
nothing. The scale is folded into B once at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ALL = object()  # every row of the step asks for this adapter


class AdapterBank:
    """The adapters one model serves: adapter k (1, 2, ...) is `names[k - 1]`; 0 is the base."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self._rows: dict[int, object] = {}  # adapter -> its rows of this step ([n] long, or _ALL)
        self._on: dict[torch.device, dict[int, object]] = {}

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
                dev = devices[".".join(layer.split(".")[:2])]
                per_layer.setdefault(layer, []).append(
                    (k, a.to(dev, dtype).contiguous(), (b * scale).to(dev, dtype).contiguous()))
        for layer, entries in per_layer.items():
            # First among the layer's hooks: a row-parallel layer's partial update is then summed
            # by its tensor-parallel all-reduce (a hook registered before) with its partial product.
            model.get_submodule(layer).register_forward_hook(
                lambda module, args, out, entries=entries: self._add(args[0], out, entries), prepend=True)
        self.adapted = sorted({layer.split(".")[1] for layer in per_layer}, key=int)  # layer ids with adapters

    def set_rows(self, rows: torch.Tensor | None) -> None:
        """The adapter of each token row of the next forward ([tokens], 0 for the base), in the
        order the forward flattens them; None: every row on the base."""
        self._on = {}
        if rows is None:
            self._rows = {}
            return
        present = rows.unique().tolist()
        if len(present) == 1:
            self._rows = {} if present[0] == 0 else {present[0]: _ALL}
            return
        self._rows = {k: (rows == k).nonzero().flatten() for k in present if k != 0}

    def _groups(self, device: torch.device) -> dict[int, object]:
        if device not in self._on:  # moved once per step and device, not once per projection
            self._on[device] = {k: r if r is _ALL else r.to(device) for k, r in self._rows.items()}
        return self._on[device]

    def _add(self, x: torch.Tensor, out: torch.Tensor, entries) -> torch.Tensor:
        if not self._rows:
            return out
        groups = self._groups(x.device)
        x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        for k, a, b in entries:
            rows = groups.get(k)
            if rows is _ALL:
                o2.add_(F.linear(F.linear(x2, a), b))
            elif rows is not None:
                o2.index_add_(0, rows, F.linear(F.linear(x2.index_select(0, rows), a), b))
        return out
