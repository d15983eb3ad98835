"""`--compile auto` (the default): the decode step compiled once per model shape, dtype, machine
and torch, by a background process, and compiled from its caches at every later load.

A cold compile of the decode graphs takes minutes on a small CPU (Inductor writes and builds
C++ for a few hundred kernels) and nobody passes a flag on a first try; with Inductor's caches
holding every kernel, the same compile takes seconds. So under `auto`:
- a load that finds no artifact for its key runs eager, and starts one background process at
  low priority (`python -m llmsplit.infer.compile_cache`) that loads the model as this load
  does, compiles its decode graphs (`compile="now"`), and saves what Inductor and AOTAutograd
  cached (`torch.compiler.save_cache_artifacts`, PyTorch's portable "mega-cache") into one file;
- a load that finds the file checks it, hands it to torch (`load_cache_artifacts`) and compiles
  at load, from the caches; a server swaps the compiled step in once the build has finished,
  at a moment when no request is running (`LoadedModel.compile_when_ready`).
The key is what the graphs depend on: the model's sizes (not its weights: a fine-tune of the
same model shares them), the compute and KV dtypes, packing, served adapters, whether batches
run (two graphs), llmsplit, torch, Python, and the machine (CPU flags, or the GPU's name).

Safety: the file is written under a temporary name and renamed, so a reader sees it whole or
not at all; its first line says what it was built for and the sha256 of the rest. A truncated,
corrupt, foreign or other-machine file is ignored (and rebuilt), never handed to torch. One
build at a time per key: the builder holds an exclusive lock on `<key>.lock` (released by the
OS if it dies); a load that finds the lock held starts nothing. A killed build leaves no file:
the eager path goes on serving and the next load builds again. A build that fails leaves
`<key>.failed` beside its `.log`: later loads stay eager instead of failing the same way again
(`--compile now` compiles in the foreground, where the error shows).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .. import native

FORMAT = 1  # of the artifact file; a file of another format is ignored


def cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "llmsplit" / "compiled"


def build_key(model_cfg, config, dtype: torch.dtype, packed: str, device: torch.device, pool: tuple[int, int]) -> dict:
    """What the compiled decode graphs depend on (see the module's docstring); `pool`: the KV
    pool's blocks and the context (the graphs take the pools at their fixed sizes)."""
    from importlib.metadata import version

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else hashlib.sha256(" ".join(sorted(native.cpu_flags())).encode()).hexdigest()[:16])
    return {"format": FORMAT, "model": model_cfg.to_dict(), "dtype": str(dtype), "kv_dtype": config.kv_dtype,
            "packed": packed, "quantize": config.quantize, "batched": config.max_batch > 1, "pool": list(pool),
            "block_size": config.block_size, "adapters": len(config.adapters), "llmsplit": version("llmsplit"), "torch": torch.__version__,
            "python": list(sys.version_info[:2]), "device": device.type, "machine": machine}


def _name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def find(key: dict) -> bytes | None:
    """The artifact built for `key`, checked whole; None when there is none that is sound."""
    path = cache_dir() / f"{_name(key)}.pt2cache"
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            payload = f.read()
    except (OSError, ValueError):
        return None
    if header.get("key") != key or header.get("sha256") != hashlib.sha256(payload).hexdigest():
        return None
    return payload


def store(key: dict, payload: bytes) -> Path:
    """Write the artifact for `key` so that a reader sees it whole or not at all."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_name(key)}.pt2cache"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(json.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest()}).encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _lock(key: dict):
    """The build lock of `key`, taken without waiting; None when another process holds it."""
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / f"{_name(key)}.lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def building(key: dict) -> bool:
    lock = _lock(key)
    if lock is None:
        return True
    lock.close()
    return False


def start_build(path, config, key: dict, context: int) -> subprocess.Popen | None:
    """Start the background build for `key` (a load of `path` as `config` says, the same pool)
    unless one runs; its output goes to a log beside the artifacts. None when one was running."""
    folder = cache_dir()
    if building(key) or (folder / f"{_name(key)}.failed").exists():
        return None  # one builds now, or one failed: its .log says why, and --compile now retries here
    fields = {"dtype": str(config.dtype).removeprefix("torch.") if config.dtype is not None else None,
              "max_batch": config.max_batch, "max_context": context, "kv_tokens": config.kv_tokens,
              "block_size": config.block_size, "quantize": config.quantize, "kv_dtype": config.kv_dtype,
              "lora": dict(config.adapters) or None, "device_map": config.device_map,
              "max_memory": config.max_memory}
    log = open(folder / f"{_name(key)}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "llmsplit.infer.compile_cache", str(path), json.dumps(fields),
                             json.dumps(key)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            process_group=0, preexec_fn=_lowest_priority)


def _lowest_priority() -> None:
    """In the build process before it starts: the lowest CPU priority, which every thread and
    process it makes inherits (niceness is per thread on Linux: set later, the threads torch had
    started would keep competing with the serving process's). It stays in the serving process's
    session: the kernel's autogroups share the CPU out per session first, so in a session of its
    own the build took half of a 2-core machine at any niceness and the eager decode, whose
    threads meet at a barrier in every parallel region, ran 20x slower. Its own process group
    keeps a terminal's Ctrl-C to the server from reaching it. Not fewer threads: Inductor writes
    the thread count into the kernels it generates."""
    os.nice(19)


def build(path: str, fields: dict, key: dict) -> int:
    """The background process: compile as a load with these fields would, and store the caches."""
    lock = _lock(key)
    if lock is None:
        return 0  # another process builds it
    from . import api

    try:
        api.load(path, compile="now", **fields).close()
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise RuntimeError("the compile cached nothing to save")
    except BaseException:
        # Marked, so that later loads do not start the same failing build again (and again).
        (cache_dir() / f"{_name(key)}.failed").touch()
        raise
    print(f"llmsplit: stored {store(key, saved[0])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(build(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])))
