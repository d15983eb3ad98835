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


# The subpackage is imported first so that the name `llmsplit.plan` ends up bound to the
# function below (importing a subpackage later would not rebind it over the function).
from . import plan as _plan_package  # noqa: E402,F401


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
    if emit_config:
        return _emit(model, gpus, gpu, emit_config, **options)[1]
    return plan_report(model, gpus, gpu, **options)
