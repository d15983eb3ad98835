"""`llmsplit.load`: open any supported model, place it, and return the object users call.

This is where the rooms meet: an `InferConfig` (config.py) says how; placement (one process)
or the split over workers (--tp/--pp, runner/split.py) is decided here, once; the engine
(engine/) then drives whichever runner (runner/) results. The server (serve/) reaches the
model only through `load` and `follow`.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import ConfigError
from . import compile_cache
from ..io.weights import open_weights, packed_unit_bytes, run_adapters
from ..parallel.mesh import ParallelDims
from .choices import POOLING, SPECULATIVE
from .config import InferConfig
from .engine import Engine, SamplingParams
from .engine.speculative import SPECULATE_UP_TO, DraftProposals, Speculation
from .runner.kv_cache import kv_element_bytes
from ..plan.placement import MODES, Placement, Sizes, place
from .runner.budgets import detect_budgets
from .runner.runner import PieceSpec, Runner
from .runner.split import SplitRunner, SplitSpec, follow_node, split_layout, stage_units

__all__ = ["InferConfig", "LoadedModel", "follow", "generation_context", "load", "placement_inputs", "run_sizes"]


class LoadedModel:
    """What `llmsplit.load` returns: `generate`, `logits`, `tokenizer`, `device_map`."""

    def __init__(self, engine: Engine, runner, placement: Placement | None, device_map: dict[str, str], config,
                 adapters: list[str] = (), pooling: str = "last", compile_pending: dict | None = None):
        self.engine = engine
        # --compile auto: the key of the background build whose decode graphs replace eager ones when done
        self.compile_pending = compile_pending
        self.pooling = pooling  # what `embed` does by default (InferConfig.pooling)
        self.adapters = list(adapters)  # the LoRA adapters served over the model: adapter k is adapters[k - 1]
        self.runner = runner
        self.placement = placement
        self.device_map = device_map
        self.config = config
        self.tokenizer = engine.tokenizer
        self._finalizer = weakref.finalize(self, runner.close)

    @property
    def decode_mode(self) -> str:
        """How decode steps run now, in words (serve's start line says it)."""
        if self.runner.decode_compiled:
            return "compiled"
        return "eager until the background compile is stored" if self.compile_pending else "eager"

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence forward, no cache: [b, s] -> [b, s, vocab] (float32, on the CPU)."""
        return self.runner.forward(torch.as_tensor(input_ids), None, last_only=False).float().cpu()

    @torch.no_grad()
    def embed(self, prompts: list[list[int]], pooling: str | None = None) -> torch.Tensor:
        """One vector per prompt, [n, dim] float32 of unit length: the final hidden states (after
        the last norm) at the last token, or ("mean") their mean over the prompt, as decoder
        embeddings are pooled (llama.cpp's --pooling last|mean, vLLM's LAST/MEAN); default: the
        load's `pooling`."""
        pooling = pooling or self.pooling
        if pooling not in POOLING:
            raise ConfigError(f"pooling {pooling!r} is not one of: {', '.join(POOLING)}")
        if not hasattr(self.runner, "hidden"):
            raise ConfigError("embeddings need the model in one process; load it without --tp/--pp")
        vectors = []
        for ids in prompts:  # one at a time: no padding to mask, and a batch of long inputs never piles up
            h = self.runner.hidden(torch.tensor([ids]))[0].float()
            vectors.append(torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0).cpu())
        return torch.stack(vectors)

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

    def compile_when_ready(self, artifact: bytes | None = None) -> bool:
        """Under --compile auto, once the background build has stored its artifact and no request
        runs: compile the decode step from it (seconds) and decode compiled from then on.
        Returns whether it did (the server calls it on its engine thread, between steps, with
        the artifact its watcher has read: `compile_cache.find`'s, else read here)."""
        if self.compile_pending is None or self.engine.busy:
            return False
        artifact = artifact or compile_cache.find(self.compile_pending)
        if artifact is None:
            return False
        torch.compiler.load_cache_artifacts(artifact)
        self.runner.compile_decode()
        self.engine.scheduler.one_decode_batch = _decodes_as_one_batch(self.runner)
        _compile_decode_graphs(self.engine, self.engine.max_batch)
        self.compile_pending = None
        return True

    def close(self) -> None:
        """Stop the worker processes (tp/pp) and the prefetch thread; also done at exit."""
        self._finalizer()


