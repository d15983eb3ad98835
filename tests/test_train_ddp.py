"""Training through the real command line on real gloo process groups."""

import json
import subprocess
import sys

import pytest

from llmsplit.launch import free_port, start_method
from llmsplit.launch.workers import _root_failure

from helpers import (TINY, Trace, assert_close_losses, assert_same_gradients, dump_grads, grads_dir, losses, run_cli,
                     train)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no accumulation: the numbers every layout must reproduce (and step 1's
    gradients, dumped beside the run: helpers.grads_dir)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    train(run, *TINY, "train.micro_batch=8", "train.steps=6", "checkpoint.every=3", nproc=1, env=dump_grads(run))
    return run


def test_run_files_follow_the_spec(reference):
    metrics = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((reference / "summary.json").read_text())
    # TINY by hand: 2 layers of 36,992 parameters (wq, wo 64·64; wk, wv 32·64; w1, w2, w3
    # 3·64·128; two norms of 64), embedding and head 2·264·64, the final norm 64.
    assert summary["params"] == 2 * 36_992 + 2 * 264 * 64 + 64 == 107_840
    assert summary["trainable_params"] == 107_840 and "frozen_base_bytes" not in summary  # full training: all train
    for m in metrics:
        assert {"step", "loss", "lr", "tokens_per_s", "step_time_s", "peak_mem_bytes"} <= set(m)
        assert m["tokens_per_s"] * m["step_time_s"] == pytest.approx(8 * 32)  # global batch × seq_len
        # The peak holds at least the model state: fp32 weights, gradients and two Adam moments.
        assert m["peak_mem_bytes"] >= 16 * 107_840
    assert summary["world_size"] == 1 and summary["steps"] == 6
    assert summary["layout"] == {"dp": 1, "dp_replicate": 1, "zero": 0, "tp": 1, "pp": 1, "pp_schedule": "1f1b",
                                 "activation_checkpoint": "none", "offload": "none", "ep": 1,
                                 "cp": 1, "cp_mode": "ring"}
    assert summary["final_loss"] == metrics[-1]["loss"]
    params = summary["params"]
    (rank,) = summary["per_rank"]
    # fp32 weights, fp32 gradients, two fp32 Adam moments: 4 + 4 + 8 bytes per parameter.
    assert (rank["param_bytes"], rank["grad_bytes"], rank["optim_bytes"]) == (4 * params, 4 * params, 8 * params)
    assert "dim = 64" in (reference / "config.toml").read_text()
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step_3", "step_6"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_logs_the_single_process_loss_at_every_step(reference, tmp_path, nproc):
    train(tmp_path / "run", *TINY, "train.steps=6", nproc=nproc, env=dump_grads(tmp_path / "run"))
    assert_close_losses(losses(tmp_path / "run"), losses(reference))
    assert_same_gradients(grads_dir(tmp_path / "run"), grads_dir(reference))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == nproc and len(summary["per_rank"]) == nproc
    assert len({r["param_bytes"] for r in summary["per_rank"]}) == 1  # DDP: every rank holds everything


@pytest.mark.parametrize("mutation", ["double_grads:1", "skip_dp_divide"])
def test_the_comparisons_catch_a_planted_gradient_bug(reference, tmp_path, mutation):
    """The comparisons every layout test relies on fail on a planted bug (grad_dump.py): rank
    1's gradients doubled before the all-reduce (its loss, so step 1's logged loss, unchanged),
    or each rank's loss not divided by its data-parallel share (gradients and loss 1/2)."""
    run = tmp_path / "run"
    train(run, *TINY, "train.steps=2", nproc=2, env={"LLMSPLIT_MUTATE": mutation, **dump_grads(run)})
    got, want = losses(run), losses(reference)[:2]
    if mutation.startswith("double_grads"):
        assert abs(got[0] - want[0]) <= 1e-5 * want[0]  # what a loss-only comparison would have passed
    with pytest.raises(AssertionError, match="grad norm"):  # the norms alone catch it
        assert_close_losses(Trace(want, got.grad_norms), want)
    with pytest.raises(AssertionError):
        assert_close_losses(got, want)
    with pytest.raises(AssertionError, match=r"^(\d+) of \1 gradients differ; worst "):  # every one of them
        assert_same_gradients(grads_dir(run), grads_dir(reference))


def test_gradient_accumulation_and_compile_give_the_same_loss(reference, tmp_path):
    """2 ranks × 4 sequences each, one sequence per micro-batch: 4 micro-batches per step, each
    block torch.compile'd (train.compile; Inductor on the CPU, a cold compile ~12 s here)."""
    train(tmp_path / "run", *TINY, "train.steps=6", "train.micro_batch=1", "train.compile=true", nproc=2)
    assert_close_losses(losses(tmp_path / "run"), losses(reference))
    # The planner counts what compiling adds to each worker (measured by diagnose/probe.py): the
    # peak was 1.45x its prediction when it did not.
    check = json.loads((tmp_path / "run" / "summary.json").read_text())["plan_check"]
    assert check["warnings"] == [] and 0.8 < check["ratio_peak"] < 1.25, check


