"""Which machines a job spans, as the cluster launcher that started this process says:
Slurm (inside `srun`), Kubeflow Trainer / PyTorchJob (the PET_* variables torchrun reads as
its flags' defaults) and SkyPilot. `llmsplit train` and `serve` take each of
--nnodes/--node-rank/--master-addr/--master-port that the user did not pass from here, so
that one command line, unchanged, runs on every node of such a job.

Pure functions of an environment mapping (tests pass a dict): no torch, no processes.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Mapping, MutableMapping

from ..errors import ConfigError

FLAGS = {"nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
         "master_port": "--master-port"}

# A port derived from a job id lies below Linux's ephemeral range (32768-60999), where the
# kernel picks the local port of every outgoing connection: one of those could hold it. The
# span keeps 20,000 consecutive Slurm jobs sharing a node apart.
_PORT_BASE, _PORT_SPAN = 12000, 20000


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    """What a launcher says about this process's job: its name, the number of machines, this
    machine's rank and node 0's address and port (None where the launcher names none), and in
    `sources` the variable each value came from (for messages)."""
    launcher: str
    nnodes: int
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    sources: dict[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def describe(self) -> str:
        rank, port = ("?" if v is None else v for v in (self.node_rank, self.master_port))
        return f"{self.launcher}: node {rank} of {self.nnodes}, master {self.master_addr or '?'}:{port}"


def detect(env: Mapping[str, str]) -> ClusterEnv | None:
    """The launcher that started this process on several machines, or None: no launcher, or
    one machine (a one-node `srun`, an `salloc` shell, a one-node TrainJob), which runs as
    without one. A value a launcher set that cannot be meant (SLURM_NODEID=x, a node rank
    not below the node count) is a ConfigError naming the variable."""
    for read in (_kubeflow, _skypilot, _slurm):
        found = read(env)
        if found is not None:
            if found.nnodes <= 1:
                return None
            rank = found.node_rank
            if rank is not None and rank >= found.nnodes:
                raise ConfigError(f"{found.sources['node_rank']}={rank} is not below {found.sources['nnodes']}="
                                  f"{found.nnodes}; start one llmsplit command per node of the job, or pass "
                                  f"--nnodes and --node-rank")
            return found
    return None


def node_settings(env: Mapping[str, str], **flags) -> tuple[dict, ClusterEnv | None]:
    """The keyword arguments nnodes, node_rank, master_addr, master_port a command runs with:
    each flag the user passed (`flags`, None where not passed) as given, the others from the
    launcher `detect` finds in `env`; one still unknown is left out (its default: one machine).
    Also the launcher used, with these values and their sources, or None. An explicit
    --nnodes 1 runs on this machine alone."""
    given = {key: value for key, value in flags.items() if value is not None}
    assert given.keys() <= FLAGS.keys(), given
    if given.get("nnodes") == 1 or len(given) == len(FLAGS):
        return given, None  # nothing left for a launcher to say
    found = detect(env)
    if found is None:
        return given, None
    settings = dict(given)
    for key, flag in FLAGS.items():
        if key not in settings:
            if getattr(found, key) is None:
                raise ConfigError(f"{found.launcher} runs this job on {found.nnodes} machines but "
                                  f"{found.sources[key]} is not set; pass {flag}")
            settings[key] = getattr(found, key)
    if settings["node_rank"] >= settings["nnodes"]:  # one of the two was passed, the other not
        rank, nnodes = (FLAGS[k] if k in given else found.sources[k] for k in ("node_rank", "nnodes"))
        raise ConfigError(f"node rank {settings['node_rank']} ({rank}) is not below the {settings['nnodes']} "
                          f"machines of {nnodes}; pass both --nnodes and --node-rank, or neither")
    sources = {**found.sources, **{key: FLAGS[key] for key in given}}
    return settings, dataclasses.replace(found, **settings, sources=sources)


def drop_launcher_variables(environ: MutableMapping[str, str]) -> None:
    """Remove the PET_* variables from `environ` (a worker's own os.environ), in place.
    torchrun and torch's elastic argument parser take PET_<FLAG> as the default of each flag
    (PET_NNODES for --nnodes, ...): they describe the job of the llmsplit command, which has
    read them already, and a torchrun that a worker started (an evaluation, a tool built on
    it) would otherwise join the cluster's job instead of starting its own."""
    for name in [name for name in environ if name.startswith("PET_")]:
        del environ[name]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list as host names, in order, as `scontrol show hostnames`
    prints them: `gpu-[01-03,07],login1` is gpu-01, gpu-02, gpu-03, gpu-07, login1 (a range
    keeps its first number's zero-padding; `rack[1-2]-n[1-2]` expands both brackets).
    ValueError for what is not such a list. Written here rather than run `scontrol`: a
    container in the job need not have it."""
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text)
    if not text or ",".join(items) != text:  # an empty item, or an unclosed bracket
        raise ValueError(text)
    return [host for item in items for host in _expand_item(item)]


def _expand_item(item: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(item)
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest) if rest else [""]
    return [prefix + number + tail for number in _numbers(ranges) for tail in tails]


def _numbers(ranges: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(part)
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(part)
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def _number(env: Mapping[str, str], name: str) -> int | None:
    """The whole number in variable `name` (None when unset); anything else is a ConfigError."""
    value = env.get(name)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise ConfigError(f"{name}={value!r} is not a whole number, and llmsplit reads this job's machines from it; "
                          f"unset it, or pass --nnodes, --node-rank, --master-addr and --master-port yourself")
    return int(value)


def _first(env: Mapping[str, str], *names: str) -> str:
    """The first of `names` that is set (the first name when none is, for messages)."""
    return next((name for name in names if env.get(name)), names[0])


def _port(env: Mapping[str, str], job_id_name: str) -> tuple[int | None, str]:
    """MASTER_PORT when the user exported it, else a port every node derives alike from the
    job's id (Slurm's number, SkyPilot's task name), and the variable it came from."""
    if env.get("MASTER_PORT"):
        port = _number(env, "MASTER_PORT")
        if port > 65535:
            raise ConfigError(f"MASTER_PORT={port} is not a port (0-65535); unset it or pass --master-port")
        return port, "MASTER_PORT"
    job = env.get(job_id_name)
    if not job:
        return None, "MASTER_PORT"
    key = int(job) if job.isdigit() else zlib.crc32(job.encode())
    return _PORT_BASE + key % _PORT_SPAN, job_id_name


def _kubeflow(env: Mapping[str, str]) -> ClusterEnv | None:
    """Kubeflow Trainer's TrainJob and the training operator's PyTorchJob set PET_NNODES,
    PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT for torchrun; a PyTorchJob also sets
    MASTER_ADDR and MASTER_PORT."""
    if not env.get("PET_NNODES"):
        return None
    if ":" in env["PET_NNODES"]:  # min:max, an elastic job: only from --nnodes MIN:MAX (launch/elastic.py)
        low, _, high = env["PET_NNODES"].partition(":")
        if low != high:
            raise ConfigError(f"PET_NNODES={env['PET_NNODES']!r} asks for an elastic job, which llmsplit takes from "
                              f"its own flags only; pass --nnodes {low}:{high} --master-addr HOST --master-port PORT "
                              f"(docs/multinode.md), or give the job a fixed number of nodes (minReplicas = "
                              f"maxReplicas)")
        env = {**env, "PET_NNODES": low}
    addr, port = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR"), _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    return ClusterEnv("Kubeflow (PET_*)", _number(env, "PET_NNODES"), _number(env, "PET_NODE_RANK"), env.get(addr),
                      _number(env, port), {"nnodes": "PET_NNODES", "node_rank": "PET_NODE_RANK",
                                           "master_addr": addr, "master_port": port})


def _skypilot(env: Mapping[str, str]) -> ClusterEnv | None:
    """SkyPilot sets SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK and SKYPILOT_NODE_IPS (one per
    line, the head node first) on every node of a task; it names no port."""
    if not env.get("SKYPILOT_NUM_NODES"):
        return None
    ips = env.get("SKYPILOT_NODE_IPS", "").split()
    addr, addr_name = (env["MASTER_ADDR"], "MASTER_ADDR") if env.get("MASTER_ADDR") else (
        ips[0] if ips else None, "SKYPILOT_NODE_IPS")
    port, port_name = _port(env, "SKYPILOT_TASK_ID")
    return ClusterEnv("SkyPilot", _number(env, "SKYPILOT_NUM_NODES"), _number(env, "SKYPILOT_NODE_RANK"), addr, port,
                      {"nnodes": "SKYPILOT_NUM_NODES", "node_rank": "SKYPILOT_NODE_RANK", "master_addr": addr_name,
                       "master_port": port_name})


def _slurm(env: Mapping[str, str]) -> ClusterEnv | None:
    """Inside an `srun` step only (SLURM_STEP_NUM_NODES): a batch script and an `salloc`
    shell carry the allocation's node count too, but run on one machine, where a node 0
    would wait for peers that nobody starts. The step's own node list and count come first:
    a step may use fewer nodes than the job holds."""
    if not env.get("SLURM_STEP_NUM_NODES"):
        return None
    nnodes = _number(env, "SLURM_STEP_NUM_NODES")
    if nnodes <= 1:  # a one-node step runs as it always has: nothing else of Slurm's is read
        return ClusterEnv("Slurm", nnodes, 0, None, None)
    tasks = _number(env, "SLURM_STEP_NUM_TASKS")
    if tasks is not None and tasks != nnodes:  # several launchers per node would collide
        raise ConfigError(f"SLURM_STEP_NUM_TASKS={tasks} on {nnodes} nodes: llmsplit starts the workers of a node "
                          f"itself; run one task per node (srun --ntasks-per-node=1)")
    hosts = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    addr, addr_name = env.get("MASTER_ADDR"), "MASTER_ADDR"
    if not addr and env.get(hosts):
        addr, addr_name = _first_host(env, hosts), hosts
    port, port_name = _port(env, _first(env, "SLURM_JOB_ID", "SLURM_JOBID"))
    return ClusterEnv("Slurm", nnodes, _number(env, "SLURM_NODEID"), addr, port,
                      {"nnodes": "SLURM_STEP_NUM_NODES", "node_rank": "SLURM_NODEID", "master_addr": addr_name,
                       "master_port": port_name})


def _first_host(env: Mapping[str, str], name: str) -> str:
    try:
        return expand_nodelist(env[name])[0]
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not a Slurm host list (such as gpu-[01-03,07]); "
                          f"export MASTER_ADDR or pass --master-addr with node 0's address") from None
