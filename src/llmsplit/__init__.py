"""llmsplit: split large language models across many devices, for training and inference."""

__version__ = "0.1.0"

import inspect as _inspect
import types as _types


def load(path, config=None, **fields):
    """Load a model for generation: a training run folder or checkpoint, a Hugging Face
    Llama-family folder, a GGUF file or a PEFT adapter folder, placed over the devices within
    the budgets, as `config` (an `llmsplit.InferConfig`) says, with any of its fields given by
    name on top: `llmsplit.load(path, device_map="auto", max_memory="cpu=8GiB", tp=2)`.

    device_map: "auto" | "balanced" | "sequential" | a device ("cpu", "cuda:1") | {module: device}.
    max_memory: {"cuda:0": "20GiB", "cpu": "64GiB"} or "cuda:0=20GiB,cpu=64GiB"; what does
    not fit goes to `offload_dir` on disk. Also tp, pp (worker processes), max_batch,
    max_context, block_size (KV cache), compile (torch.compile the decode step), quantize,
    kv_dtype, lora, nodes, n_cpu_moe: see `help(llmsplit.InferConfig)`. Returns an object with
    generate, logits, tokenizer, device_map; `close()` stops its workers.
    """
    from .infer.api import load as _load

    return _load(path, config, **fields)


def __getattr__(name: str):
    # InferConfig imports torch (through the packed-weight modes); `import llmsplit` does not.
    if name == "InferConfig":
        from .infer.config import InferConfig

        return InferConfig
    raise AttributeError(f"module 'llmsplit' has no attribute {name!r}")


class _CallablePackage(_types.ModuleType):
    """A package that is also its entry point: `llmsplit.train(...)` calls `api.train`, while
    `llmsplit.train.trainer` stays the package's module (a function bound to the name would
    hide the package). The entry points are imported at the first call or help(), not with
    llmsplit: they import torch."""

    def __call__(self, *args, **kwargs):
        return self._entry_point()(*args, **kwargs)

    @property
    def __doc__(self):  # what help(llmsplit.train) shows: the call first, then the package
        entry = self._entry_point()
        return (f"{self.__name__}{_inspect.signature(entry)}\n\n{_inspect.getdoc(entry)}\n\n"
                f"The package {self.__name__}: {self.__dict__['__doc__']}")

    @property
    def __signature__(self):
        return _inspect.signature(self._entry_point())

    def _entry_point(self):
        from . import api

        return getattr(api, self.__name__.rpartition(".")[2])


# Python lets a module change its class to a ModuleType subclass for exactly this.
from . import plan, train  # noqa: E402

plan.__class__ = train.__class__ = _CallablePackage
