"""Tensor parallel (Megatron-style) for the decoder, with DTensor `parallelize_module`.

Column-parallel q/k/v and MLP gate/up, row-parallel attention output and MLP down, a
vocabulary-parallel embedding, and an output head whose logits stay sharded over the
vocabulary so the loss is computed on the shards (`loss_parallel`). With sequence
parallel the residual stream and the norms are split along the sequence between the
TP regions (all-gather in, reduce-scatter out), which divides activation memory by tp.
Which weight splits how is the one table that inference and the planner read too
(layout.tp_plan); this module adds how the activations move between them.

A mixture-of-experts layer (models/moe.py) runs whole on every tp rank, on the whole
sequence: its input is gathered from the sequence shards, its router is replicated, its
shared experts are split like a dense MLP, and its routed experts are expert parallel's
(parallel.ep, split over data-parallel ranks of the same tp rank, which see other tokens);
the output is cut back to this rank's sequence shard. Splitting each expert over tp as
well would need a second all-reduce per layer on top of ep's all-to-all; Megatron-Core
and torchtitan also keep experts out of attention's tp split ("expert tensor parallel" 1).

Grouped-query attention with fewer key/value heads than tp ranks (tp a multiple of
n_kv_heads) replicates the kv heads, as Megatron-Core and vLLM do: see `KVHeadReplicate`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..layout import COLWISE, HEAD_NORMS, KV_PROJECTIONS, REPLICATE, ROWWISE, TOP_PLAN, layer_plan
from ..models.llama import Transformer

# Positional inputs of Attention.forward: x, cos, sin, kv_cache, layer_id, start_pos.
_ATTN_EXTRA_INPUTS = (None, None, None, None, None)
# Gemma 2's norms after attention and MLP: their output is added to the residual stream, a plain tensor.
_OUTPUT_NORMS = ("post_attention_norm", "post_ffn_norm")


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank, with its parameters as replicated DTensors.

    Without sequence parallel the norms run on the full activation on every rank; making
    their weights DTensors too keeps every parameter of the model the same kind, which
    gradient clipping and the optimizer need. torch has no public style for this.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _is_plain_tensor(x) else x
                         for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if hasattr(outputs, "to_local") else outputs

        return distribute_module(module, device_mesh, _replicate_params, to_dtensor, to_local)


class KVHeadReplicate(ParallelStyle):
    """wk or wv when tp exceeds the kv heads: each rank gets the one kv head its query heads use.

    Column sharding cannot do it (it would cut a head into pieces), so the weight stays whole
    on every rank as a replicated DTensor: checkpoints, export and resume see the model's own
    [n_kv_heads·head_dim, dim] shape. The projection runs on the replicated input, each kv
    head is repeated tp/n_kv_heads times into tp "virtual" heads, and rank r keeps virtual
    head r, i.e. kv head r // (tp / n_kv_heads): the one all of its n_heads/tp query heads use.
    DTensor's backward of that split all-gathers the heads' gradients and the repeat sums
    them, so every rank gets the same full weight gradient: the sum over all replicas, the
    single-process gradient, and the copies stay identical after every optimizer step.
    """

    def __init__(self, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n_kv, hd = self.n_kv_heads, self.head_dim
        copies = device_mesh.size() // n_kv

        def to_replicated(mod, inputs, mesh):
            x = inputs[0]
            if _is_plain_tensor(x):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

        def own_head(mod, out, mesh):
            lead = out.shape[:-1]
            virtual = out.unflatten(-1, (n_kv, 1, hd)).expand(*lead, n_kv, copies, hd)
            virtual = virtual.reshape(*lead, n_kv * copies * hd)
            return virtual.redistribute(mesh, [Shard(virtual.dim() - 1)]).to_local()

        return distribute_module(module, device_mesh, _replicate_params, to_replicated, own_head)


def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Replicate()])))


def _is_plain_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor) and not hasattr(x, "device_mesh")


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split every layer of `model` over `tp_mesh` in place (the model may be on meta)."""
    sp = sequence_parallel
    cfg = model.cfg
    residual = Shard(1) if sp else Replicate()
    norm_style = SequenceParallel() if sp else ReplicateParallel()
    top = {}
    for name, split in TOP_PLAN.items():
        module = getattr(model, name)
        if module is None:
            continue  # on another pipeline stage
        if split == REPLICATE:
            top[name] = norm_style
        elif isinstance(module, nn.Embedding):  # torch's row split of an embedding divides the vocabulary
            top[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        else:  # the head's output features are the vocabulary: logits stay sharded for loss_parallel
            top[name] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {**_activation_plan(cfg, residual),
                                            **_weight_plan(cfg, tp_mesh.size(), residual, norm_style, sp)})


def _weight_plan(cfg, tp: int, residual, norm_style, sp: bool) -> dict[str, ParallelStyle]:
    """Each module of a layer that holds weights, split as the table says (layout.tp_plan)."""
    plan = {}
    for name, split in layer_plan(cfg).items():
        # A MoE layer runs whole on the gathered sequence (module docstring): what its shared
        # experts' down projection sums stays replicated until the layer cuts its output.
        in_moe = bool(cfg.n_experts) and name.startswith("feed_forward.")
        if split == COLWISE:
            whole_kv = name in KV_PROJECTIONS and cfg.n_kv_heads % tp  # validation: tp a multiple of n_kv_heads
            plan[name] = KVHeadReplicate(cfg.n_kv_heads, cfg.head_dim) if whole_kv else ColwiseParallel()
        elif split == ROWWISE:
            plan[name] = RowwiseParallel(output_layouts=Replicate() if in_moe else residual)
        elif name in HEAD_NORMS:
            # Qwen3's q/k norms run on this rank's heads ([b, s, heads, head_dim]): the heads are the
            # sharded dim, so their weight gradients are partial sums that DTensor adds over the ranks.
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif name in _OUTPUT_NORMS:
            plan[name] = SequenceParallel(use_local_output=True) if sp else ReplicateParallel()
        else:  # the norms before attention and MLP, and the router (inside the whole MoE layer)
            plan[name] = ReplicateParallel() if in_moe else norm_style
    return plan


def _activation_plan(cfg, residual) -> dict[str, ParallelStyle]:
    """Where activations change layout: attention and each SwiGLU MLP take the whole sequence."""
    plan = {"attention": PrepareModuleInput(input_layouts=(residual, *_ATTN_EXTRA_INPUTS),
                                            desired_input_layouts=(Replicate(), *_ATTN_EXTRA_INPUTS))}
    if not cfg.n_experts:
        plan["feed_forward"] = PrepareModuleInput(input_layouts=(residual,), desired_input_layouts=(Replicate(),))
        return plan
    # A MoE layer whole on the gathered sequence (module docstring); plain tensors inside.
    plan["feed_forward"] = PrepareModuleInputOutput(input_layouts=(residual,), desired_input_layouts=(Replicate(),),
                                                    use_local_input=True, output_layouts=(Replicate(),),
                                                    desired_output_layouts=(residual,))
    if cfg.n_shared_experts:  # summed with the routed output before the layer's output
        plan["feed_forward.shared"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                         desired_input_layouts=(Replicate(),))
    return plan
