"""A rank that stops answering: the others time out after train.timeout_s and the report
names the rank that did not arrive (real gloo process groups)."""

from __future__ import annotations

import pytest

from helpers import TINY, train
from llmsplit.cli import main


@pytest.mark.slow
def test_a_hung_rank_is_named_when_the_collective_times_out(tmp_path):
    proc = train(tmp_path / "run", *TINY, "train.timeout_s=4", nproc=2, check=False,
                 env={"LLMSPLIT_FAULT": "1:2:hang"}, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.startswith("llmsplit: training failed:")]
    assert len(last) == 1, proc.stderr[-3000:]
    assert "a collective timed out after 4s (train.timeout_s) on rank 0 during step 2" in last[0]
    assert "rank(s) 1 did not arrive" in last[0]


def test_the_timeout_must_be_positive(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--set", "train.timeout_s=0"]) == 2
    assert "train.timeout_s=0.0 must be greater than 0 (seconds)" in capsys.readouterr().err
