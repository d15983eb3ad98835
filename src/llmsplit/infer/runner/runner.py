"""One process's piece of the model and its KV cache: the whole model placed over this
machine's devices (with offload), a tensor-parallel shard, a pipeline stage, or both.

The piece is the plain `Transformer` built on the meta device; only what this process
needs is read from the weight source (tensor-parallel ranks read just their slices) and
placed on its device. Tensor parallelism is applied the way gpt-fast does it, by slicing
the weights and summing the partial outputs of the attention output and MLP down
projections with an all-reduce: at inference there are no gradients, so DTensor's
bookkeeping would only add per-op overhead to every decode step. Which weights split, and
along which dim, is the one tensor-parallel plan training and the planner read
(layout/tp_plan.py: `tp_shard`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ... import native
from ...allocator import give_back_freed_memory, keep_freed_memory
from ...errors import ConfigError
from ...io.weights import read_weight
from ...layout import INFER_EXPERT_DIMS, tp_shard
from ...models.llama import Transformer
from ...models.rope import model_rope_tables
from ...plan.placement import Placement
from ...threads import ThreadTuner
from ..engine.step import PackedStep, Step
from .cpu_experts import experts_on_cpu
from .kv_cache import PagedKVCache
from .offload import Offloader, set_parameter
from .vocab_parallel import VocabParallelEmbedding, VocabParallelHead, read_vocab_shard

@dataclass
class PieceSpec:
    """Which part of the model this process holds and how to run it."""
    placement: Placement  # units of this piece -> devices
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_context: int
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None
    offload_dir: str | None = None
    layers: list[int] = field(default_factory=list)  # empty: all
    compile: bool = False  # torch.compile the one-token decode step
    tune_threads: bool = False  # choose the thread count as it decodes (llmsplit/threads.py)
    quantize: str | None = None  # io.weights.read_weight: which weights stay packed
    kv_dtype: str | None = None  # "int8": the KV pool stores int8 with scales (kv_cache.PagedKVCache)


def fuse_projections(layers) -> None:
    """Give each layer's attention one q/k/v weight and its MLP one gate/up weight, so a
    decode step runs 3 matmuls a layer instead of 7 (at batch 1 on a small model the
    per-op overhead is a large share of a token). The separate weights become views of the
    fused ones: one copy in memory, the same parameter names. Offloaded layers are left
    alone, because their hooks swap the separate weights in and out."""
    for layer in layers:
        att, ff = layer.attention, layer.feed_forward
        parts = (att.wq, att.wk, att.wv)
        weight = torch.cat([m.weight for m in parts])
        bias = torch.cat([m.bias for m in parts]) if att.wq.bias is not None else None
        row = 0
        for m in parts:
            n = m.weight.shape[0]
            set_parameter(m, "weight", weight[row:row + n])
            if bias is not None:
                set_parameter(m, "bias", bias[row:row + n])
            row += n
        att.qkv = (weight, bias, att.wq.weight.shape[0] // att.head_dim, att.wk.weight.shape[0] // att.head_dim)
        if not isinstance(ff.w1, nn.Linear):
            continue  # a mixture of experts: its experts already run as grouped matmuls
        gate_up = torch.cat([ff.w1.weight, ff.w3.weight])
        set_parameter(ff.w1, "weight", gate_up[:ff.w1.weight.shape[0]])
        set_parameter(ff.w3, "weight", gate_up[ff.w1.weight.shape[0]:])
        ff.gate_up = gate_up


def _mark_static(t: torch.Tensor) -> None:
    """`torch._dynamo.mark_static` on `t` and on the inner tensors of a tensor subclass."""
    torch._dynamo.mark_static(t)
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            _mark_static(getattr(t, name))


def _rows_follow_the_batch(compiled):
    """The compiled decode step with the bank's rows of the step (read by the hooks, so
    reached through the modules) sized like the batch: dynamo gives tensors reached through
    modules fixed sizes, which pinned the batched graph to its first batch size (one
    recompile per new size). The bank's own A and B stay static (`mark_static`)."""
    def decode(*args, **kwargs):
        with torch._dynamo.config.patch(force_nn_module_property_static_shapes=False):
            return compiled(*args, **kwargs)
    return decode


