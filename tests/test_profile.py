"""`llmsplit train --profile N`: traces per rank, the compute / communication / idle split,
and the straggler and pipeline-balance warnings."""

import json

import pytest

from helpers import TINY, train
from llmsplit.cli import main
from llmsplit.train.profile import pipeline_imbalance, profiled_steps, split_time, stragglers


def test_profiled_steps_skip_the_warm_up_step_when_they_can():
    assert list(profiled_steps(2, 0, 4)) == [2, 3]
    assert list(profiled_steps(2, 0, 2)) == [1, 2]
    assert list(profiled_steps(5, 0, 3)) == [1, 2, 3]
    assert list(profiled_steps(2, 3, 10)) == [5, 6]  # resumed at step 3
    assert list(profiled_steps(0, 0, 10)) == []


def test_split_time_counts_overlapped_communication_as_compute():
    # window 0..100: compute 10..40 and 50..60; communication 30..70 (overlaps both) and 90..95
    split = split_time([(10, 40), (50, 60)], [(30, 70), (90, 95)], (0, 100))
    assert split == {"wall_s": 100, "compute_s": 40, "comm_s": 20 + 5, "idle_s": 35}
    # intervals outside the window are clipped away
    assert split_time([(-10, 5)], [(95, 200)], (0, 100))["idle_s"] == 90


def _rows(works):
    """One row per rank; each step has a wall time of 1.0, the rest waiting in communication."""
    return [{"rank": r, "steps": [{"step": i + 1, "wall_s": 1.0, "compute_s": w, "comm_s": 1.0 - w, "idle_s": 0.0}
                                  for i, w in enumerate(ws)]} for r, ws in enumerate(works)]


def test_a_rank_slower_in_every_step_is_a_straggler():
    assert stragglers(_rows([[0.5, 0.5], [0.9, 0.8], [0.5, 0.55]])) == [1]
    assert stragglers(_rows([[0.5, 0.9], [0.9, 0.5]])) == []  # slower once each: not consistent
    assert stragglers(_rows([[0.5, 0.5], [0.55, 0.56]])) == []  # within 20%
    assert stragglers(_rows([[0.5]])) == []


def test_pipeline_imbalance():
    assert pipeline_imbalance([0.5, 0.5]) == pytest.approx(0.0)
    assert pipeline_imbalance([0.4, 0.6]) == pytest.approx(0.5)
    assert pipeline_imbalance(None) is None


def test_profile_steps_must_be_positive(capsys):
    assert main(["train", "--profile", "0"]) == 2
    assert "--profile" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_two_steps_on_two_workers_writes_traces_and_the_table(tmp_path):
    sets = [s for s in TINY if not s.startswith("train.steps")] + ["train.steps=3"]
    proc = train(tmp_path / "run", *sets, nproc=2, extra=("--profile", "2"), timeout=240)
    out = tmp_path / "run" / "profile"
    for rank in (0, 1):
        trace = json.loads((out / f"rank{rank}.pt.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert {"llmsplit::step 2", "llmsplit::step 3"} <= names
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == [2, 3]
    assert [r["rank"] for r in summary["per_rank"]] == [0, 1]
    for r in summary["per_rank"]:
        assert r["compute_s"] > 0 and r["comm_s"] > 0  # DDP's all-reduce on gloo's threads
        assert r["compute_s"] + r["comm_s"] + r["idle_s"] == pytest.approx(r["wall_s"])
    assert "communication" in proc.stdout and "idle" in proc.stdout
