"""The devices the planner knows: datasheet numbers for GPUs, measured numbers for `cpu`.

GPU figures are dense (no 2:4 sparsity) vendor peaks; the cost model applies its own
efficiency on top. Link figures are per GPU and per direction, which is what a ring
collective's bandwidth term uses. The `cpu` device is built from numbers measured on the
machine (matmul FLOP/s per core, copy bandwidth, loopback TCP bandwidth for gloo, the
resident memory of a process that has torch loaded and ran one distributed step), handed
in by the caller: `llmsplit.diagnose.probe` measures them. Nothing here times or spawns
anything, so a plan is a function of its inputs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError

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
    compile_bytes: int = 0       # CPU: what torch.compile adds to a worker (train.compile), where measured

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


def get_device(name: str | Device, workers_per_node: int = 1, cpu_measured: dict | None = None) -> Device:
    """A catalogue entry, or `cpu` built from `cpu_measured` (this machine's numbers, from
    `llmsplit.diagnose.probe.measure_cpu`) with its memory shared by the local workers. A
    Device is taken as it is (`diagnose.probe.local_device` builds one for an unlisted GPU)."""
    if isinstance(name, Device):
        return name
    if name.lower() == "cpu":
        if cpu_measured is None:
            raise ConfigError("--gpu cpu needs this machine's measured numbers: call llmsplit.plan(...), which "
                              "measures them, or pass cpu_measured=llmsplit.diagnose.probe.measure_cpu()")
        return cpu_device(cpu_measured, workers_per_node)
    for key, dev in CATALOGUE.items():
        if key.lower() == name.lower():
            return dev
    raise ConfigError(f"--gpu {name!r} is not a known device; known: {', '.join(known_devices())}")


def nearest_catalogue_device(label: str, total_memory: int) -> Device:
    """The catalogue entry for a GPU that torch names `label` with `total_memory` bytes:
    the entry whose name appears in the label (e.g. "NVIDIA H100 80GB HBM3" → H100-80GB)
    closest in memory, or, for a GPU the catalogue does not list, the entry closest in
    memory with this GPU's name and memory."""
    squeezed = label.upper().replace(" ", "")

    def distance(dev: Device) -> float:
        return abs(dev.memory_bytes - total_memory)

    named = [d for d in CATALOGUE.values() if d.name.split("-")[0].upper() in squeezed]
    if named:
        return min(named, key=distance)
    nearest = min(CATALOGUE.values(), key=distance)
    return replace(nearest, name=label, memory_bytes=total_memory)


def cpu_device(measured: dict, workers_per_node: int = 1) -> Device:
    """A machine measured as `measured` (see `diagnose.probe.measure_cpu` for the keys) run
    as `workers_per_node` gloo workers, each with cores/workers threads (the share
    llmsplit's launcher gives them) and 1/workers of the RAM."""
    m = measured
    workers = max(1, workers_per_node)
    threads = max(1, m["cores"] // workers)
    per_core = m["matmul_flops_per_core"]
    return Device(
        name="cpu", memory_bytes=m["mem_total_bytes"] // workers,
        peak_flops={"fp32": per_core["fp32"] * threads, "bf16": per_core["bf16"] * threads,
                    "fp16": per_core["bf16"] * threads},
        mem_bw=m["copy_bytes_per_s"], intra_bw=m["loopback_bytes_per_s"], inter_bw=m["loopback_bytes_per_s"],
        host_bw=m["copy_bytes_per_s"], gpus_per_node=workers, host_memory_bytes=m["mem_total_bytes"],
        runtime_bytes=m["baseline_process_bytes"], compile_bytes=m.get("compile_extra_bytes", 0),
        # The measured matmul rate is already what is achieved, not a datasheet peak.
        # Allocator behaviour on a CPU is not a fraction of the tensors: memory.py counts
        # the heap it keeps (cpu_retained_heap_bytes).
        alloc_slack=0.0, matmul_efficiency=1.0, kind="cpu", measured=m, node_size=workers)
