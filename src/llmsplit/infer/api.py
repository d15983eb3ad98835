"""`llmsplit.load`: open any supported model, place it, and return the object users call.

Placement (one process) or the split over workers (--tp/--pp) is decided here, once; the
engine then drives whichever runner results.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import torch

from ..errors import ConfigError
from ..io.weights import open_weights, packed_unit_bytes, run_adapters
from ..launch import Nodes
from .distributed import SplitRunner, follow_node, split_layout, split_spec
from .engine import Engine, SamplingParams
from .kv_cache import KV_DTYPES, kv_element_bytes
from .placement import MODES, Placement, Sizes, detect_budgets, place
from .runner import PieceSpec, Runner


class LoadedModel:
    """What `llmsplit.load` returns: `generate`, `logits`, `tokenizer`, `device_map`."""

    def __init__(self, engine: Engine, runner, placement: Placement | None, device_map: dict[str, str], config,
                 adapters: list[str] = ()):
        self.engine = engine
        self.adapters = list(adapters)  # the LoRA adapters served over the model: adapter k is adapters[k - 1]
        self.runner = runner
        self.placement = placement
        self.device_map = device_map
        self.config = config
        self.tokenizer = engine.tokenizer
        self._finalizer = weakref.finalize(self, runner.close)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward, no cache: [b, s] -> [b, s, vocab] (float32, on the CPU)."""
        return self.runner.forward(torch.as_tensor(input_ids), None, last_only=False).float().cpu()

    def generate(self, prompt, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None, ignore_eos: bool = False,
                 on_text=None):
        """Continue `prompt` (text, token ids, or a LongTensor [1, s]); a list of strings or a
        LongTensor [b, s] is a batch generated together and gives a list of strings.
        `on_text(piece)` (or `on_text(index, piece)` for a batch) receives text as it comes."""
        batch = isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], str) or (
            isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[0] > 1)
        prompts = list(prompt) if batch else [prompt]
        params = SamplingParams(max_new_tokens, temperature, top_k, top_p, seed,
                                [stop] if isinstance(stop, str) else list(stop or []), ignore_eos)
        params.check()
        seqs = [self.engine.new_sequence(self._ids(p), params) for p in prompts]
        callback = on_text if batch or on_text is None else (lambda _i, piece: on_text(piece))
        self.engine.generate(seqs, callback)
        texts = [s.text for s in seqs]
        return texts if batch else texts[0]

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, torch.Tensor):
            return prompt.reshape(-1).tolist()
        return [int(t) for t in prompt]

    def close(self) -> None:
        """Stop the worker processes (tp/pp) and the prefetch thread; also done at exit."""
        self._finalizer()


def run_sizes(source, dtype, max_batch: int, max_context: int | None, block_size: int = 16,
              kv_tokens: int | None = None, quantize: str | None = None, kv_dtype: str | None = None):
    """(compute dtype, placement `Sizes`) for a load: what `load` places with, and what the
    out-of-memory explainer (`diagnose/oom.py`) explains with. `kv_tokens`: the KV pool all
    sequences share (default max_batch full contexts); blocks are taken as tokens arrive and
    the engine preempts when it runs out, so a pool smaller than max_batch × max_context
    serves max_batch sequences as long as they are shorter on average. Packed units count
    their packed bytes (`quantize` as `load` takes it); the KV pool its elements' bytes
    (`kv_dtype` "int8": 1 byte and a share of the scales, `kv_cache.kv_element_bytes`)."""
    from ..models.rope import dynamic_rope_limit

    # Dynamic NTK rope exists to run past max_position_embeddings; any other model stops there.
    dynamic = dynamic_rope_limit(source.config.rope_scaling) is not None
    max_context = (max_context or 4096) if dynamic else min(max_context or 4096, source.config.max_seq_len)
    if max_batch < 1 or max_context < 2 or block_size < 1:
        raise ConfigError(f"max_batch {max_batch}, max_context {max_context} and block_size {block_size} "
                          f"must be positive (max_context at least 2)")
    if kv_tokens is not None and kv_tokens < max_context:
        raise ConfigError(f"kv_tokens {kv_tokens} holds less than one sequence of max_context {max_context} "
                          f"tokens; raise --kv-tokens or lower --max-context")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype {kv_dtype!r} is not one of: {', '.join(KV_DTYPES)} (default: the compute dtype)")
    dtype = _dtype(dtype, source.dtype if torch.cuda.is_available() else torch.float32)
    kv_bytes = kv_element_bytes(dtype.itemsize, source.config.head_dim, kv_dtype)
    return dtype, Sizes(batch=max_batch, context=max_context, dtype_bytes=dtype.itemsize,
                        kv_dtype_bytes=kv_bytes, kv_tokens=kv_tokens,
                        packed_bytes=packed_unit_bytes(source, quantize))


