"""ZeRO 1/2/3, hybrid sharding, activation checkpointing, mixed precision and offload,
run through the command line on real gloo process groups and compared with one process.

Every run is started at most once per module (`run`), so checks that need the same run
share it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY, assert_close_losses, assert_same_gradients, dump_grads, grads_dir, losses, run_cli, train
from llmsplit.cli import main

STEPS = 5
BASE = [*TINY, f"train.steps={STEPS}"]
# The runs that dump step 1's gradients beside their folders (helpers.grads_dir), compared
# parameter by parameter: ZeRO-3 stands for the sharded layouts.
DUMPS_GRADIENTS = {"one_process", "zero3"}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _model_state(rank: dict) -> int:
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """run(name, *sets, nproc=2, extra=()) -> run folder; each distinct run happens once."""
    root = tmp_path_factory.mktemp("zero")
    done: dict[str, Path] = {}

    def _run(name: str, *sets: str, nproc: int = 2, extra: tuple[str, ...] = ()) -> Path:
        if name not in done:
            env = dump_grads(root / name) if name in DUMPS_GRADIENTS else None
            train(root / name, *BASE, *sets, nproc=nproc, extra=extra, env=env)
            done[name] = root / name
        return done[name]

    _run.root = root
    return _run


@pytest.fixture(scope="module")
def reference(run) -> list[float]:
    return losses(run("one_process", nproc=1))


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("nvme")


LAYOUTS = {
    # name: (workers, settings)
    "zero1": (2, ["parallel.zero=1", "checkpoint.every=2"]),
    "zero2_accumulation": (2, ["parallel.zero=2", "train.micro_batch=1"]),  # 4 micro-batches per rank
    "zero3": (2, ["parallel.zero=3"]),
    "hybrid_2x2": (4, ["parallel.zero=3", "parallel.dp_replicate=2"]),
    "zero3_full_checkpointing": (2, ["parallel.zero=3", "memory.activation_checkpoint=full"]),
    "zero3_selective_checkpointing": (2, ["parallel.zero=3", "memory.activation_checkpoint=selective"]),
    "zero3_cpu_offload": (2, ["parallel.zero=3", "memory.offload=cpu"]),
    "zero2_nvme": (2, ["parallel.zero=2", "memory.offload=nvme", "checkpoint.every=2"]),
    "zero3_nvme": (2, ["parallel.zero=3", "memory.offload=nvme"]),
}


def _layout_run(run, name: str, offload_dir: Path) -> Path:
    nproc, sets = LAYOUTS[name]
    if "memory.offload=nvme" in sets:
        sets = [*sets, f"memory.offload_dir={offload_dir}"]
    return run(name, *sets, nproc=nproc)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_same_loss_as_one_process(run, reference, offload_dir, name):
    run_dir = _layout_run(run, name, offload_dir)
    assert_close_losses(losses(run_dir), reference)
    if name in DUMPS_GRADIENTS:
        assert_same_gradients(grads_dir(run_dir), grads_dir(run.root / "one_process"))
    summary = _summary(run_dir)
    nproc, sets = LAYOUTS[name]
    assert summary["world_size"] == nproc
    layout = summary["layout"]
    for key, value in (s.split("=") for s in sets if s.startswith(("parallel.", "memory.a", "memory.offload="))):
        assert str(layout[key.split(".")[1]]) == value, (key, layout)


@pytest.mark.slow
def test_nvme_keeps_optimizer_state_on_disk(run, offload_dir):
    one = _summary(run("one_process", nproc=1))["per_rank"][0]
    for name in ("zero2_nvme", "zero3_nvme"):
        ranks = _summary(_layout_run(run, name, offload_dir))["per_rank"]
        assert all(r["optim_bytes"] == 0 for r in ranks), ranks
        # Between them the ranks hold the whole of Adam's two moments, on disk.
        assert sum(r["offloaded_bytes"] for r in ranks) == one["optim_bytes"]
        assert all(r["param_bytes"] * 2 == one["param_bytes"] for r in ranks)
    assert list(offload_dir.iterdir()) == [], "the offload files are removed at the end of a run"


@pytest.mark.slow
def test_four_workers_hold_a_quarter_of_the_model_state(run, reference):
    ddp = _summary(run("ddp_4", nproc=4))["per_rank"]
    zero1 = _summary(run("zero1_4", "parallel.zero=1", nproc=4))
    zero3 = _summary(run("zero3_4", "parallel.zero=3", nproc=4))
    for name in ("zero1_4", "zero3_4"):
        assert_close_losses(losses(run.root / name), reference)
    most_ddp_state = max(_model_state(r) for r in ddp)
    assert max(_model_state(r) for r in zero3["per_rank"]) <= 0.26 * most_ddp_state
    most_ddp_optim = max(r["optim_bytes"] for r in ddp)
    assert max(r["optim_bytes"] for r in zero1["per_rank"]) <= 0.26 * most_ddp_optim
    # ZeRO-1 shards only the optimizer state.
    assert [r["param_bytes"] for r in zero1["per_rank"]] == [r["param_bytes"] for r in ddp]


@pytest.mark.slow
@pytest.mark.parametrize("name,sets", [
    ("bf16_zero3", ["parallel.zero=3", "train.precision=bf16"]),
    ("fp16_zero3", ["parallel.zero=3", "train.precision=fp16"]),  # sharded gradients, scaled
    ("fp16_zero1", ["parallel.zero=1", "train.precision=fp16"]),  # autocast + scaler + ZeRO-1
])
def test_low_precision_stays_near_fp32(run, reference, name, sets):
    got = losses(run(name, *sets))
    assert len(got) == STEPS
    for a, b in zip(got, reference):
        assert abs(a - b) <= 2e-2 * abs(b), (got, reference)


@pytest.mark.slow
def test_resume_moves_optimizer_state_between_modes(run, reference, offload_dir):
    """ZeRO-1 (state split by tensor) -> ZeRO-3 with NVMe; NVMe -> ZeRO-1 on 4 workers."""
    zero1 = _layout_run(run, "zero1", offload_dir)
    nvme = _layout_run(run, "zero2_nvme", offload_dir)
    # A stale offload file (a crashed run's) is overwritten, never read.
    (offload_dir / "llmsplit-optim-rank0.bin").write_bytes(b"\xff" * 4096)
    into_nvme = run("resume_zero1_into_zero3_nvme", "parallel.zero=3", "memory.offload=nvme",
                    f"memory.offload_dir={offload_dir}",
                    extra=("--resume", str(zero1 / "checkpoints" / "step_2")))
    into_zero1 = run("resume_nvme_into_zero1_4", "parallel.zero=1", nproc=4,
                     extra=("--resume", str(nvme / "checkpoints" / "step_2")))
    for run_dir in (into_nvme, into_zero1):
        assert_close_losses(losses(run_dir), reference[2:])
    assert list(offload_dir.iterdir()) == []


@pytest.mark.slow
def test_full_checkpointing_lowers_peak_memory(run):
    """A long sequence makes activations dominate; recomputing blocks must show."""
    long = ["model.dim=256", "model.n_layers=6", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_dim=688",
            "model.max_seq_len=512", "data.seq_len=512", "train.global_batch=4", "train.micro_batch=4",
            "train.steps=2"]
    plain = run("long_none", *long, nproc=1)
    full = run("long_full", *long, "memory.activation_checkpoint=full", nproc=1)

    def peak(run_dir):  # the process's high-water mark over the training steps
        return max(json.loads(line)["peak_mem_bytes"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())

    assert_close_losses(losses(full), losses(plain))
    assert peak(full) <= 0.85 * peak(plain), (peak(full), peak(plain))


BAD = [
    (["parallel.zero=4"], 2, "parallel.zero=4 is not one of"),
    (["parallel.zero=3", "parallel.dp_replicate=3"], 4, "not divisible by parallel.dp_replicate=3"),
    (["parallel.zero=1", "parallel.dp_replicate=2"], 4, "needs parallel.zero=2 or 3"),
    (["memory.offload=nvme"], 2, "needs memory.offload_dir"),
    (["memory.offload=nvme", "memory.offload_dir=/no/such/folder"], 2, "is not an existing folder"),
    (["memory.activation_checkpoint=sometimes"], 2, "memory.activation_checkpoint='sometimes' is not one of"),
    (["memory.offload=cpu"], 2, "needs parallel.zero=2 or 3"),
    (["parallel.ep=2"], 2, "parallel.ep=2 splits experts, and this model has none (model.n_experts=0)"),
    (["model.preset=tiny-moe", "parallel.ep=3"], 3, "parallel.ep=3 does not divide model.n_experts=4"),
    (["model.preset=tiny-moe", "parallel.ep=2", "parallel.zero=1"], 2, "parallel.ep=2 does not combine with "
                                                                        "parallel.zero=1"),
    (["train.moe_bias_rate=0.001"], 1, "train.moe_bias_rate=0.001 balances mixture-of-experts layers"),
]


@pytest.mark.parametrize("sets,nproc,fragment", BAD)
def test_bad_input_is_one_sentence_before_any_worker(tmp_path, capsys, sets, nproc, fragment):
    args = ["train", "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "run").exists(), "no worker may have started"


def test_bad_input_through_the_real_command(tmp_path):
    proc = run_cli("train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--set", "memory.offload=nvme",
                   check=False, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        'llmsplit: error: memory.offload="nvme" needs memory.offload_dir set to a writable folder']
