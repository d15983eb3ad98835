"""`InferConfig`: everything `llmsplit.load`, `generate`, `serve`, `follow` and the split workers
take, in one dataclass validated once when it is made (as the training config is by
`config.validate`). The command line maps its flags onto these fields (cli.py); the split
workers receive it whole. What needs the model itself (its context length, whether it has
experts) is checked where the model is opened (api.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from ..errors import ConfigError
from ..launch import Nodes
from ..quant import MODES as QUANTIZE  # --quantize; None keeps a GGUF's own packing

# (the flags' values: choices.py, which the command line's parsers import without torch)
from .choices import COMPILE, KV_DTYPES, MAX_SPECULATIVE_TOKENS, POOLING, SPECULATIVE, TOOL_CALL_PARSERS


@dataclass(frozen=True)
class InferConfig:
    """How to load and run a model for generation.

    device_map: "auto" | "balanced" | "sequential" | a device ("cpu", "cuda:1") | {module: device}.
    max_memory: {"cuda:0": "20GiB", "cpu": "64GiB"} or "cuda:0=20GiB,cpu=64GiB"; what does not
    fit goes to `offload_dir` on disk. dtype: the compute dtype (default float32 on CPU, the
    model's on GPU). tp, pp: worker processes (tensor / pipeline parallel), on `nodes`.
    max_batch: sequences at once; max_context: tokens a sequence holds (default the model's,
    up to 4096); block_size: tokens a KV block; kv_tokens: the KV pool all sequences share
    (default max_batch full contexts). compile: "now" compiles the decode step at load, "auto"
    (the default, or $LLMSPLIT_COMPILE) once per model shape and machine in the background and
    then at every load from the caches (compile_cache.py), "off" never; True/False mean
    "now"/"off". quantize: None keeps a GGUF's own int4/int8 packed (other models stay float), "int8"/"int4" quantize the
    float weights as they load, "none" widens everything. kv_dtype: None keeps the KV cache in
    the compute dtype, "int8" stores int8 with a scale per (token, head), "bfloat16" half of
    float32's bytes. prefix_caching: share the KV blocks of common prompt starts.
    max_num_batched_tokens: tokens one step computes at most. tune_threads: pick the CPU thread
    count as it decodes. lora: {name: LoRA run or PEFT folder} served over the model.
    n_cpu_moe: keep the routed experts of the first N MoE layers in CPU memory.
    speculative: "ngram" proposes speculative_tokens tokens a step by prompt lookup, a path
    (anything `load` opens, with the same tokenizer) by that draft model's greedy continuation;
    the model verifies them in one forward (engine/speculative.py; output unchanged); None: off. pooling: "last"
    or "mean", how embeddings (`LoadedModel.embed`) pool the final hidden states.
    tool_call_parser: how `serve` reads tool calls (tool_choice "auto") out of replies, one of
    TOOL_CALL_PARSERS ("auto": picked from the chat template)."""
    device_map: str | dict = "auto"
    max_memory: str | dict | None = None
    offload_dir: str | None = None
    dtype: object = None  # a torch.dtype or its name ("float32", "bf16", ...)
    tp: int = 1
    pp: int = 1
    max_batch: int = 4
    max_context: int | None = None
    block_size: int = 16
    compile: bool | str | None = None  # "auto" | "now" | "off" (True: "now", False: "off"; None: $LLMSPLIT_COMPILE or auto)
    quantize: str | None = None
    kv_tokens: int | None = None
    kv_dtype: str | None = None
    prefix_caching: bool = True
    max_num_batched_tokens: int | None = None
    tune_threads: bool = False
    lora: dict | None = None
    nodes: Nodes = field(default_factory=Nodes)
    n_cpu_moe: int = 0
    speculative: str | None = None
    speculative_tokens: int = 4
    pooling: str = "last"
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        self._settle_compile()
        self._check_sizes()
        self._check_speculative()
        self._check_split()
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ConfigError(f"quantize {self.quantize!r} is not one of: {', '.join(QUANTIZE)}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {self.kv_dtype!r} is not one of: {', '.join(KV_DTYPES)} "
                              f"(default: the compute dtype)")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r} is not one of: "
                              f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.n_cpu_moe < 0:
            raise ConfigError(f"--n-cpu-moe {self.n_cpu_moe} keeps the experts of mixture-of-experts layers in "
                              f"CPU memory, and it must be a positive count")

    def _settle_compile(self) -> None:
        """compile as one of COMPILE: a bool is "now" or "off"; unset, $LLMSPLIT_COMPILE or "auto"."""
        value = self.compile
        if value is None:
            value = os.environ.get("LLMSPLIT_COMPILE") or "auto"
            if value not in COMPILE:
                raise ConfigError(f"LLMSPLIT_COMPILE={value!r} is not one of: {', '.join(COMPILE)}")
        elif isinstance(value, bool):
            value = "now" if value else "off"
        elif value not in COMPILE:
            raise ConfigError(f"--compile {value!r} is not one of: {', '.join(COMPILE)}")
        object.__setattr__(self, "compile", value)

    def _check_sizes(self) -> None:
        if self.max_batch < 1 or self.block_size < 1 or (self.max_context is not None and self.max_context < 2):
            raise ConfigError(f"max_batch {self.max_batch}, max_context {self.max_context} and block_size "
                              f"{self.block_size} must be positive (max_context at least 2)")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_batch:
            raise ConfigError(f"max_num_batched_tokens {self.max_num_batched_tokens} is less than max_batch "
                              f"{self.max_batch}: a full batch of decodes would leave no room for prompts; raise it "
                              f"to at least {self.max_batch}")

    def _check_split(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ConfigError(f"--tp {self.tp} and --pp {self.pp} count worker processes; give each at least 1")
        if self.nodes.nnodes > 1 and self.tp * self.pp == 1:
            raise ConfigError(f"--nnodes {self.nodes.nnodes} splits the model over machines, which needs --tp or "
                              f"--pp (their product is the workers of all nodes together); add one or drop --nnodes")
        if not self.split:
            return
        if self.n_cpu_moe:
            raise ConfigError(f"--n-cpu-moe {self.n_cpu_moe} keeps the experts of mixture-of-experts layers in CPU "
                              f"memory, and it places experts in one process; drop --tp/--pp")
        if self.max_memory or self.offload_dir or self.device_map not in (None, "auto"):
            raise ConfigError("--tp/--pp place each worker's part on its own device; drop --device-map, "
                              "--max-memory and --offload-dir")
        self.nodes.check()
        world = self.tp * self.pp
        if self.nodes.nnodes > 1 and world % self.nodes.nnodes:
            raise ConfigError(f"--nnodes {self.nodes.nnodes} must divide the {world} workers of --tp {self.tp} "
                              f"--pp {self.pp} (each node runs as many); change --nnodes, --tp or --pp")

    def _check_speculative(self) -> None:
        if self.speculative is not None and not str(self.speculative).strip():
            raise ConfigError(f"--speculative is empty; pass {' or '.join(SPECULATIVE)} or a draft model's path")
        if self.pooling not in POOLING:
            raise ConfigError(f"--pooling {self.pooling!r} is not one of: {', '.join(POOLING)}")
        if not 1 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"--speculative-tokens {self.speculative_tokens} must be in [1, "
                              f"{MAX_SPECULATIVE_TOKENS}]: the tokens proposed a step")

    @property
    def split(self) -> bool:
        """Whether the model runs over worker processes (--tp/--pp, on one machine or several)."""
        return self.tp > 1 or self.pp > 1 or self.nodes.nnodes > 1

    @property
    def adapters(self) -> tuple[tuple[str, str], ...]:
        """(name, LoRA run or PEFT folder) of every served adapter, in order."""
        return tuple((name, str(run)) for name, run in (self.lora or {}).items())

    @staticmethod
    def of(config: InferConfig | None = None, **overrides) -> InferConfig:
        """`config` (default: every default) with `overrides`, refusing a name that is no field."""
        if config is not None and not isinstance(config, InferConfig):
            raise ConfigError(f"config must be an llmsplit.InferConfig, not {type(config).__name__}; pass other "
                              f"options by name (device_map=..., max_memory=...)")
        known = {f.name for f in fields(InferConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"{', '.join(unknown)} is not an option of llmsplit.load; the options are the fields "
                              f"of llmsplit.InferConfig: {', '.join(sorted(known))}")
        return replace(config, **overrides) if config is not None else InferConfig(**overrides)
