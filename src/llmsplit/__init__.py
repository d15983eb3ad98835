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
