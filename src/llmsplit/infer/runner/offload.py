"""Weights that live off the execution device: in CPU memory (when the model runs on a GPU)
or on disk as one memory-mapped safetensors file per unit under the offload folder.

An offloaded module keeps meta-device placeholders; a forward pre-hook installs its real
weights on the execution device just before it runs and a post-hook drops them after. A
background thread loads the next offloaded module (disk read, and on CUDA the host-to-device
copy on a side stream) while the current one computes, so the transfer hides behind compute.
Modules that fit on their device get no hooks at all.

The files on disk are a copy of the weights for this load only (a later load writes its
own), so `close` removes them, and the offload folder too when this load created it; a
load that fails half-way removes them when its Offloader is collected.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn


class Offloader:
    def __init__(self, exec_device: torch.device, offload_dir: str | Path | None):
        self.exec_device = torch.device(exec_device)
        self.dir = Path(offload_dir) if offload_dir is not None else None
        self._order: list[str] = []  # offloaded modules in the order they run
        self._modules: dict[str, nn.Module] = {}
        self._host: dict[str, dict[str, torch.Tensor]] = {}  # "cpu" tier
        self._files: dict[str, object] = {}  # "disk" tier: open safe_open handles
        self._pending: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmsplit-prefetch")
        self._stream = torch.cuda.Stream(self.exec_device) if self.exec_device.type == "cuda" else None
        self._written: list[Path] = []  # files, then the folders this Offloader created (deepest first)
        self._remove_written = weakref.finalize(self, _remove, self._written)

    def add(self, name: str, module: nn.Module, tensors: dict[str, torch.Tensor], tier: str) -> None:
        """Take over `module` (whose parameters are on the meta device): its weights `tensors`
        (relative names) go to CPU memory or to a safetensors file on disk."""
        if tier == "disk":
            from safetensors import safe_open
            from safetensors.torch import save_file

            assert self.dir is not None
            if not self.dir.is_dir():
                made = [p for p in (self.dir, *self.dir.parents) if not p.exists()]
                self.dir.mkdir(parents=True, exist_ok=True)
                self._written.extend(made)  # deepest first, after the files that go in them (below)
            path = self.dir / f"{name}.safetensors"
            self._written.insert(0, path)
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
            self._files[name] = safe_open(str(path), framework="pt")  # memory-mapped
        else:
            pin = self._stream is not None
            self._host[name] = {k: (v.pin_memory() if pin else v) for k, v in tensors.items()}
        self._order.append(name)
        self._modules[name] = module
        module.register_forward_pre_hook(lambda m, args, n=name: self._install(n))
        module.register_forward_hook(lambda m, args, out, n=name: self._release(n))

    def _load(self, name: str) -> tuple[dict[str, torch.Tensor], object]:
        if name in self._files:
            f = self._files[name]
            host = {k: f.get_tensor(k) for k in f.keys()}
        else:
            host = self._host[name]
        if self._stream is None:
            return host, None
        with torch.cuda.stream(self._stream):
            dev = {k: v.to(self.exec_device, non_blocking=True) for k, v in host.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        return dev, event

    def _install(self, name: str) -> None:
        future = self._pending.pop(name, None)
        tensors, event = future.result() if future is not None else self._load(name)
        if event is not None:
            torch.cuda.current_stream(self.exec_device).wait_event(event)
        module = self._modules[name]
        for key, t in tensors.items():
            set_parameter(module, key, t)
        nxt = self._order[(self._order.index(name) + 1) % len(self._order)]
        if nxt != name and nxt not in self._pending:
            self._pending[nxt] = self._pool.submit(self._load, nxt)

    def _release(self, name: str) -> None:
        module = self._modules[name]
        for key, p in list(module.named_parameters()):
            set_parameter(module, key, torch.empty(p.shape, dtype=p.dtype, device="meta"))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._files.clear()  # the memory maps of the files removed next
        self._remove_written()


def _remove(paths: list[Path]) -> None:
    """Remove files, then folders that are empty by then (a folder the user put something in stays)."""
    for path in paths:
        try:
            path.rmdir() if path.is_dir() else path.unlink()
        except OSError:
            pass


def set_parameter(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` (not a copy) the frozen parameter `name` ("attention.wq.weight") of `module`."""
    owner, _, attr = name.rpartition(".")
    target = module.get_submodule(owner) if owner else module
    target._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
