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


def _node(node: int, port: int, run_dir, nproc: int, *sets: str, master: str = "127.0.0.1",
          nnodes: int = 2) -> list[str]:
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--nnodes", str(nnodes),
           "--node-rank", str(node), "--master-addr", master, "--master-port", str(port), "--run-dir", str(run_dir)]
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


@pytest.mark.slow
def test_a_node_that_never_arrives_is_named_by_the_nodes_that_did(tmp_path):
    """--nnodes 3 with node 1 never started: torch's rendezvous only counts clients ("2/3
    clients joined"); node 0 and node 2 both name node 1, exit 1, and do not hang."""
    port = free_port()
    sets = ["train.timeout_s=6", "train.global_batch=12", "train.micro_batch=4"]
    procs = [subprocess.Popen(_node(node, port, tmp_path / f"run{node}", 1, *sets, nnodes=3), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in (0, 2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 1, err[-2000:]
        assert f"node 1 of 3 never reached the master 127.0.0.1:{port} within 6s (train.timeout_s); was the same " \
               f"command started there with --node-rank 1" in err, err[-2000:]
        assert "Traceback" not in err


def test_a_follower_node_that_never_arrives_is_named():
    """Inference across nodes (`Followers`, what generate/serve --tp/--pp --nnodes run): node 0
    holds rank 0 alone and waits for node 1's ranks, which never come. (In a process of its
    own: Followers binds this process's collectives to an interface, as a CLI command would.)"""
    port = free_port()
    code = ("from llmsplit.launch import Followers, LaunchError, Nodes\n"
            "try:\n"
            f"    Followers(print, (), 2, 'gloo', timeout_s=2, nodes=Nodes(2, 0, '127.0.0.1', {port}))\n"
            "except LaunchError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert f"node 1 of 2 never reached the master 127.0.0.1:{port} within 2s while starting; was the same command " \
           f"started there with --node-rank 1" in out, out


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
    raise AssertionError(f"the job never logged step {step}: {[p.poll() for p in procs]}"
                         f"{[p.stderr.read()[-3000:] for p in procs if p.poll() is not None]}")


def _wait_for(path, lines: int, procs, timeout_s: float = 180) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and len(path.read_text().splitlines()) >= lines:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"{path} never had {lines} lines: {[p.poll() for p in procs]}")


@pytest.mark.slow
def test_an_elastic_job_goes_on_without_a_lost_machine_and_takes_it_back_as_one_process_would(tmp_path):
    """--nnodes 1:2, 2 machines x 2 workers, ZeRO-3, a checkpoint every 2 steps. Machine 1 is
    lost at step 7 (its workers stop answering there, then every process of it is killed at
    once): machine 0 meets again alone and resumes on its 2 workers with the same global batch.
    Machine 1 is started again (`--resume auto`) while machine 0 pauses at step 10 of that
    attempt: the two meet and finish on 4 workers. Every step's loss and gradient norm are
    the single process's; membership.jsonl says who left and who joined."""
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

        def start(node: int, fault: str, *extra: str) -> subprocess.Popen:
            return subprocess.Popen(prefixes[node] + cmd + list(extra), env=dict(os.environ, LLMSPLIT_FAULT=fault),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)

        # Machine 1 stalls at step 7 of the first attempt; machine 0 pauses 10 s at step 10 of
        # its restart, while machine 1 comes back (and again when it redoes step 10 with it).
        procs = [start(0, "*:10:pause:1"), start(1, "*:7:hang")]
        try:
            _wait_for_step(run, 6, procs)
            os.killpg(procs[1].pid, signal.SIGKILL)  # machine 1 is lost: every process of it at once
            _wait_for(run / "membership.jsonl", 2, procs[:1])  # machine 0 goes on alone
            procs[1] = start(1, "", "--resume", "auto")  # machine 1 comes back
            out, err = procs[0].communicate(timeout=300)
            err += procs[1].communicate(timeout=60)[1]
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    assert procs[0].returncode == 0 and procs[1].returncode == 0, err[-3000:]
    assert_close_losses(losses(run), losses(tmp_path / "ref"))
    attempts = [json.loads(line) for line in (run / "membership.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["world_size"], len(a["machines"])) for a in attempts] == [(0, 4, 2), (1, 2, 1), (2, 4, 2)]
    # The newest complete checkpoint: step 6's, or step 4's when the kill cut step 6's write short.
    assert attempts[1]["resumed_from_step"] + attempts[1]["steps_redone"] == 6, attempts
    assert attempts[2]["resumed_from_step"] == 8 and attempts[2]["steps_redone"] == 1, attempts
    if made:  # machines are told apart by their addresses; on loopback both are 127.0.0.1
        assert attempts[1]["left"] == [made[1][1]] and attempts[2]["joined"] == [made[1][1]], attempts
    assert "attempt 2 runs on 4 workers of 2 machine(s)" in err, err[-3000:]  # said by rank 0's machine
    # torch counts failures only: the join restart kept count 1, and its line says who joined, not a failure again.
    assert [a["restart"] for a in attempts] == [0, 1, 1], attempts
    assert err.count("; restart 1 of 1 resumes from checkpoint") == 1, err[-3000:]
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


@pytest.mark.slow
def test_machines_started_with_different_configs_are_refused_by_name(tmp_path):
    port = free_port()
    procs = [subprocess.Popen(_node(node, port, tmp_path / "run", 1, *TINY, f"train.lr={lr}"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node, lr in ((0, 0.003), (1, 0.001))]
    try:
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [1, 1], errs
    for err in errs:
        assert ("(node 1) was started with another config than node 0 (127.0.0.1): train.lr=0.001 there, 0.003 on "
                "node 0; start every machine with the same config and --set flags") in err, err[-3000:]
        assert "hint:" not in err  # the sentence says the fix; no "--resume auto" hint for this one