def test_runs_inside_torchrun(reference, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "llmsplit", "train", "--run-dir", str(tmp_path / "run")]
    for s in (*TINY, "train.steps=6"):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_losses(losses(tmp_path / "run"), losses(reference))


def test_generate_from_a_run(reference, capsys):
    """In this process (the command's code without four interpreter start-ups)."""
    from llmsplit.cli import main

    def generate(*args: str) -> str:
        assert main(["generate", *args]) == 0
        return capsys.readouterr().out

    a = generate("--model", str(reference), "Hello", "--max-new-tokens", "12")
    b = generate("--model", str(reference / "checkpoints" / "step_6"), "Hello", "--max-new-tokens", "12")
    assert a == b and a.endswith("\n")
    sampled = ["--model", str(reference), "Hi", "--temperature", "1.0", "--top-k", "20", "--top-p", "0.9",
               "--seed", "5", "--max-new-tokens", "12"]
    assert generate(*sampled) == generate(*sampled, "--stream")


def test_python_api_generates_the_cli_greedy_tokens(reference):
    import torch

    import llmsplit

    m = llmsplit.load(str(reference))
    text = m.generate("Hello", max_new_tokens=12)
    cli = run_cli("generate", "--model", str(reference), "Hello", "--max-new-tokens", "12")
    assert cli.stdout == text + "\n"
    ids = torch.tensor([m.tokenizer.encode("Hello world")])
    assert m.logits(ids).shape == (1, 11, 64 * 0 + 264)


def test_two_nodes_on_one_machine_match_one_process(reference, tmp_path):
    """--nnodes/--node-rank/--master-addr/--master-port: two launchers, one worker each."""
    port = str(free_port())
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", port, "--run-dir", str(tmp_path / "run")]
        for s in (*TINY, "train.steps=6"):
            cmd += ["--set", s]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert_close_losses(losses(tmp_path / "run"), losses(reference))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def test_a_failing_worker_is_reported_with_its_rank(tmp_path):
    """A runtime failure inside one worker: exit 1, the rank named, a hint."""
    proc = train(tmp_path / "run", *TINY, nproc=2, check=False, env={"LLMSPLIT_FAULT": "1:2"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "training failed: worker rank 1" in proc.stderr and "hint:" in proc.stderr


def test_the_rank_that_failed_is_named_not_the_one_that_saw_its_peer_go(monkeypatch):
    from types import SimpleNamespace as F

    gone = F(message="RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:7076", exitcode=1,
             timestamp=10)
    own = F(message={"message": "Traceback ...\nRuntimeError: fault injected"}, exitcode=1, timestamp=11)
    assert _root_failure({0: gone, 1: own}) == (1, "RuntimeError: fault injected")
    assert _root_failure({0: gone}) == (0, gone.message)  # nothing better to name
    # Workers come from a forkserver on the CPU, never forked from the launcher's threads.
    monkeypatch.delenv("LLMSPLIT_START_METHOD", raising=False)
    assert start_method() == "forkserver"
    monkeypatch.setenv("LLMSPLIT_START_METHOD", "fork")
    assert start_method() == "fork"


def test_a_truncated_token_file_is_refused_before_any_worker(tmp_path, capsys):
    from llmsplit.cli import main

    tokens = tmp_path / "t.bin"
    (tmp_path / "a.txt").write_text("abc " * 100)
    assert main(["prepare", str(tmp_path / "a.txt"), "--out", str(tokens)]) == 0
    tokens.write_bytes(tokens.read_bytes()[:80])
    capsys.readouterr()
    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                 *[a for s in (*TINY, f"data.source={tokens}") for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and "is truncated" in err and "Traceback" not in err, err


def test_a_killed_worker_is_restarted_and_the_run_ends_with_the_uninterrupted_losses(reference, tmp_path):
    """Checkpoints written in the background (checkpoint.async): step 4's is still under way
    when rank 1 dies at step 5 (a background save completes after the next step at the
    earliest), so the restart takes step 2's, the newest complete one."""
    run = tmp_path / "run"
    proc = train(run, *TINY, "train.steps=6", "checkpoint.every=2", "checkpoint.async=true", nproc=2,
                 extra=("--max-restarts", "2"), env={"LLMSPLIT_FAULT": "1:5:kill"})
    assert "resumed from" in proc.stderr and "step_2" in proc.stderr, proc.stderr[-2000:]
    # One llmsplit line says which worker died and where the restart goes on from.
    restart = "llmsplit: worker rank 1 died (signal SIGKILL); restart 1 of 2 resumes from checkpoint step_2\n"
    assert proc.stderr.count(restart) == 1, proc.stderr[-2000:]
    assert_close_losses(losses(run), losses(reference))


def test_checkpoints_every_so_many_seconds(tmp_path):
    """checkpoint.every_seconds: a save after every step once that long has passed (rank 0's clock)."""
    train(tmp_path / "run", *TINY, "train.steps=3", "checkpoint.every_seconds=1e-9", "checkpoint.keep=5", nproc=1)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]
