"""The devices the planner knows: datasheet numbers for GPUs, measured numbers for `cpu`.

GPU figures are dense (no 2:4 sparsity) vendor peaks; the cost model applies its own
efficiency on top. Link figures are per GPU and per direction, which is what a ring
collective's bandwidth term uses. The `cpu` device is measured on this machine (matmul
FLOP/s per core, copy bandwidth, loopback TCP bandwidth for gloo, and the resident memory
of a process that has torch loaded and ran one distributed step) and cached, because the
planner's CPU predictions are checked against real runs on this same machine.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..config import ConfigError

GiB = 1024 ** 3
GB = 1e9
T = 1e12


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int            # what one worker may use
    peak_flops: dict             # dense FLOP/s by precision ("fp32", "bf16", "fp16")
    mem_bw: float                # bytes/s, device memory
    intra_bw: float              # bytes/s per device per direction inside a node
    inter_bw: float              # bytes/s per device per direction between nodes
    host_bw: float               # bytes/s device <-> host (offload)
    gpus_per_node: int
    host_memory_bytes: int       # RAM of one node (offload targets, CPU workers share it)
    runtime_bytes: int           # CUDA context + NCCL buffers, or the CPU process baseline
    alloc_slack: float           # fraction lost to allocator fragmentation
    matmul_efficiency: float     # fraction of peak large matmuls reach
    kind: str = "gpu"
    measured: dict | None = None
    node_size: int = 8           # devices a full node of this kind has (gpus_per_node may be fewer)

    def flops(self, precision: str) -> float:
        return self.peak_flops[precision]

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _gpu(name, mem_gib, fp32, bf16, mem_bw, intra, inter, host_mem_gib, gpus_per_node=8, host_bw=25 * GB,
         fp16=None, efficiency=0.7):
    # Runtime: the CUDA context (about 0.5 GiB with lazy module loading) plus NCCL's
    # channel buffers (a few hundred MiB per communicator); neither shows in
    # torch.cuda.max_memory_allocated, both take device memory.
    return Device(name=name, memory_bytes=int(mem_gib * GiB), peak_flops={"fp32": fp32, "bf16": bf16,
                  "fp16": fp16 or bf16}, mem_bw=mem_bw, intra_bw=intra, inter_bw=inter, host_bw=host_bw,
                  gpus_per_node=gpus_per_node, host_memory_bytes=int(host_mem_gib * GiB),
                  runtime_bytes=int(1.0 * GiB), alloc_slack=0.05, matmul_efficiency=efficiency,
                  node_size=gpus_per_node)


# fp32 is the TF32-less IEEE rate: training in fp32 here means true fp32 matmuls. Memory
# is the usable size torch reports (a little under the marketing number).
CATALOGUE: dict[str, Device] = {d.name: d for d in (
    _gpu("A100-40GB", 39.4, 19.5 * T, 312 * T, 1.555e12, 300 * GB, 25 * GB, 1024),
    _gpu("A100-80GB", 79.2, 19.5 * T, 312 * T, 2.039e12, 300 * GB, 25 * GB, 2048),
    _gpu("H100-80GB", 79.1, 67 * T, 989 * T, 3.35e12, 450 * GB, 50 * GB, 2048, host_bw=55 * GB),
    _gpu("H200-141GB", 139.8, 67 * T, 989 * T, 4.8e12, 450 * GB, 50 * GB, 2048, host_bw=55 * GB),
    # PCIe cards: no NVLink, collectives go through PCIe 4.0 x16 (about 25 GB/s achieved).
    _gpu("L40S-48GB", 44.5, 91.6 * T, 362 * T, 0.864e12, 25 * GB, 12.5 * GB, 512),
    _gpu("RTX4090-24GB", 23.6, 82.6 * T, 165 * T, 1.008e12, 25 * GB, 12.5 * GB, 128),
    # Infinity Fabric: 7 links of 64 GB/s per direction to the other 7 GPUs.
    _gpu("MI300X-192GB", 191.5, 163.4 * T, 1307 * T, 5.3e12, 448 * GB, 50 * GB, 2048, host_bw=55 * GB),
)}


def known_devices() -> list[str]:
    return [*CATALOGUE, "cpu"]


def get_device(name: str | Device, workers_per_node: int = 1) -> Device:
    """A catalogue entry, or the measured CPU with its memory shared by the local workers
    (a Device is taken as it is: `local_device` builds one for an unlisted GPU)."""
    if isinstance(name, Device):
        return name
    if name.lower() == "cpu":
        return cpu_device(workers_per_node)
    for key, dev in CATALOGUE.items():
        if key.lower() == name.lower():
            return dev
    raise ConfigError(f"--gpu {name!r} is not a known device; known: {', '.join(known_devices())}")


def local_device(workers_per_node: int = 1) -> Device:
    """The device this machine trains on: `cpu` without CUDA; with CUDA the catalogue entry
    named like torch's device name (e.g. "NVIDIA H100 80GB HBM3" → H100-80GB) and closest in
    memory, or, for a GPU the catalogue does not list, the entry closest in memory with
    this GPU's name and measured memory."""
    import torch

    if not torch.cuda.is_available():
        return cpu_device(workers_per_node)
    props = torch.cuda.get_device_properties(0)
    total, label = props.total_memory, props.name.upper().replace(" ", "")

    def distance(dev: Device) -> float:
        return abs(dev.memory_bytes - total)

    named = [d for d in CATALOGUE.values() if d.name.split("-")[0].upper() in label]
    if named:
        return min(named, key=distance)
    nearest = min(CATALOGUE.values(), key=distance)
    return replace(nearest, name=props.name, memory_bytes=total)


