"""llmsplit: split large language models across many devices, for training and inference."""

__version__ = "0.1.0"


def load(path, device_map="auto", max_memory=None, offload_dir=None, dtype=None, **options):
    """Load a model for generation: a training run folder or checkpoint, a Hugging Face
    Llama-family folder, or a GGUF file, placed over the devices within the budgets.

    device_map: "auto" | "balanced" | "sequential" | a device ("cpu", "cuda:1") | {module: device}.
    max_memory: {"cuda:0": "20GiB", "cpu": "64GiB"} or "cuda:0=20GiB,cpu=64GiB"; what does
    not fit goes to `offload_dir` on disk. options: tp, pp (worker processes), max_batch,
    max_context, block_size (KV cache), compile (torch.compile the decode step). Returns an
    object with generate, logits, tokenizer, device_map; `close()` stops its workers.
    """
    from .infer.api import load as _load

    return _load(path, device_map=device_map, max_memory=max_memory, offload_dir=offload_dir, dtype=dtype, **options)


# The subpackages are imported first so that the names `llmsplit.plan` and `llmsplit.train`
# end up bound to the functions below (importing a subpackage later would not rebind it
# over the function).
from . import plan as _plan_package  # noqa: E402,F401
from . import train as _train_package  # noqa: E402,F401


def plan(model, gpus: int, gpu: str = "H100-80GB", emit_config=None, **options) -> dict:
    """Predict memory per device and step time for the layouts of `model` on `gpus` devices.

    `model`: a preset name, a Hugging Face folder or a training config (.toml). Options:
    nodes, seq_len, global_batch, mode ("train"/"infer"), layout ("zero=3,tp=2"), top,
    precision. `emit_config="OUT.toml"` also writes the best layout `llmsplit train` runs.
    Returns the JSON document `llmsplit plan --json` prints.
    """
    from .plan.api import emit_config as _emit, plan_report

    if str(model).endswith(".toml") and "tokenizer_vocab" not in options:
        # The embedding grows to cover the config's tokenizer, as in training.
        from .config import load_config
        from .io.tokenizer import load_tokenizer

        options["tokenizer_vocab"] = load_tokenizer(load_config(model).data.tokenizer).vocab_size
    if isinstance(gpu, str) and gpu.lower() == "cpu" and "cpu_measured" not in options:
        # The planner is pure; this machine's CPU is measured here (once, then cached).
        from .diagnose.probe import measure_cpu

        options["cpu_measured"] = measure_cpu()
    if emit_config:
        return _emit(model, gpus, gpu, emit_config, **options)[1]
    return plan_report(model, gpus, gpu, **options)


def train(config=None, nproc=None, run_dir=None, resume="none", **options):
    """Train as `config` says (a .toml path, a `Config`, or None: the tiny model on the
    built-in corpus) on `nproc` local worker processes, or as one rank inside torchrun.

    options: overrides (["train.steps=10", ...], like --set), auto (the planner's layout),
    nnodes, node_rank, master_addr, master_port, max_restarts. `resume`: "none", "auto"
    (the newest checkpoint in `run_dir`) or a run folder or checkpoint. Returns a
    `TrainResult`: run_dir, summary (summary.json's content), final_loss, micro_batch (the
    one the run trained with), plan_check, per_rank. Raises `ConfigError` before any worker
    starts when the run cannot work, `TrainingFailed` (with `hint`, and the measured
    `out_of_memory` figures and the planner's `explanation` when it ran out) when a worker fails.
    """
    from .training import train as _train

    return _train(config, nproc, run_dir, resume, **options)
