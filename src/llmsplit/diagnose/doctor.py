"""`llmsplit doctor`: check what distributed runs need, one line per check, each with a fix.

Every check returns OK, WARN (works, but probably not as intended) or FAIL (a run will
not work). Nothing here needs a process group: it is what to run when one will not form.
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import socket
import sys
from dataclasses import dataclass

from .. import threads
from ..errors import ConfigError
from ..launch.cluster_env import FLAGS, ClusterEnv, detect

LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "TORCHELASTIC_RUN_ID")


@dataclass
class Check:
    status: str  # OK | WARN | FAIL
    name: str
    detail: str
    fix: str = ""


def run_checks(master_addr: str | None = None, master_port: int | None = None) -> list[Check]:
    import torch
    import torch.distributed as dist

    checks = [Check("OK", "python", f"{platform.python_version()} ({sys.executable})"), _torch_check(torch)]
    checks += _device_checks(torch)
    checks.append(Check("OK" if dist.is_available() and dist.is_gloo_available() else "FAIL", "gloo",
                        "available" if dist.is_gloo_available() else "missing",
                        "" if dist.is_gloo_available() else "install a torch build with distributed support"))
    if torch.cuda.is_available():
        ok = dist.is_nccl_available()
        checks.append(Check("OK" if ok else "FAIL", "nccl", "available" if ok else "missing",
                            "" if ok else "install a CUDA build of torch with NCCL"))
    cluster, found = _cluster_check(os.environ)
    checks.append(cluster)
    if found is not None:  # the master the launcher names, unless the flags name one
        master_addr, master_port = master_addr or found.master_addr, master_port or found.master_port
    checks += _launcher_checks(master_addr, master_port)
    checks += _network_checks()
    checks += _resource_checks()
    return checks


def _torch_check(torch) -> Check:
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build"
    detail = f"{torch.__version__} ({build})"
    if not torch.version.cuda or (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return Check("OK", "torch", detail)
    # pip takes the CUDA build by default on Linux: gigabytes of CUDA libraries that a machine
    # without a GPU never uses, and a bigger process for every worker that imports them.
    package = os.path.dirname(torch.__file__)
    cuda_libs = os.path.join(os.path.dirname(package), "nvidia")  # the nvidia-*-cu* wheels it pulls in
    sizes = f"torch {_folder_bytes(package) / 2**30:.1f} GiB in {package}" + (
        f", its CUDA libraries {_folder_bytes(cuda_libs) / 2**30:.1f} GiB in {cuda_libs}"
        if os.path.isdir(cuda_libs) else "")
    version = torch.__version__.split("+")[0]
    return Check("WARN", "torch", f"{detail} on a machine with no GPU; installed: {sizes}",
                 f"the CPU build is smaller on disk and in every process: pip install torch=={version} "
                 f"--index-url https://download.pytorch.org/whl/cpu")


def _folder_bytes(path: str) -> int:
    """The disk space the files under `path` take (allocated blocks, as du counts them)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # removed while we walk
                pass
    return total


def _device_checks(torch) -> list[Check]:
    if not torch.cuda.is_available():
        return [Check("WARN", "devices", f"no CUDA device; {os.cpu_count()} CPU cores: runs use CPU + gloo",
                      "fine for testing; for speed run on a machine with GPUs and a CUDA build of torch")]
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        name = torch.cuda.get_device_name(i)
        status = "OK" if free > 0.8 * total else "WARN"
        out.append(Check(status, f"cuda:{i}", f"{name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free",
                         "" if status == "OK" else "another process holds this GPU's memory (see nvidia-smi)"))
    return out


def _cluster_check(env) -> tuple[Check, ClusterEnv | None]:
    """Which cluster launcher `llmsplit train`/`serve` would take their node flags from here
    (launch/cluster_env.py), with what it says; the master checks below then use its address."""
    try:
        found = detect(env)
    except ConfigError as e:
        return Check("FAIL", "cluster launcher", str(e)), None
    if found is not None:
        sources = ", ".join(dict.fromkeys(found.sources.values()))
        unset = [flag for key, flag in FLAGS.items() if getattr(found, key) is None]
        return Check("WARN" if unset else "OK", "cluster launcher", f"{found.describe()} (from {sources})",
                     f"pass {' and '.join(unset)} to llmsplit train and serve (no variable here gives "
                     f"{'it' if len(unset) == 1 else 'them'})" if unset else ""), found
    # An allocation seen from outside `srun` (a batch script, an salloc shell) is one machine.
    alone = " (a Slurm job, but not inside a multi-node srun: this machine alone)" if env.get("SLURM_JOB_ID") else ""
    return Check("OK", "cluster launcher", f"none{alone}: --nnodes and the other node flags decide"), None