def run_sizes(source, config: InferConfig):
    """(compute dtype, placement `Sizes`) of loading `source` as `config` says: what `load`
    places with, and what the out-of-memory explainer (`diagnose/oom.py`) explains with. The KV
    pool all sequences share is `kv_tokens` (default max_batch full contexts); blocks are taken
    as tokens arrive and the engine preempts when it runs out, so a pool smaller than
    max_batch × max_context serves max_batch sequences as long as they are shorter on
    average. Packed units count their packed bytes (`quantize`); the KV pool its elements'
    bytes (`kv_dtype` "int8": 1 byte and a share of the scales, `kv_cache.kv_element_bytes`)."""
    from ..models.rope import dynamic_rope_limit

    # Dynamic NTK rope exists to run past max_position_embeddings; any other model stops there.
    dynamic = dynamic_rope_limit(source.config.rope_scaling) is not None
    max_context = config.max_context or 4096
    max_context = max_context if dynamic else min(max_context, source.config.max_seq_len)
    if max_context < 2:
        raise ConfigError(f"max_context {max_context} must be at least 2 (this model holds "
                          f"{source.config.max_seq_len} tokens)")
    if config.kv_tokens is not None and config.kv_tokens < max_context:
        raise ConfigError(f"kv_tokens {config.kv_tokens} holds less than one sequence of max_context {max_context} "
                          f"tokens; raise --kv-tokens or lower --max-context")
    dtype = _dtype(config.dtype, source.dtype if torch.cuda.is_available() else torch.float32)
    kv_bytes = kv_element_bytes(dtype.itemsize, source.config.head_dim, config.kv_dtype)
    return dtype, Sizes(batch=config.max_batch, context=max_context, dtype_bytes=dtype.itemsize,
                        kv_dtype_bytes=kv_bytes, kv_tokens=config.kv_tokens,
                        packed_bytes=packed_unit_bytes(source, _quantize_mode(config.quantize)),
                        cpu_moe_layers=config.n_cpu_moe)


def placement_inputs(source, config: InferConfig) -> tuple[Sizes, dict, object]:
    """(sizes, budgets, mode) that placement is given for `source` under `config`: the public
    account of a load's memory that the out-of-memory explainer reads (diagnose/oom.py)."""
    _, sizes = run_sizes(source, config)
    return sizes, detect_budgets(config.max_memory, config.offload_dir), placement_mode(config.device_map)