def generation_context(prompt_tokens: int, max_new_tokens: int, block_size: int = 16) -> int:
    """The KV cache one generation needs: its prompt and every token it may add, in whole
    cache blocks (the pool allocates blocks; placement then budgets what is allocated). What
    `llmsplit generate` loads with when --max-context is not given: a 4096-token cache for a
    70-token answer was most of the memory SmolLM2-135M needs (issue 22)."""
    return -(-(prompt_tokens + max_new_tokens) // block_size) * block_size


def placement_mode(device_map):
    mode = device_map if isinstance(device_map, dict) else (device_map or "auto")
    return {"": mode} if isinstance(mode, str) and mode not in MODES else mode


def load(path, device_map="auto", max_memory=None, offload_dir=None, dtype=None, tp: int = 1, pp: int = 1,
         max_batch: int = 4, max_context: int | None = None, block_size: int = 16, compile: bool = False, *,
         quantize: str | None = None, kv_tokens: int | None = None, kv_dtype: str | None = None,
         prefix_caching: bool = True,
         max_num_batched_tokens: int | None = None, tune_threads: bool = False, source=None,
         lora: dict[str, str] | None = None, nodes: Nodes = Nodes(), n_cpu_moe: int = 0) -> LoadedModel:
    """`source`: what `io.weights.open_weights(path)` returned, when the caller opened the
    model already (`llmsplit generate` does, to count the prompt's tokens before sizing).
    `lora`: {name: LoRA run or PEFT adapter folder} adapters served over this base model together
    (`Sequence.adapter` k runs with the k-th; `serve --lora NAME=RUN`), under --tp/--pp too.
    `quantize`: None keeps a GGUF's own int4/int8 packed (other models stay float), "int8" /
    "int4" quantizes the float weights as they load, "none" widens everything to `dtype`.
    `kv_dtype`: None keeps the KV cache in `dtype`; "int8" stores it as int8 with a scale per
    (token, head), about 1/4 of float32's bytes and 1/2 of bfloat16's; "bfloat16" stores it as
    bfloat16 and attention reads it widened to `dtype` (half of float32's bytes).
    `nodes`: the machines a `--tp/--pp` split runs on; this is node 0 (the others run `follow`).
    `n_cpu_moe`: keep the routed experts of the first N MoE layers in CPU memory (infer/cpu_experts.py)."""
    source = source if source is not None else open_weights(path, what="model path")
    cfg = source.config
    quantize, dtype, sizes, num_blocks = _sized(source, dtype, max_batch, max_context, block_size, kv_tokens,
                                                quantize, kv_dtype)
    max_context = sizes.context
    if n_cpu_moe:
        why = ("this model has no experts (model.n_experts=0); drop it" if not cfg.n_experts else
               "it must be a positive count" if n_cpu_moe < 0 else
               "it places experts in one process; drop --tp/--pp" if tp > 1 or pp > 1 or nodes.nnodes > 1 else None)
        if why:
            raise ConfigError(f"--n-cpu-moe {n_cpu_moe} keeps the experts of mixture-of-experts layers in CPU memory, "
                              f"and {why}")
        sizes = replace(sizes, cpu_moe_layers=n_cpu_moe)
    # Read (and checked against the model) here, before any worker starts; each worker reads its own part.
    adapters = [run_adapters(run, f"--lora {name}", cfg) for name, run in (lora or {}).items()]
    if tp > 1 or pp > 1 or nodes.nnodes > 1:
        spec = _split(path, cfg, tp, pp, dtype, num_blocks, block_size, max_context, quantize, nodes,
                      device_map=device_map, max_memory=max_memory, offload_dir=offload_dir, compile=compile,
                      kv_dtype=kv_dtype, lora=lora)
        if nodes.node_rank != 0:
            raise ConfigError(f"--node-rank {nodes.node_rank} runs workers for node 0, which serves; "
                              f"call llmsplit.infer.api.follow there")
        runner = SplitRunner(spec)
        dmap = _split_map(cfg, spec)
        placement = None
    else:
        budgets = detect_budgets(max_memory, offload_dir)
        placement = place(cfg, budgets, placement_mode(device_map), sizes)
        if "disk" in placement.device_map.values() and offload_dir is None:
            raise ConfigError("the device map puts modules on disk; pass --offload-dir (offload_dir=) for them")
        runner = Runner(source, PieceSpec(placement, dtype, num_blocks, block_size, max_context,
                                          offload_dir=offload_dir, compile=compile, quantize=quantize,
                                          tune_threads=tune_threads, kv_dtype=kv_dtype))
        dmap = dict(placement.device_map)
        if lora:
            runner.serve_adapters(list(lora), [a for a, _ in adapters], [scale for _, scale in adapters])
    eos = set(source.eos_ids) | ({source.tokenizer.eos_id} if source.tokenizer.eos_id is not None else set())
    if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch:
        raise ConfigError(f"max_num_batched_tokens {max_num_batched_tokens} is less than max_batch {max_batch}: a "
                          f"full batch of decodes would leave no room for prompts; raise it to at least {max_batch}")
    engine = Engine(runner, source.tokenizer, eos, num_blocks, block_size, max_batch, max_context, prefix_caching,
                    max_num_batched_tokens, one_decode_batch=compile or runner.decodes_in_place)
    if compile:
        _compile_decode_graphs(engine, max_batch)
    return LoadedModel(engine, runner, placement, dmap, cfg, adapters=list(lora or {}))


def follow(path, nodes: Nodes, dtype=None, tp: int = 1, pp: int = 1, max_batch: int = 4,
           max_context: int | None = None, block_size: int = 16, *, quantize: str | None = None,
           kv_tokens: int | None = None, announce=None, **placement) -> None:
    """Node `nodes.node_rank` > 0 of a `--tp/--pp` split over machines: run this node's
    ranks until node 0's `load` (the same arguments) closes the model. The pool and the
    split are sized here exactly as node 0 sizes them; `placement` holds `load`'s other
    arguments (the placement ones checked as `load` checks them; the engine's, such as
    prefix_caching, apply on node 0 only). `announce(text)` hears what this node will do."""
    nodes.check()
    if announce:
        announce(f"node {nodes.node_rank} of {nodes.nnodes} runs its workers for node 0 at "
                 f"{nodes.master_addr}:{nodes.master_port}, which serves")
    source = open_weights(path, what="model path")
    quantize, dtype, sizes, num_blocks = _sized(source, dtype, max_batch, max_context, block_size, kv_tokens,
                                                quantize, placement.get("kv_dtype"))
    keys = ("device_map", "max_memory", "offload_dir", "compile", "kv_dtype", "lora")
    spec = _split(path, source.config, tp, pp, dtype, num_blocks, block_size, sizes.context, quantize, nodes,
                  **{k: placement[k] for k in keys if k in placement})
    for name, run in (placement.get("lora") or {}).items():  # this node's own paths, checked before it starts
        run_adapters(run, f"--lora {name}", source.config)
    del source
    follow_node(spec)


def _sized(source, dtype, max_batch: int, max_context, block_size: int, kv_tokens, quantize,
           kv_dtype: str | None = None):
    """(quantize mode, compute dtype, placement `Sizes`, KV pool blocks) of a load; the pool
    is what placement budgeted for: kv_tokens, or max_batch full contexts."""
    quantize = _quantize_mode(quantize)
    dtype, sizes = run_sizes(source, dtype, max_batch, max_context, block_size, kv_tokens, quantize, kv_dtype)
    num_blocks = -(-kv_tokens // block_size) if kv_tokens else max_batch * -(-sizes.context // block_size)
    return quantize, dtype, sizes, num_blocks


def _split(path, cfg, tp: int, pp: int, dtype, num_blocks: int, block_size: int, max_context: int, quantize,
           nodes: Nodes, device_map="auto", max_memory=None, offload_dir=None, compile: bool = False,
           kv_dtype: str | None = None, lora: dict[str, str] | None = None):
    """The `SplitSpec` of `--tp/--pp` (on `nodes`), refused where it cannot run."""
    if tp * pp == 1:
        raise ConfigError(f"--nnodes {nodes.nnodes} splits the model over machines, which needs --tp or --pp "
                          f"(their product is the workers of all nodes together); add one or drop --nnodes")
    layout = split_layout(cfg, tp, pp, compile)
    if max_memory or offload_dir or device_map not in (None, "auto"):
        raise ConfigError("--tp/--pp place each worker's part on its own device; drop --device-map, "
                          "--max-memory and --offload-dir")
    return split_spec(path, layout, dtype, num_blocks, block_size, max_context, quantize, nodes, kv_dtype, lora)


def _quantize_mode(quantize) -> str:
    from ..quant import MODES

    if quantize is not None and quantize not in MODES:
        raise ConfigError(f"quantize {quantize!r} is not one of: {', '.join(MODES)}")
    if torch.cuda.is_available() and quantize in ("int8", "int4"):
        raise ConfigError(f"--quantize {quantize} runs on the CPU kernels only in this version; drop it on a GPU machine")
    if torch.cuda.is_available():
        return "none"  # a GGUF's packed weights need the CPU kernels
    return quantize


def _compile_decode_graphs(engine: Engine, max_batch: int) -> None:
    """Compile, at load time, the decode graphs the engine reaches (one sequence; a batch in
    the masked form, whose size and positions are dynamic), so that no request waits minutes
    for a compile later (Runner.forward says which steps run compiled; tests/test_infer_split.py
    counts zero compilations over realistic requests after this)."""
    params = SamplingParams(2, ignore_eos=True)  # a prefill, then one decode step (at position 3 or 4)
    for prompts in [[[3, 4, 5]]] + ([[[3, 4, 5], [6, 7, 8, 9]]] if max_batch > 1 else []):
        engine.generate([engine.new_sequence(p, params) for p in prompts])
    engine.prompt_tokens = engine.sampled_tokens = 0  # the server's counters start from real requests


def _split_map(cfg, spec) -> dict[str, str]:
    from .distributed import stage_units

    layout = spec.layout
    tp, pp, dmap = layout.tp, layout.pp, {}
    for stage in range(pp):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        where = ", ".join(f"{spec.device(r)} (rank {r})" for r in ranks)
        dmap.update({u: where for u in stage_units(cfg, layout, stage)})
    return dmap


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def _dtype(dtype, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]
