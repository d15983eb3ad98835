"""Tensor and pipeline parallel, alone and combined with data parallel, through the CLI
on real gloo groups: every layout logs the single-process loss at every step."""

import json

import pytest

from helpers import assert_close_losses, losses, train

pytestmark = pytest.mark.slow

# Four layers so that two pipeline ranks can hold two stages each.
MP = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
      "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("mpref") / "run"
    train(run, *MP, "train.micro_batch=8", nproc=1)
    return losses(run)


LAYOUTS = [
    # tp=2 with sequence parallel and pp=2 with 1f1b run in the per-rank tests below.
    (2, ["parallel.tp=2", "parallel.sequence_parallel=false"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv"]),
    (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev"]),
    (4, ["parallel.tp=2"]),                                   # dp 2 × tp 2 (DDP)
    (4, ["parallel.tp=2", "parallel.zero=3"]),                # FSDP × TP
    (4, ["parallel.pp=2", "parallel.tp=2"]),                  # PP × TP
    (4, ["parallel.pp=2", "parallel.zero=3"]),                # PP × FSDP
    # Split backward × FSDP: parameters must stay gathered until the weight-gradient pass.
    (4, ["parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.zero=3"]),
    (4, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.zero=3", "train.micro_batch=1"]),
    (4, ["parallel.pp=2", "parallel.zero=1"]),                # PP × ZeRO-1
    (4, ["parallel.pp=4", "parallel.pp_schedule=1f1b"]),      # one layer per stage
    (4, ["parallel.pp=2", "parallel.tp=2", "memory.activation_checkpoint=full"]),
]


@pytest.mark.parametrize("nproc, sets", LAYOUTS, ids=[f"{n}-" + ",".join(s.split(".")[1] for s in sets)
                                                     for n, sets in LAYOUTS])
def test_layout_logs_the_single_process_loss(reference, tmp_path, nproc, sets):
    train(tmp_path / "run", *MP, *sets, nproc=nproc)
    assert_close_losses(losses(tmp_path / "run"), reference)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    layout = summary["layout"]
    for s in sets:
        key, value = s.split("=")
        if key.split(".")[1] in layout:
            assert str(layout[key.split(".")[1]]) == value


def test_tp4_replicates_the_two_kv_heads(reference, tmp_path):
    # MP has 2 kv heads for 4 query heads: at tp 4 each kv head lives on two ranks, and the
    # copies must get the summed gradient to stay equal (a wrong sum drifts from step 2 on).
    train(tmp_path / "run", *MP, "parallel.tp=4", nproc=4)
    assert_close_losses(losses(tmp_path / "run"), reference)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"]["tp"] == 4


def test_pipeline_ranks_hold_only_their_stages(reference, tmp_path):
    train(tmp_path / "run", *MP, "parallel.pp=2", nproc=2)
    assert_close_losses(losses(tmp_path / "run"), reference)
    bubble = json.loads((tmp_path / "run" / "summary.json").read_text())["pipeline"]
    assert bubble["schedule"] == "1f1b" and bubble["microbatches"] == 4
    assert bubble["formula_bubble"] == pytest.approx(1 / 5) and bubble["unit_cost_bubble"] == pytest.approx(1 / 5)
    assert 0.0 < bubble["theoretical_bubble"] < 1.0  # the time line with each step's action times
    assert 0.0 < bubble["median_cost_bubble"] < 1.0
    assert len(bubble["theoretical_bubble_per_step"]) == len(bubble["measured_bubble_per_step"])
    assert {"0:F", "0:B", "1:F", "1:B"} <= set(bubble["action_seconds"])
    assert 0.0 <= bubble["measured_bubble"] < 1.0 and len(bubble["measured_bubble_per_step"]) >= 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    full = 4 * summary["params"]
    first, last = summary["per_rank"]
    assert first["param_bytes"] + last["param_bytes"] == full  # every weight on exactly one rank
    assert 0.35 * full < first["param_bytes"] < 0.65 * full


def test_tensor_parallel_halves_the_weights_each_rank_holds(reference, tmp_path):
    train(tmp_path / "run", *MP, "parallel.tp=2", nproc=2)
    assert_close_losses(losses(tmp_path / "run"), reference)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    full = 4 * summary["params"]
    for r in summary["per_rank"]:
        # Everything but the norms is split: a little over half the fp32 weights per rank.
        assert 0.5 * full <= r["param_bytes"] <= 0.52 * full, (r, full)


@pytest.mark.parametrize("sets, fragment", [
    (["parallel.tp=2", "model.n_heads=3", "model.n_kv_heads=3", "model.dim=48"],
     "parallel.tp=2 does not divide model.n_heads=3; use parallel.tp in 1, 3"),
    (["parallel.tp=2", "model.n_heads=6", "model.n_kv_heads=3", "model.dim=48"],
     "model.n_kv_heads=3 is neither divisible by nor a divisor of parallel.tp=2; use parallel.tp in 1, 3, 6"),
    (["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.pp_virtual_stages=2"], "needs parallel.pp_schedule"),
    (["parallel.pp=2", "parallel.pp_schedule=chimera"], "parallel.pp_schedule='chimera' is not one of"),
    (["parallel.pp=2", "model.n_layers=1"], "model.n_layers=1 is fewer than"),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=3"], "model.n_layers=4 is fewer than"),
    (["parallel.pp=2", "parallel.pp_microbatches=1"], "parallel.pp_microbatches=1"),
    # Issue 16's first defect: this passed validation, then gloo aborted every worker.
    (["parallel.tp=2", "data.seq_len=33"], "data.seq_len=33 is not divisible by parallel.tp=2"),
])
def test_layouts_that_do_not_divide_are_refused_before_workers_start(tmp_path, capsys, sets, fragment):
    # In-process: the console script's main(), without an interpreter start-up per case.
    from llmsplit.cli import main

    code = main(["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                 *[a for s in (*MP, *sets) for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
