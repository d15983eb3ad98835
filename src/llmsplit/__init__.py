"""llmsplit: split large language models across many devices, for training and inference."""

__version__ = "0.1.0"


def load(path, device_map=None, max_memory=None, offload_dir=None, dtype=None):
    """Load a trained model (a run folder or one of its checkpoints) for generation.

    This release loads onto one device; `device_map`, `max_memory` and `offload_dir`
    are accepted for the split-inference engine that follows and must be left unset.
    """
    from .infer.generate import load_run

    if max_memory or offload_dir or device_map not in (None, "auto", "cpu", "cuda", "cuda:0"):
        raise NotImplementedError("splitting a model across devices is not available in this release; "
                                  "call llmsplit.load(path) or llmsplit.load(path, device_map='cpu')")
    device = None if device_map in (None, "auto") else device_map
    m = load_run(path, device=device)
    if dtype is not None:
        m.model.to(dtype)
    return m


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
