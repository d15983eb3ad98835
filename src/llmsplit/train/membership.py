"""Training on a changing set of machines (`--nnodes MIN:MAX`, launch/elastic.py): the
launcher's checks that the layout works on every membership, and the workers' side, which
derive parallel.dp from the world that met and say what changed since the last attempt."""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..config import Config, to_toml, validate
from ..errors import ConfigError
from ..io.run_dir import METRICS_FILE, read_metrics


def check_every_membership(job) -> None:
    """An elastic job runs on any number of its machines: its layout must work on each (the
    world sizes of min_nodes..nnodes machines), with parallel.dp following the world size."""
    w = job.workers
    if job.cfg.parallel.dp > 0:
        raise ConfigError(f"parallel.dp={job.cfg.parallel.dp} fixes the number of workers, and --nnodes "
                          f"{w.min_nodes}:{w.nnodes} lets it change; leave parallel.dp unset (-1) so that it follows "
                          f"the machines that meet")
    for nodes in range(w.min_nodes, w.nnodes + 1):
        try:
            validate(copy.deepcopy(job.cfg), nodes * job.per_node, job.model_cfg, job.tokenizer_vocab)
        except ConfigError as e:
            raise ConfigError(f"--nnodes {w.min_nodes}:{w.nnodes}: on {nodes} machine(s) ({nodes * job.per_node} "
                              f"workers): {e}") from None


def elastic_config(cfg: Config) -> str:
    """The config an elastic job's workers get: parallel.dp left for each to derive from the
    world size the rendezvous gave it (train.trainer.train_worker)."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel.dp = -1
    return to_toml(cfg)


MEMBERSHIP_FILE = "membership.jsonl"


def _node_address() -> str:
    """The address this node's collectives use (launch/network.py named its interface), else
    its host name: what tells the machines of a job apart in membership.jsonl."""
    from ..launch.network import interface_address

    name = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    return (interface_address(name) if name else None) or socket.gethostname()


def record_membership(run_dir: Path, resumed_from_step: int, rank0: bool) -> None:
    """Every attempt of a job spanning machines, and every restart: rank 0 appends one line
    to RUN_DIR/membership.jsonl (the attempt, its world size and machines, who left and who
    joined since the attempt before, the checkpoint step it resumed from and the logged steps
    it redoes) and says it on stderr after a restart. Called by every rank (it gathers each
    rank's machine), after the resume and before the metrics of the resumed run are trimmed."""
    restarted = _restart_count() > 0
    if not restarted and int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return
    nodes = _job_nodes  # check_same_config gathered them where the job spans machines
    if nodes is None:
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, (int(os.environ.get("GROUP_RANK", "0")), _node_address()))
    if not rank0:
        return
    machines = [address for _, address in sorted(set(nodes))]
    path = run_dir / MEMBERSHIP_FILE
    before = _attempts(run_dir)
    # Counted here, not from torch's restart count: a machine that joined later (whose rank 0
    # this may be) counts its own restarts from 0. A fresh run's first attempt starts the file.
    attempt = len(before) if before and (restarted or resumed_from_step) else 0
    previous = before[-1]["machines"] if attempt > 0 else []
    logged = [r["step"] for r in read_metrics(run_dir / METRICS_FILE)] if (run_dir / METRICS_FILE).is_file() else []
    record = {"attempt": attempt, "restart": _restart_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "world_size": dist.get_world_size(), "machines": machines,
              "left": [m for m in previous if m not in machines], "joined": [m for m in machines if m not in previous]
              if attempt > 0 else [], "resumed_from_step": resumed_from_step,
              "steps_redone": max([s - resumed_from_step for s in logged if s > resumed_from_step], default=0)}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if attempt > 0:
        changes = [f"{', '.join(record[k])} {k}" for k in ("left", "joined") if record[k]]
        print(f"llmsplit: attempt {attempt} runs on {record['world_size']} workers of {len(machines)} machine(s)"
              f"{' (' + '; '.join(changes) + ')' if changes else ''}, from step {resumed_from_step}"
              f"{' (' + str(record['steps_redone']) + ' logged steps redone)' if record['steps_redone'] else ''}",
              file=sys.stderr, flush=True)


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def restarted_for_a_join(run_dir: Path) -> bool:
    """Whether torch's agent restarted these workers because a machine joined, not because one
    failed: it counts only failures against --max-restarts, so the restart count is the one
    the attempt recorded last in membership.jsonl (whose line then says who joined)."""
    before = _attempts(run_dir)
    return bool(before) and before[-1].get("restart") == _restart_count() > 0


def _attempts(run_dir: Path) -> list[dict]:
    """membership.jsonl's records, oldest first ([] before the first)."""
    path = run_dir / MEMBERSHIP_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


class ConfigMismatch(RuntimeError):
    """The machines of one job were started with different configs; `details` (reaching the
    launcher as data: launch.worker_entry) names the machine and the keys that differ."""

    def __init__(self, message: str, node: int, address: str, keys: list[str]):
        super().__init__(message)
        self.details = {"node": node, "address": address, "keys": keys}


# (node, address) of every rank, gathered once a process by check_same_config where the job spans
# machines, so that record_membership does not gather them again (a worker process lives one attempt).
_job_nodes: list[tuple[int, str]] | None = None


def check_same_config(config_text: str) -> None:
    """Every worker of a job spanning machines: refuse, on every machine, a job whose machines
    were started with different configs (another --set, another file), naming the first keys
    that differ; a job would otherwise train each machine's share on its own settings."""
    import tomllib

    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, (int(os.environ.get("GROUP_RANK", "0")), _node_address(), config_text))
    global _job_nodes
    _job_nodes = [(node, address) for node, address, _ in texts]
    node0 = min(texts)
    for node, address, text in sorted(set(texts)):
        if text != node0[2]:
            theirs, ours = (_flat(tomllib.loads(t)) for t in (text, node0[2]))
            keys = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
            shown = "; ".join(f"{k}={theirs.get(k)!r} there, {ours.get(k)!r} on node 0" for k in keys[:3])
            raise ConfigMismatch(f"machine {address} (node {node}) was started with another config than node 0 "
                                 f"({node0[1]}): {shown}; start every machine with the same config and --set flags",
                                 node, address, keys)


def _flat(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out