def _launcher_checks(master_addr: str | None, master_port: int | None) -> list[Check]:
    env = {k: os.environ[k] for k in LAUNCH_VARS if k in os.environ}
    out = [Check("OK", "launcher env", ", ".join(f"{k}={v}" for k, v in env.items()) or
                 "none set (llmsplit train starts its own workers)")]
    addr = master_addr or os.environ.get("MASTER_ADDR")
    port = master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT", "").isdigit() else None)
    if addr is None:
        return out
    try:
        infos = socket.getaddrinfo(addr, None, proto=socket.IPPROTO_TCP)
        ip = infos[0][4][0]
    except socket.gaierror as e:
        out.append(Check("FAIL", "master address", f"{addr!r} does not resolve ({e.strerror})",
                         "use node 0's IP address or a hostname every node can resolve"))
        return out
    local = _is_local(ip)
    out.append(Check("OK", "master address", f"{addr} -> {ip} ({'this machine' if local else 'another machine'})"))
    out.append(_interface_check(addr, port))
    if port is None:
        return out
    if local:
        try:
            with socket.socket() as s:
                s.bind((ip, port))
            out.append(Check("OK", "master port", f"{port} is free on this machine (node 0 can listen on it)"))
        except OSError:
            out.append(Check("WARN", "master port", f"{port} is in use on this machine",
                             "fine if node 0 of this job is already running; otherwise pick another --master-port"))
    else:
        try:
            with socket.create_connection((ip, port), timeout=3):
                pass
            out.append(Check("OK", "master port", f"{ip}:{port} accepts connections"))
        except OSError as e:
            out.append(Check("FAIL", "master port", f"cannot connect to {ip}:{port} ({e.strerror or e})",
                             "start node 0 first, and open the port in the firewall between the machines"))
    return out


def _interface_check(addr: str, port: int | None) -> Check:
    """The interface and address this node's collectives would use for a job whose master is
    `addr` (launch/network.py): what its peers must be able to reach."""
    from ..launch.network import IFNAME_VARIABLES, collective_interface

    chosen = {v: os.environ[v] for v in IFNAME_VARIABLES if os.environ.get(v)}
    if chosen:
        return Check("OK", "interface", ", ".join(f"{k}={v}" for k, v in chosen.items()) + " (set by you)")
    name, source = collective_interface(addr, port)
    if name is None:
        return Check("WARN", "interface", f"no interface found that routes to {addr}",
                     "set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the interface other nodes reach this on")
    # A master named by a network address but reached through loopback is this machine under
    # another name: other machines would be told a loopback address.
    looped = (source.startswith("127.") or source == "::1") and not (addr.startswith("127.") or addr == "localhost")
    return Check("WARN" if looped else "OK", "interface",
                 f"{name} ({source}): the route to {addr}, which llmsplit binds gloo/NCCL to across nodes",
                 "other machines cannot reach a loopback address; pass node 0's network address as --master-addr"
                 if looped else "")


def _is_local(ip: str) -> bool:
    if ip.startswith("127.") or ip == "::1":
        return True
    try:
        with socket.socket() as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _network_checks() -> list[Check]:
    names = [n for _, n in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    out = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(var)
        if value is None:
            continue
        missing = [v for v in value.lstrip("^=").split(",") if v and names and v not in names and not value.startswith("^")]
        out.append(Check("FAIL" if missing else "OK", var, f"{value}" + (f" (no interface {missing[0]})" if missing else ""),
                         f"set {var} to one of: {', '.join(names)}" if missing else ""))
    # Virtual devices (traffic shaping, container bridges) are never what nodes talk over.
    external = [n for n in names if n != "lo" and not n.startswith(("ifb", "veth", "docker", "br-", "virbr"))]
    if len(external) > 1 and not any(v in os.environ for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")):
        out.append(Check("WARN", "interfaces", f"several network interfaces: {', '.join(external)}",
                         "for multi-node runs set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the one the nodes share"))
    else:
        out.append(Check("OK", "interfaces", ", ".join(names) or "unknown"))
    return out


def _resource_checks() -> list[Check]:
    out = []
    cores = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS")
    if omp and omp.isdigit() and int(omp) > cores:
        out.append(Check("WARN", "threads", f"OMP_NUM_THREADS={omp} exceeds the {cores} cores",
                         f"unset it (llmsplit gives each worker cores ÷ workers) or set at most {cores}"))
    else:
        out.append(Check("OK", "threads", f"{cores} cores, OMP_NUM_THREADS={omp or 'unset'} "
                                         f"(llmsplit gives each local worker cores ÷ workers)"))
    out.append(_contention_check())
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        size = st.f_blocks * st.f_frsize
        status = "OK" if size >= 1 << 30 else "WARN"
        out.append(Check(status, "shared memory", f"/dev/shm {size / 2**30:.1f} GiB",
                         "" if status == "OK" else "containers: run with --shm-size=8g (or --ipc=host)"))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    status = "OK" if soft == resource.RLIM_INFINITY or soft >= 4096 else "WARN"
    out.append(Check(status, "open files", f"limit {soft}",
                     "" if status == "OK" else "raise it with `ulimit -n 65536` (checkpoints and data loaders open many files)"))
    free = shutil.disk_usage(".").free
    status = "OK" if free >= 5 << 30 else "WARN"
    out.append(Check(status, "disk", f"{free / 2**30:.0f} GiB free in {os.getcwd()}",
                     "" if status == "OK" else "checkpoints need room: free space or set checkpoint.dir elsewhere"))
    return out


def _contention_check() -> Check:
    """Other processes competing for the cores slow every parallel region (issue 23: 3-9x
    for 2-thread decode under libgomp's default spin)."""
    chosen = {k: os.environ[k] for k in threads.POLICY_KEYS if k in os.environ}
    policy = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "libgomp's default (spin)"
    busy = threads.oversubscription()
    if busy is None:
        return Check("OK", "cpu load", f"{os.getloadavg()[0]:.1f} (1-minute load average); OpenMP wait policy {policy}")
    return Check("WARN", "cpu load", f"{busy}; OpenMP wait policy {policy}",
                 "runs here will be slower than on a quiet machine: stop the other jobs, or give each fewer "
                 "threads (generate and serve drop to one thread by themselves while that is faster, unless "
                 "OMP_NUM_THREADS is set; docs/serving.md, 'Threads')")


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)
