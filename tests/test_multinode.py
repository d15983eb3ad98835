"""Two `llmsplit train --nnodes 2` commands, each on a host of its own network stack (network
namespaces, tests/netns.py; loopback where they cannot be made), form one job with the
single-process losses; a master that cannot be found is reported with the fix.
(One worker per node is covered by test_train_ddp.test_two_nodes_on_one_machine_match_one_process.)"""

from __future__ import annotations

import contextlib
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


def _wait_for_step(run_dir, step: int, procs, timeout_s: float = 180) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.is_file() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()
                                  if line.strip()):
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"the job never logged step {step}: {[p.poll() for p in procs]}")


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_machine_finishes_on_the_other_as_one_process_would(tmp_path):
    """--nnodes 1:2, 2 machines x 2 workers, ZeRO-3, a checkpoint every 2 steps: every process
    of machine 1 is killed at step 7 (its workers stop answering there, then the test kills
    its launcher, server and workers at once); machine 0 meets again alone and resumes from
    step 6 on 2 workers with the same global batch, and every step's loss and gradient norm
    are the single process's; membership.jsonl says who left."""
    import os
    import signal

    sets = [*TINY, "train.steps=12", "parallel.zero=3", "checkpoint.every=2"]
    train(tmp_path / "ref", *sets, "train.micro_batch=8", "parallel.zero=0", nproc=1)
    port, run = free_port(), tmp_path / "run"
    with hosts(2) as made:
        prefixes, master = ([p for p, _ in made], made[0][1]) if made else ([[], []], "127.0.0.1")
        cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "2", "--nnodes", "1:2", "--master-addr", master,
               "--master-port", str(port), "--max-restarts", "1", "--run-dir", str(run)]
        for s in sets:
            cmd += ["--set", s]
        env = [dict(os.environ), dict(os.environ, LLMSPLIT_FAULT="*:7:hang")]  # machine 1 stalls at step 7
        procs = [subprocess.Popen(prefixes[node] + cmd, env=env[node], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True) for node in (0, 1)]
        try:
            _wait_for_step(run, 6, procs)
            os.killpg(procs[1].pid, signal.SIGKILL)  # machine 1 is lost: every process of it at once
            out, err = procs[0].communicate(timeout=300)
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode == 0, err[-3000:]
    assert_close_losses(losses(run), losses(tmp_path / "ref"))
    attempts = [json.loads(line) for line in (run / "membership.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["world_size"], len(a["machines"])) for a in attempts] == [(0, 4, 2), (1, 2, 1)], attempts
    # The newest complete checkpoint: step 6's, or step 4's when the kill cut step 6's write short.
    resumed = attempts[1]["resumed_from_step"]
    assert resumed in (4, 6) and resumed + attempts[1]["steps_redone"] == 6, attempts
    if made:  # machines are told apart by their addresses; on loopback both are 127.0.0.1
        assert attempts[1]["left"] == [made[1][1]], attempts
        assert sorted(attempts[0]["machines"]) == sorted(address for _, address in made), attempts
    assert "attempt 1 runs on 2 workers of 1 machine(s)" in err, err[-3000:]
    assert "plan is off" not in err, err[-3000:]  # the planner checked the world the job ended on


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "3:2"], "argument --nnodes: MIN 3 is above MAX 2; pass --nnodes 2:3"),
    (["--nnodes", "1:2", "--node-rank", "1"], "--node-rank 1: with --nnodes 1:2 the rendezvous numbers the machines"),
    (["--nnodes", "1:3", "--set", "parallel.dp=2"], "parallel.dp=2 fixes the number of workers, and --nnodes 1:3"),
    (["--nnodes", "1:3", "--set", "train.global_batch=8", "--set", "train.micro_batch=4"],
     "--nnodes 1:3: on 2 machine(s) (4 workers): train.global_batch=8 is not divisible"),
])
def test_an_elastic_job_that_cannot_work_on_every_membership_is_refused(tmp_path, capsys, flags, message):
    args = ["train", "--nproc", "2", "--master-port", "29500", "--run-dir", str(tmp_path / "run"), *flags]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
