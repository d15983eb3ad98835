"""Two `llmsplit train --nnodes 2` commands, each on a host of its own network stack (network
namespaces, tests/netns.py; loopback where they cannot be made), form one job with the
single-process losses; a master that cannot be found is reported with the fix.
(One worker per node is covered by test_train_ddp.test_two_nodes_on_one_machine_match_one_process.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import TINY, assert_close_losses, losses, run_cli, train
from netns import hosts
from llmsplit.cli import main
from llmsplit.launch import free_port


def _node(node: int, port: int, run_dir, nproc: int, *sets: str, master: str = "127.0.0.1") -> list[str]:
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--nnodes", "2", "--node-rank", str(node),
           "--master-addr", master, "--master-port", str(port), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


@pytest.mark.slow
def test_two_nodes_of_two_workers_match_one_process(tmp_path):
    train(tmp_path / "ref", *TINY, "train.micro_batch=8", nproc=1)
    port = free_port()
    with hosts(2) as made:  # separate network stacks: a node advertising 127.0.0.1 would be unreachable
        prefixes, master = ([p for p, _ in made], made[0][1]) if made else ([[], []], "127.0.0.1")
        # Node 1 starts first: the static rendezvous still makes node 0 (the one named by
        # --node-rank 0) host global rank 0, which writes the run folder.
        procs = [subprocess.Popen(prefixes[node] + _node(node, port, tmp_path / f"run{node}", 2, *TINY,
                                                         "train.micro_batch=1", master=master),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (1, 0)]
        try:
            outs = [p.communicate(timeout=300) for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    if made:  # each node said which interface its peers reach it on
        assert all("collectives on interface lsh" in err for _, err in outs), [o[1][-2000:] for o in outs]
    # Every node was given its own --run-dir; rank 0's (node 0's) is the one used.
    assert not (tmp_path / "run1").exists()
    assert_close_losses(losses(tmp_path / "run0"), losses(tmp_path / "ref"))
    assert json.loads((tmp_path / "run0" / "summary.json").read_text())["world_size"] == 4


@pytest.mark.slow
def test_an_unreachable_master_says_how_to_check_it(tmp_path):
    port = free_port()  # nobody listens there
    proc = run_cli("train", "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
                   "--run-dir", str(tmp_path / "run"), "--set", "train.timeout_s=2", check=False, timeout=120)
    assert proc.returncode == 1
    assert f"node 1 could not reach the master 127.0.0.1:{port} within 2s" in proc.stderr
    assert f"llmsplit doctor --master-addr 127.0.0.1 --master-port {port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_master_address_that_does_not_resolve_is_refused(tmp_path, capsys):
    args = ["train", "--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-host.invalid",
            "--master-port", "29500", "--run-dir", str(tmp_path / "run")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--master-addr 'no-such-host.invalid' does not resolve" in err[0], err