def generation_context(prompt_tokens: int, max_new_tokens: int, block_size: int = 16) -> int:
    """The KV cache one generation needs: its prompt and every token it may add, in whole
    cache blocks (the pool allocates blocks; placement then budgets what is allocated). What
    `llmsplit generate` loads with when --max-context is not given: a 4096-token cache for a
    70-token answer was most of the memory SmolLM2-135M needs (issue 22)."""
    return -(-(prompt_tokens + max_new_tokens) // block_size) * block_size


def placement_mode(device_map):
    mode = device_map if isinstance(device_map, dict) else (device_map or "auto")
    return {"": mode} if isinstance(mode, str) and mode not in MODES else mode


def load(path, config: InferConfig | None = None, *, source=None, **fields) -> LoadedModel:
    """Load `path` (a training run folder or checkpoint, a Hugging Face folder, a GGUF file or
    a PEFT adapter folder) as `config` says, with `fields` (InferConfig's) on top; see
    `InferConfig` for each. `source`: what `io.weights.open_weights(path)` returned, when the
    caller opened the model already (`llmsplit generate` does, to count the prompt's tokens
    before sizing). Sequences run with the k-th served adapter of `lora` when `Sequence.adapter`
    is k. With `nodes` of several machines this is node 0 (the others run `follow`)."""
    config = InferConfig.of(config, **fields)
    source = source if source is not None else open_weights(path, what="model path")
    cfg = source.config
    if config.n_cpu_moe and not cfg.n_experts:
        raise ConfigError(f"--n-cpu-moe {config.n_cpu_moe} keeps the experts of mixture-of-experts layers in CPU "
                          f"memory, and this model has no experts (model.n_experts=0); drop it")
    dtype, sizes, num_blocks = _sized(source, config)
    # Read (and checked against the model) here, before any worker starts; each worker reads its own part.
    adapters = [run_adapters(run, f"--lora {name}", cfg) for name, run in config.adapters]
    if config.split:
        spec = _split_spec(path, source, config, dtype, num_blocks, sizes.context)
        if config.nodes.node_rank != 0:
            raise ConfigError(f"--node-rank {config.nodes.node_rank} runs workers for node 0, which serves; "
                              f"call llmsplit.infer.api.follow there")
        runner, placement, dmap = SplitRunner(spec), None, _split_map(cfg, spec)
        compile_now, pending = False, None  # (--compile now is refused under a split: layout.rules)
    else:
        placement = place(cfg, detect_budgets(config.max_memory, config.offload_dir),
                          placement_mode(config.device_map), sizes)
        if "disk" in placement.device_map.values() and config.offload_dir is None:
            raise ConfigError("the device map puts modules on disk; pass --offload-dir (offload_dir=) for them")
        compile_now, pending = _compile_choice(path, source, config, placement, dtype, (num_blocks, sizes.context))
        runner = Runner(source, PieceSpec(placement, dtype, num_blocks, config.block_size, sizes.context,
                                          offload_dir=config.offload_dir, compile=compile_now,
                                          quantize=_quantize_mode(config.quantize), tune_threads=config.tune_threads,
                                          kv_dtype=config.kv_dtype))
        dmap = dict(placement.device_map)
        if adapters:
            runner.serve_adapters([n for n, _ in config.adapters], [a for a, _ in adapters], [s for _, s in adapters])
    eos = set(source.eos_ids) | ({source.tokenizer.eos_id} if source.tokenizer.eos_id is not None else set())
    engine = Engine(runner, source.tokenizer, eos, num_blocks, config.block_size, config.max_batch, sizes.context,
                    config.prefix_caching, config.max_num_batched_tokens,
                    one_decode_batch=_decodes_as_one_batch(runner),
                    speculation=_speculation(config, source, sizes.context))
    if compile_now:
        _compile_decode_graphs(engine, config.max_batch)
    if pending is not None:  # started once this load is done (its native kernels built: the build reuses them)
        compile_cache.start_build(path, config, pending, sizes.context)
    return LoadedModel(engine, runner, placement, dmap, cfg, adapters=[n for n, _ in config.adapters],
                       pooling=config.pooling, compile_pending=pending)


def follow(path, config: InferConfig | None = None, *, announce=None, **fields) -> None:
    """Node `nodes.node_rank` > 0 of a `--tp/--pp` split over machines: run this node's
    ranks until node 0's `load` (the same config) closes the model. The pool and the split
    are sized here exactly as node 0 sizes them (the engine's options, such as
    prefix_caching, apply on node 0 only). `announce(text)` hears what this node will do."""
    config = InferConfig.of(config, **fields)
    nodes = config.nodes
    nodes.check()
    if announce:
        announce(f"node {nodes.node_rank} of {nodes.nnodes} runs its workers for node 0 at "
                 f"{nodes.master_addr}:{nodes.master_port}, which serves")
    source = open_weights(path, what="model path")
    dtype, sizes, num_blocks = _sized(source, config)
    spec = _split_spec(path, source, config, dtype, num_blocks, sizes.context)
    for name, run in config.adapters:  # this node's own paths, checked before it starts
        run_adapters(run, f"--lora {name}", source.config)
    del source
    follow_node(spec)


def _speculation(config: InferConfig, source, max_context: int) -> Speculation | None:
    """What the engine speculates with: prompt lookup, or a draft model loaded here, whole in
    this process (beside a model split over workers too), with a KV pool for the sequences
    that speculate at once, and refused unless its tokenizer is the model's."""
    if config.speculative is None:
        return None
    if config.speculative in SPECULATIVE:
        return Speculation(config.speculative, config.speculative_tokens)
    path = str(config.speculative)
    draft_source = open_weights(path, what="--speculative")
    mine, theirs = source.tokenizer, draft_source.tokenizer
    if mine.vocab_fingerprint != theirs.vocab_fingerprint:
        raise ConfigError(f"--speculative {path!r} has another tokenizer ({theirs.name}, {theirs.vocab_size} tokens) "
                          f"than the model ({mine.name}, {mine.vocab_size} tokens); a draft model must share the "
                          f"model's tokenizer: pick a draft of the same family or distil one (train.teacher)")
    draft = load(path, InferConfig(max_batch=SPECULATE_UP_TO, max_context=max_context, dtype=config.dtype,
                                   kv_dtype=config.kv_dtype, compile="off"), source=draft_source)
    return Speculation(f"draft {path}", config.speculative_tokens, draft=DraftProposals(draft))


def _sized(source, config: InferConfig):
    """(compute dtype, placement `Sizes`, KV pool blocks) of a load; the pool is what placement
    budgeted for: kv_tokens, or max_batch full contexts."""
    dtype, sizes = run_sizes(source, config)
    bs = config.block_size
    num_blocks = -(-config.kv_tokens // bs) if config.kv_tokens else config.max_batch * -(-sizes.context // bs)
    return dtype, sizes, num_blocks


def _split_spec(path, source, config: InferConfig, dtype, num_blocks: int, max_context: int) -> SplitSpec:
    """The `SplitSpec` of `--tp/--pp` (on `nodes`), refused by the layout rules (the planner's
    and training's) before any worker starts."""
    quantize = _quantize_mode(config.quantize)
    layout = split_layout(source.config, config.tp, config.pp, config.compile == "now", _packing(source, quantize))
    return SplitSpec(str(path), config, layout, dtype, num_blocks, max_context, quantize)


def _packing(source, quantize: str | None) -> str:
    """How the layout rules judge this load's weights: "int4" where any stays packed as int4 (a
    GGUF's own 4-bit blocks are kept unless everything is widened), else --quantize's mode."""
    from ..models.weight_shapes import parameter_shapes

    if quantize != "none" and hasattr(source, "packed_kind"):
        if any(source.packed_kind(name) == "int4" for name, _ in parameter_shapes(source.config)):
            return "int4"
    return quantize or "none"


def _quantize_mode(quantize) -> str | None:
    """What the weights are read as on this machine: a GPU widens a GGUF's packed weights (they
    need the CPU kernels) and refuses quantizing at load."""
    if torch.cuda.is_available() and quantize in ("int8", "int4"):
        raise ConfigError(f"--quantize {quantize} runs on the CPU kernels only in this version; drop it on a GPU machine")
    return "none" if torch.cuda.is_available() else quantize


def _compile_choice(path, source, config: InferConfig, placement: Placement, dtype, pool: tuple[int, int]):
    """(compile the decode step at this load?, the key of the background build to swap in when
    it is done). Under "auto" (compile_cache.py) a model whose every unit runs on one device
    compiles from a sound cached artifact, or runs eager while a build starts; one spread over
    devices or offloaded runs eager (compiling needs every layer resident)."""
    if config.compile != "auto" or path is None:  # (weights in memory: no process could load them again)
        return config.compile == "now", None
    devices = set(placement.device_map.values())
    if devices != {placement.exec_device}:
        return False, None
    key = compile_cache.build_key(source.config, config, dtype, _packing(source, _quantize_mode(config.quantize)),
                                  torch.device(placement.exec_device), pool)
    artifact = compile_cache.find(key)
    if artifact is not None:
        torch.compiler.load_cache_artifacts(artifact)
        return True, None
    return False, key


def _decodes_as_one_batch(runner) -> bool:
    """Whether the step's decodes run as one batch (and proposals as rows of it): what a compiled
    decode graph and the paged decode kernel take (scheduler.Scheduler.one_decode_batch)."""
    return runner.decode_compiled or runner.decodes_in_place


def _compile_decode_graphs(engine: Engine, max_batch: int) -> None:
    """Compile, at load time, the decode graphs the engine reaches (one sequence; a batch in
    the masked form, whose size and positions are dynamic), so that no request waits minutes
    for a compile later (Runner.forward says which steps run compiled; tests/test_infer_split.py
    counts zero compilations over realistic requests after this)."""
    params = SamplingParams(2, ignore_eos=True)  # a prefill, then one decode step (at position 3 or 4)
    for prompts in [[[3, 4, 5]]] + ([[[3, 4, 5], [6, 7, 8, 9]]] if max_batch > 1 else []):
        engine.generate([engine.new_sequence(p, params) for p in prompts])
    engine.scheduler.prompt_tokens = engine.sampled_tokens = 0  # the server's counters start from real requests


def _split_map(cfg, spec: SplitSpec) -> dict[str, str]:
    """Each module's devices and ranks: a stage's units live on the ranks of its place on the mesh."""
    dims, dmap = ParallelDims.from_layout(spec.layout), {}
    for stage in range(spec.layout.pp):
        where = ", ".join(f"{spec.device(r)} (rank {r})" for r in dims.ranks(pp=stage))
        dmap.update({u: where for u in stage_units(cfg, spec.layout, stage)})
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
