"""`llmsplit.train(...)` as a library call returns its run as data.

The runs here are one rank "inside torchrun" (its environment set in this process), so
the worker is this very process: no process start, a couple of seconds a run.
"""

import json

import pytest
import torch

import llmsplit
from helpers import TINY
from llmsplit.config import ConfigError, load_config
from llmsplit.launch import free_port
from llmsplit.api import TrainingFailed


@pytest.fixture
def one_rank(monkeypatch):
    """This process as rank 0 of a 1-rank torchrun job."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # the worker sets its own


def test_train_returns_the_run_as_a_result_object(tmp_path, one_rank):
    run = tmp_path / "run"
    result = llmsplit.train(None, run_dir=run, overrides=[*TINY, "train.steps=2"])
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    on_disk = json.loads((run / "summary.json").read_text())
    assert result.run_dir == run
    assert [m["step"] for m in metrics] == [1, 2]
    assert result.final_loss == metrics[-1]["loss"] == on_disk["final_loss"]
    assert result.micro_batch == 2  # TINY's train.micro_batch, which this run kept
    (rank,) = result.per_rank
    # fp32 weights and gradients, two fp32 Adam moments: 4 + 4 + 8 bytes per parameter.
    params = result.summary["params"]
    assert (rank["param_bytes"], rank["grad_bytes"], rank["optim_bytes"]) == (4 * params, 4 * params, 8 * params)
    assert result.plan_check == on_disk["plan_check"] == result.summary["plan_check"]
    assert result.plan_check["measured_peak_bytes"] == rank["peak_mem_bytes"]


def test_a_config_object_is_trained_as_given_and_left_unchanged(tmp_path, one_rank):
    cfg = load_config(None, [*TINY, "train.steps=1"])
    before = cfg.to_dict()
    result = llmsplit.train(cfg, run_dir=tmp_path / "run", overrides=["train.micro_batch=4"])
    assert cfg.to_dict() == before
    assert result.micro_batch == 4 and result.summary["steps"] == 1


def test_a_run_over_its_memory_limit_raises_with_the_figures_and_the_explanation(tmp_path, one_rank):
    limit = 64 * 2**20  # below what any worker needs before its first tensor
    with pytest.raises(TrainingFailed) as caught:
        llmsplit.train(None, run_dir=tmp_path / "run", overrides=[*TINY, "train.steps=1",
                                                                 f"memory.limit_bytes={limit}"])
    failure = caught.value.out_of_memory
    assert failure["rank"] == 0 and failure["limit_bytes"] == limit and failure["where"] == "step 1"
    assert failure["peak_bytes"] > limit and failure["source"] == "memory.limit_bytes"
    report = caught.value.explanation
    assert str(caught.value) == report["text"] and "total" in report["breakdown"]
    assert "--set" in caught.value.hint


def test_arguments_that_cannot_work_are_refused_before_any_worker():
    with pytest.raises(ConfigError, match="--nproc 0 must be at least 1"):
        llmsplit.train(None, nproc=0)
    with pytest.raises(ConfigError, match="--resume auto needs --run-dir"):
        llmsplit.train(None, resume="auto")
    with pytest.raises(ConfigError, match="--overwrite needs --run-dir"):
        llmsplit.train(None, overwrite=True)
    with pytest.raises(ConfigError, match="--overwrite starts --run-dir over from step 0 and cannot go with "
                                          "--resume auto; pass --resume none --overwrite, or drop --overwrite"):
        llmsplit.train(None, run_dir="runs/never-made", resume="auto", overwrite=True)
