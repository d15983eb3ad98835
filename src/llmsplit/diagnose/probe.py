"""This machine, measured: what the planner needs to know about the local devices.

The planner (`llmsplit.plan`) is a pure model: it takes a `Device` description and never
times anything itself. The `cpu` device is the one that has to be measured (matmul FLOP/s
per core, copy bandwidth, loopback TCP bandwidth for gloo, the resident memory of a process
that has torch loaded and ran one distributed step), because the planner's CPU predictions
are checked against real runs on this same machine. The numbers are measured once per
machine and Python environment and cached in ~/.cache/llmsplit. A GPU is named by torch and
looked up in the planner's catalogue.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..io.procfs import proc_bytes
from ..plan.hardware import GiB, Device, cpu_device, nearest_catalogue_device


def local_device(workers_per_node: int = 1, compile: bool = False) -> Device:
    """The device this machine trains on: the measured `cpu` without CUDA; with CUDA the
    catalogue entry named like torch's device name (e.g. "NVIDIA H100 80GB HBM3" →
    H100-80GB) and closest in memory, or, for a GPU the catalogue does not list, the entry
    closest in memory with this GPU's name and memory."""
    import torch

    if not torch.cuda.is_available():
        return local_cpu(workers_per_node, compile)
    props = torch.cuda.get_device_properties(0)
    return nearest_catalogue_device(props.name, props.total_memory)


def local_cpu(workers_per_node: int = 1, compile: bool = False) -> Device:
    """This machine's CPU as `workers_per_node` gloo workers (see `plan.hardware.cpu_device`);
    `compile`: a run with train.compile, whose workers' extra memory is measured too."""
    return cpu_device(measure_cpu(compile=compile), workers_per_node)


# Part of the cache key: a change in what the probe measures (2: the worker's baseline measured
# in a forked child, as workers are started) makes earlier measurements stale.
PROBE_VERSION = 2


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmsplit"


def _machine_key() -> str:
    import torch

    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    except OSError:
        pass
    text = (f"{platform.node()}|{cpu}|{os.cpu_count()}|{torch.__version__}|{sys.version_info[:2]}|{_environment()}"
            f"|{PROBE_VERSION}")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _environment() -> str:
    """The interpreter's prefix and installed packages: what `import torch` pulls in depends
    on them (torch imports triton when it is installed, ~80 MiB more per worker), so a
    baseline measured in one virtual environment is wrong for another on the same machine."""
    from importlib import metadata

    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
    return f"{sys.prefix}|{','.join(packages)}"


def _cached(path: Path) -> dict | None:
    """The measurements cached at `path`; None where there are none, or a torn or foreign file."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def measure_cpu(refresh: bool = False, compile: bool = False) -> dict:
    """Measured once per machine and Python environment, then read from ~/.cache/llmsplit.
    `compile`: with `compile_extra_bytes` too (what torch.compile adds to a worker), measured
    at the first run that compiles: it takes a compile (seconds), which other runs never pay."""
    path = cache_dir() / f"cpu-{_machine_key()}.json"
    m = None if refresh else _cached(path)
    if m is not None and (not compile or "compile_extra_bytes" in m):
        return m
    if m is None:
        m = {"cores": os.cpu_count() or 1, "mem_total_bytes": _mem_total(),
             "matmul_flops_per_core": {"fp32": _matmul_rate("fp32"), "bf16": _matmul_rate("bf16")},
             "copy_bytes_per_s": _copy_rate(), "loopback_bytes_per_s": _loopback_rate(),
             # 400 MiB: typical for torch 2.x where the probe cannot run
             "baseline_process_bytes": _baseline_process_bytes() or 400 * 2**20,
             "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    if compile:
        compiled = _baseline_process_bytes(compile=True)  # None: no compile here (the run will say why)
        m["compile_extra_bytes"] = max(0, compiled - m["baseline_process_bytes"]) if compiled else 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m, indent=1))
        tmp.replace(path)  # atomic: concurrent planners never read half a file
    except OSError:
        pass
    return m


def _mem_total() -> int:
    return proc_bytes("/proc/meminfo", "MemTotal") or 8 * GiB


def _best_rate(fn, work: float, seconds: float = 0.15) -> float:
    """Best of several timed repeats: the machine is shared, the best run is the truest."""
    fn()  # warm-up (allocations, kernel selection)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return work / best


def _matmul_rate(precision: str) -> float:
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    n = 512
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # per core; workers get cores/workers threads each
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        return _best_rate(lambda: a @ b, 2 * n ** 3)
    finally:
        torch.set_num_threads(old)


def _copy_rate() -> float:
    import torch

    src = torch.ones(16 * 1024 * 1024)  # 64 MiB: well past the caches
    dst = torch.empty_like(src)
    return _best_rate(lambda: dst.copy_(src), 2 * src.numel() * 4)  # read + write


def _loopback_rate() -> float:
    """TCP over 127.0.0.1, the path gloo's collectives take between local workers."""
    size, chunk = 64 * 1024 * 1024, 1024 * 1024
    payload = b"\0" * chunk
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def send():
            with socket.create_connection(server.getsockname()) as c:
                for _ in range(size // chunk):
                    c.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        t0 = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < size:
                data = conn.recv(chunk)
                if not data:
                    break
                got += len(data)
        elapsed = time.perf_counter() - t0
        sender.join()
    return got / elapsed


# Measured as a training worker has it: in a child forked from a process that imported torch
# and the workers' modules (train.api.WORKER_MODULES), as a worker is forked from its server
# (launch/forkserver.py). What the parent's imports touched is shared and counts in the child
# where the child touches it too: a fresh process that imports all of it alone peaks ~90 MiB
# higher than a tiny model's workers then do (380 vs 288 MiB here, torch 2.13 with triton).
_BASELINE_SCRIPT = r"""
import importlib, os, tempfile, torch, torch.distributed as dist
from llmsplit.train.api import WORKER_MODULES
for name in WORKER_MODULES:
    importlib.import_module(name)
torch.set_num_threads(1)
pid = os.fork()
if pid:
    os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
layer = torch.nn.Linear(64, 64)
m = torch.nn.parallel.DistributedDataParallel(torch.compile(layer) if os.environ.get("PROBE_COMPILE") else layer)
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(8, 64)
for _ in range(2):
    torch.nn.functional.cross_entropy(m(x).float(), torch.zeros(8, dtype=torch.long)).backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")), flush=True)
dist.destroy_process_group()
"""


def _baseline_process_bytes(compile: bool = False) -> int | None:
    """Peak resident size of a worker that loaded torch, joined a gloo group and ran a
    tiny DDP step: what every CPU worker pays before its first tensor. `compile`: its layer
    compiled (train.compile compiles each block): Dynamo's and Inductor's modules, the
    compile's own working memory and the compiled code (~100 MiB a worker here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PROBE_COMPILE": "1"} if compile else {})}
    try:
        out = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT], capture_output=True, text=True,
                             timeout=600 if compile else 120, env=env)
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return None  # the probe could not run
