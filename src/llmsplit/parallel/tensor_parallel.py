"""Tensor parallel (Megatron-style) for the decoder, with DTensor `parallelize_module`.

Column-parallel q/k/v and MLP gate/up, row-parallel attention output and MLP down, a
vocabulary-parallel embedding, and an output head whose logits stay sharded over the
vocabulary so the loss is computed on the shards (`loss_parallel`). With sequence
parallel the residual stream and the norms are split along the sequence between the
TP regions (all-gather in, reduce-scatter out), which divides activation memory by tp.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..models.llama import Transformer

# Positional inputs of Attention.forward: x, cos, sin, kv_cache, layer_id, start_pos.
_ATTN_EXTRA_INPUTS = (None, None, None, None, None)


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank, with its parameters as replicated DTensors.

    Without sequence parallel the norms run on the full activation on every rank; making
    their weights DTensors too keeps every parameter of the model the same kind, which
    gradient clipping and the optimizer need. torch has no public style for this.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))

        def to_dtensor(mod, inputs, mesh):
            from torch.distributed.tensor import DTensor

            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _is_plain_tensor(x) else x
                         for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if hasattr(outputs, "to_local") else outputs

        return distribute_module(module, device_mesh, partition, to_dtensor, to_local)


def _is_plain_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and not hasattr(x, "device_mesh")


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split every layer of `model` over `tp_mesh` in place (the model may be on meta)."""
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    norm_style = SequenceParallel() if sp else ReplicateParallel()
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if model.norm is not None:
        top["norm"] = norm_style
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": norm_style,
            "attention": PrepareModuleInput(input_layouts=(residual, *_ATTN_EXTRA_INPUTS),
                                            desired_input_layouts=(Replicate(), *_ATTN_EXTRA_INPUTS)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
            "ffn_norm": norm_style,
            "feed_forward": PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=residual),
        })
