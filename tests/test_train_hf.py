"""Fine-tuning a Hugging Face folder (`model.hf`): every layout starts from its weights and
computes the loss transformers computes on the same batch."""

import pytest

from helpers import assert_close_losses, losses, run_cli, train
from hf_models import make_hf_folder, transformers_loss

pytestmark = pytest.mark.slow

# A from-scratch lr (not the fine-tuning default) so that one step visibly lowers the loss.
SETS = ["data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=3", "train.warmup_steps=1",
        "train.lr=3e-3"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def one_process(folder, tmp_path_factory):
    run = tmp_path_factory.mktemp("hf1") / "run"
    train(run, f"model.hf={folder}", *SETS, nproc=1)
    return losses(run)


def test_step_one_loss_is_the_transformers_loss(folder, one_process):
    want = transformers_loss(folder)
    assert abs(one_process[0] - want) <= 1e-5 * want, (one_process[0], want)
    assert one_process[-1] < one_process[0]  # and it trains


# FSDP × TP on 4 workers covers both sharded loaders (dp and tp slices) at once.
@pytest.mark.parametrize("nproc, layout", [(4, ["parallel.zero=3", "parallel.tp=2"]), (2, ["parallel.pp=2"])])
def test_a_layout_fine_tunes_as_one_process_does(folder, one_process, tmp_path, nproc, layout):
    """Every step, not only the first: loss and gradient norm equal one process's."""
    train(tmp_path / "run", f"model.hf={folder}", *SETS, *layout, nproc=nproc)
    assert_close_losses(losses(tmp_path / "run"), one_process)


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_cli("train", "--run-dir", str(tmp_path / "run"), "--set", f"model.hf={tmp_path / 'empty'}",
                   check=False, timeout=60)
    assert proc.returncode == 2 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()