def _meta_model(cfg, spec: PieceSpec, owned: set[int]) -> Transformer:
    """This piece's modules on the meta device: its layers and ends only, split over the vocabulary
    under tensor parallelism, the head untied (re-tied where both ends land together)."""
    dmap = spec.placement.device_map
    with torch.device("meta"):
        model = Transformer(cfg)
    for i in range(cfg.n_layers):
        if i not in owned:
            del model.layers[str(i)]
    for unit in ("tok_embeddings", "norm", "output"):
        if unit not in dmap:
            setattr(model, unit, None)
    if spec.tp_size > 1:  # split over the vocabulary, not replicated
        args = (spec.tp_rank, spec.tp_size, spec.tp_group)
        with torch.device("meta"):
            if model.tok_embeddings is not None:
                model.tok_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, *args)
            if model.output is not None:
                model.output = VocabParallelHead(cfg.dim, cfg.vocab_size, *args)
    if model.output is not None and model.tok_embeddings is not None:
        # Untie (Runner re-ties them where both ends land together). Not empty_like: on the meta
        # device that is PyTorch's Python kernel, which imports sympy.
        w = model.output.weight
        model.output.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=w.device))
    return model


class Runner:
    def __init__(self, source, spec: PieceSpec):
        cfg = replace(source.config, max_seq_len=spec.max_context)
        self.cfg, self.spec = cfg, spec
        dmap = spec.placement.device_map
        exec_device = torch.device(spec.placement.exec_device)
        owned = set(spec.layers or range(cfg.n_layers))
        model = _meta_model(cfg, spec, owned)
        self.offloader = None
        self.devices: dict[str, torch.device] = {}  # unit -> device it computes on
        offloaded = {u for u, d in dmap.items() if d in ("cpu", "disk") and d != exec_device.type}
        for unit, dev in dmap.items():
            module = model.get_submodule(unit)
            if (unit == "output" and cfg.tie_embeddings and dmap.get("tok_embeddings") == dev
                    and not {"tok_embeddings", "output"} & offloaded):
                model.output.weight = model.tok_embeddings.weight  # one copy for both ends
                self.devices[unit] = torch.device(dev)
                continue
            # Disk offload writes safetensors files, which hold plain tensors: those units are widened.
            tensors = {key: self._read(source, f"{unit}.{key}", packed=unit not in offloaded)
                       for key, _ in module.named_parameters()}
            for key, _ in module.named_buffers():  # a MoE router's expert_bias: fp32, never packed or split
                owner, _, attr = key.rpartition(".")
                module.get_submodule(owner)._buffers[attr] = read_weight(source, f"{unit}.{key}", None, "none").to(
                    exec_device if unit in offloaded else dev, torch.float32)
            if unit in offloaded:
                if self.offloader is None:
                    self.offloader = Offloader(exec_device, spec.offload_dir)
                self.offloader.add(unit, module, tensors, dev)
                self.devices[unit] = exec_device
                continue
            cpu_experts = unit in {f"layers.{i}" for i in spec.placement.cpu_experts}
            for key, t in tensors.items():
                set_parameter(module, key, t.to("cpu" if cpu_experts and key in INFER_EXPERT_DIMS else dev))
            if cpu_experts:  # --n-cpu-moe: this layer's experts run where they are kept
                module.feed_forward.dispatch = experts_on_cpu
            if unit.startswith("layers."):
                fuse_projections([module])
            self.devices[unit] = torch.device(dev)
            # This unit's conversion transients and its unfused parts, so that the load's peak is
            # the live weights, not their holes in the heap as well.
            give_back_freed_memory()
        first = self.devices.get("tok_embeddings") or self.devices[f"layers.{min(owned)}"]
        model.rope_cos, model.rope_sin = model_rope_tables(cfg, spec.max_context, first)
        self._move_at_device_changes(model)
        if spec.tp_size > 1:
            for i in owned:
                layer = model.layers[str(i)]
                ff = layer.feed_forward  # a MoE layer's output sums its routed and shared experts
                for m in (layer.attention.wo, ff.w2 if isinstance(ff.w2, nn.Linear) else ff):
                    m.register_forward_hook(self._all_reduce)
        self.model = model.eval()
        self.input_device = first
        # Decode on the CPU picks its thread count as it runs (llmsplit/threads.py) in the processes
        # llmsplit owns (generate, serve): a library caller's torch threads are its own.
        # Tensor-parallel pieces keep theirs (their ranks step together); CUDA steps are not timed.
        # Not a compiled step: a graph is compiled for the thread count it was traced at (another
        # count recompiled it, minutes each: `generate --compile` decoded 2.5 tokens/s).
        self.tuner = ThreadTuner(allowed=spec.tune_threads and exec_device.type == "cpu" and spec.tp_size == 1
                                 and not spec.layers and not spec.compile)
        self.cache = PagedKVCache(spec.num_blocks, spec.block_size, cfg.n_kv_heads // spec.tp_size, cfg.head_dim,
                                  {i: self.devices[f"layers.{i}"] for i in owned}, spec.dtype, spec.kv_dtype)
        self._decode = self._compiled_decode() if spec.compile else None
        self.bank = None  # the LoRA adapters served over this model (`serve_adapters`), if any
        if exec_device.type == "cpu":  # loaded: from here on steps reuse the memory they free (allocator.py)
            keep_freed_memory()

    @property
    def decodes_in_place(self) -> bool:
        return self.cache.reads_in_place()

    @property
    def decode_compiled(self) -> bool:
        return self._decode is not None

    def serve_adapters(self, names: list[str], adapters: list[dict], scales: list[float]) -> None:
        """Serve LoRA adapters (whole, checked against the model: `io.weights.run_adapters`) over
        this piece, each applied to the rows of the sequences that ask for it (adapters/bank.py).
        A pipeline stage keeps its own layers' adapters; a tensor-parallel rank the slices of
        them its layer's shard needs (`tp_shard`): B's rows of a column-parallel layer (A whole),
        A's columns of a row-parallel one (B whole), whose partial update the layer's
        all-reduce then sums with its partial product. The adapted layers run their
        projections one by one again (not fused), so that each projection's hook sees its own output."""
        from ...adapters.bank import AdapterBank

        pieces = []
        for state in adapters:
            piece = {}
            for name, t in state.items():
                layer, which = name.rsplit(".", 1)
                if layer.split(".")[1] not in self.model.layers:
                    continue  # another pipeline stage's layer
                shard = tp_shard(f"{layer}.weight", self.spec.tp_rank, self.spec.tp_size)
                if shard is not None and (shard[0] == 0) == (which == "lora_b"):  # B by rows, or A by columns
                    t = t.chunk(shard[2], shard[0])[shard[1]]
                piece[name] = t
            pieces.append(piece)
        bank = AdapterBank(names)
        bank.attach(self.model, pieces, scales, self.devices, self.spec.dtype)
        for i in bank.adapted:
            layer = self.model.layers[i]
            layer.attention.qkv = None
            if getattr(layer.feed_forward, "gate_up", None) is not None:
                layer.feed_forward.gate_up = None
        self.bank = bank
        if self._decode is not None:  # (compiled at load, after this: api._compile_decode_graphs)
            self._adapt_compiled_decode()

    def compile_decode(self) -> None:
        """Decode compiled from now on (--compile auto's swap, api.LoadedModel.compile_when_ready);
        the graphs compile at their first steps."""
        if self.tuner.enabled:  # a compiled step runs at the count it was built with: never tuned
            self.tuner.enabled = False
            torch.set_num_threads(self.tuner.high)
        self._decode = self._compiled_decode()
        if self.bank is not None:
            self._adapt_compiled_decode()

    def _adapt_compiled_decode(self) -> None:
        self._decode = _rows_follow_the_batch(self._decode)
        for t in (t for stack in self.bank.stacked for t in stack):
            _mark_static(t)  # as the pools: they never change shape

    @torch.no_grad()
    def replace_weights(self, state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor] | None = None,
                        scale: float = 1.0) -> None:
        """Overwrite this model's float weights in place with whole tensors by name (a tied head
        reads the embedding), or with `adapter` the one adapter it serves: GRPO's policy after
        each optimizer step (posttrain/handover.py). Fused projections are views of the
        separate weights' storage (`fuse_projections`), so they follow. A whole model in one
        process only: no tensor-parallel slices, no packed or offloaded weights."""
        assert self.spec.tp_size == 1 and not self.spec.layers and self.offloader is None
        if adapter is not None:
            self.bank.replace(adapter, scale)
        for name, p in self.model.named_parameters():
            whole = state.get(name, state.get("tok_embeddings.weight") if name == "output.weight" else None)
            if whole is not None:
                p.copy_(whole)
        for name, b in self.model.named_buffers():
            if name in state:
                b.copy_(state[name])

    def _compiled_decode(self):
        """The model's forward compiled for decode steps (one new token per sequence). Each
        step runs the same few hundred small ops, so at batch 1 the per-op dispatch of eager
        mode is a large share of a token's time: compiled, SmolLM2-135M decodes 1.5× faster on
        2 CPU cores (fp32; BENCHMARKS.md). Shapes are dynamic (the keys grow every step, the
        batch changes), so it compiles two graphs at load time (`api._compile_decode_graphs`):
        one sequence, and several in the masked form (each at its own position), which serves
        every batch size and every mix of positions; prefills stay eager. Offloaded layers
        swap their weights in hooks, which a compiled graph would not see, so offload is
        refused (`api.load` refuses --tp/--pp before any runner exists)."""
        if self.offloader is not None:
            raise ConfigError("compile=True needs every layer resident; this load offloads layers (drop --compile, "
                              "or give the model more memory)")
        # Under dynamic=True every plain tensor the graph reads gets symbolic sizes, the KV
        # pools and fused weights too; equations between those and the batch size then
        # pinned the batched graph to its first batch size (a recompile per new size). They
        # never change shape after loading: say so. A packed weight's inner tensors are what
        # the graph reads (its groups of scales equalled the batch size: a recompile at batch 2).
        for pool in self.cache.pools():
            _mark_static(pool)
        for layer in self.model.layers.values():
            if layer.attention.qkv is not None:
                _mark_static(layer.attention.qkv[0])
                _mark_static(layer.feed_forward.gate_up)
        for p in self.model.parameters():
            if is_traceable_wrapper_subclass(p):
                _mark_static(p)
        # The modules never change after loading, so guards on them (hundreds of parameters,
        # checked before every call: ~0.8 ms a token) are skipped; guards on the inputs stay.
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        if torch.device(self.spec.placement.exec_device).type == "cpu":
            # A C++ wrapper calls the graph's ~300 kernels instead of Python: 31.6 against 28.7
            # tokens/s for SmolLM2-135M on 2 cores. Its first compile is slower (~4 min there
            # against ~1; torch caches both on disk for the next load).
            options["cpp_wrapper"] = True
        # Its own graphs: with the module guards skipped, a graph compiled for another model of
        # the same code (one loaded packed, this one float) would otherwise run on this one.
        native.constants_for_compile()
        return torch.compile(self.model.forward, dynamic=True, options=options, isolate_recompiles=True)

    def _read(self, source, name: str, packed: bool) -> torch.Tensor:
        if self.spec.tp_size > 1 and name in ("tok_embeddings.weight", "output.weight"):
            w = read_vocab_shard(source, name, self.cfg.vocab_size, self.spec.tp_rank, self.spec.tp_size)
            return w.to(self.spec.dtype)
        shard = tp_shard(name, self.spec.tp_rank, self.spec.tp_size)
        return read_weight(source, name, shard, self.spec.quantize if packed else "none").to(self.spec.dtype)

    def _all_reduce(self, module, args, out):
        dist.all_reduce(out, group=self.spec.tp_group)

    def _move_at_device_changes(self, model: Transformer) -> None:
        """Hidden states follow the model across devices; a hook sits only where the device changes."""
        order = [u for u in ("tok_embeddings", *[f"layers.{i}" for i in sorted(map(int, model.layers))], "norm",
                             "output") if u in self.devices]
        for prev, unit in zip(order, order[1:]):
            if self.devices[unit] != self.devices[prev]:
                dev = self.devices[unit]
                model.get_submodule(unit).register_forward_pre_hook(
                    lambda m, args, d=dev: (args[0].to(d), *args[1:]))

    @torch.no_grad()
    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The final hidden states [b, s, dim] of a full forward without cache (what embeddings
        pool): the last layer's output, read by a hook, through the final norm. The head runs for
        the last position only: its logits are not wanted."""
        last = self.model.layers[max(self.model.layers, key=int)]
        seen = []
        handle = last.register_forward_hook(lambda module, args, out: seen.append(out))
        try:
            self.forward(tokens, None, last_only=True)
        finally:
            handle.remove()
        return self.model.norm(seen[0]) if self.model.norm is not None else seen[0]

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, step: Step | None, last_only: bool,
                adapters: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens [b, s] (or hidden states [b, s, dim] for a later pipeline stage) through this
        piece; with a step, through the KV cache as well. `adapters` [b * s]: the served LoRA
        adapter of each token (0: the base; `serve_adapters`), None: all on the base."""
        self.cache.set_step(step)
        if self.bank is not None:
            self.bank.set_rows(adapters)
        x = tokens.to(self.input_device)
        if step is None:
            return self.model(x, last_only=last_only)
        if isinstance(step, PackedStep):  # a fused step, run eager: its shapes change every step
            return self.model(x, kv_cache=self.cache, positions=step.positions[None].to(self.input_device),
                              pick=step.pick.to(self.input_device))
        forward, started = self.model, time.perf_counter()
        # Compiled: one-token decode steps. A batch always takes the masked form, so one graph
        # serves it whatever its size and positions. A single sequence passes its position as
        # an int, which dynamo would specialize at 0 and 1: positions below 2 run eager.
        if self._decode is not None and x.shape[1] == 1 and step.gather.shape[1] > 2:
            forward = self._decode
            if self.bank is not None and adapters is None:  # one graph for every mix, the base's rows too
                self.bank.set_rows(torch.zeros(x.shape[0], dtype=torch.long))
            if x.shape[0] > 1:
                step = step.per_sequence()
                self.cache.set_step(step)
        start = step.start if isinstance(step.start, int) else step.start.to(self.input_device)
        out = forward(x, kv_cache=self.cache, start_pos=start, last_only=last_only)
        if x.shape[1] == 1:  # a decode step: what the thread count is tuned on
            self.tuner.record(time.perf_counter() - started, x.shape[0])
        return out

    def close(self) -> None:
        if self.offloader is not None:
            self.offloader.close()