# ---------------------------------------------------------------- the measured CPU

def cpu_device(workers_per_node: int = 1) -> Device:
    """This machine as `workers_per_node` gloo workers, each with cores/workers threads
    (the share llmsplit's launcher gives them) and 1/workers of the RAM."""
    m = measure_cpu()
    workers = max(1, workers_per_node)
    threads = max(1, m["cores"] // workers)
    per_core = m["matmul_flops_per_core"]
    return Device(
        name="cpu", memory_bytes=m["mem_total_bytes"] // workers,
        peak_flops={"fp32": per_core["fp32"] * threads, "bf16": per_core["bf16"] * threads,
                    "fp16": per_core["bf16"] * threads},
        mem_bw=m["copy_bytes_per_s"], intra_bw=m["loopback_bytes_per_s"], inter_bw=m["loopback_bytes_per_s"],
        host_bw=m["copy_bytes_per_s"], gpus_per_node=workers, host_memory_bytes=m["mem_total_bytes"],
        runtime_bytes=m["baseline_process_bytes"],
        # The measured matmul rate is already what is achieved, not a datasheet peak.
        alloc_slack=0.0, matmul_efficiency=1.0, kind="cpu", measured=m, node_size=workers)


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
    text = f"{platform.node()}|{cpu}|{os.cpu_count()}|{torch.__version__}|{sys.version_info[:2]}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure_cpu(refresh: bool = False) -> dict:
    """Measured once per machine and torch version, then read from ~/.cache/llmsplit."""
    path = cache_dir() / f"cpu-{_machine_key()}.json"
    if not refresh and path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # a torn or foreign file: measure again
    m = {"cores": os.cpu_count() or 1, "mem_total_bytes": _mem_total(),
         "matmul_flops_per_core": {"fp32": _matmul_rate("fp32"), "bf16": _matmul_rate("bf16")},
         "copy_bytes_per_s": _copy_rate(), "loopback_bytes_per_s": _loopback_rate(),
         "baseline_process_bytes": _baseline_process_bytes(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m, indent=1))
        tmp.replace(path)  # atomic: concurrent planners never read half a file
    except OSError:
        pass
    return m


def _mem_total() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GiB


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


_BASELINE_SCRIPT = r"""
import os, tempfile, torch, torch.distributed as dist
torch.set_num_threads(1)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
opt = torch.optim.AdamW(m.parameters())
x = torch.randn(8, 64)
for _ in range(2):
    torch.nn.functional.cross_entropy(m(x).float(), torch.zeros(8, dtype=torch.long)).backward()
    opt.step()
    opt.zero_grad()
dist.barrier()
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
dist.destroy_process_group()
"""


def _baseline_process_bytes() -> int:
    """Peak resident size of a worker that loaded torch, joined a gloo group and ran a
    tiny DDP step: what every CPU worker pays before its first tensor."""
    try:
        out = subprocess.run([sys.executable, "-c", _BASELINE_SCRIPT], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return int(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return 400 * 1024 * 1024  # typical for torch 2.x when the probe cannot run


def with_nodes(dev: Device, gpus_per_node: int) -> Device:
    return replace(dev, gpus_per_node=gpus_per_node)
