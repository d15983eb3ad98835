"""A run folder is used by one run at a time, a full disk is named as such, retention never
keeps a stale checkpoint over the one just written, a cut-off metrics line does not stop a
resume, a resume notices other inputs than the checkpoint's, and a run folder's record is
never overwritten (issue 21 items 3, 4, 5, 8; issue 22 item 4; issue 52 item 4). The
checksum, path and resume-refusal cases that need a trained checkpoint are in
test_checkpoint_resume.py, next to the run they damage."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import TINY, train
from llmsplit.cli import main
from llmsplit.config import load_config
from llmsplit.io.disk_full import NoSpaceLeft
from llmsplit.io.run_dir import checkpoint_problem
from llmsplit.models.llama import LlamaConfig, Transformer
from llmsplit.train.checkpoint import save_checkpoint
from llmsplit.train.resume_check import resume_changes, run_inputs
from llmsplit.train.run_files import MetricsLog


@pytest.fixture
def one_rank():
    """A one-process gloo group in this process: checkpoints saved here take the trainer's path."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=64, ffn_dim=64,
                                    max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()  # optimizer state to save
    yield model, optimizer
    dist.destroy_process_group()


def test_retention_keeps_the_new_checkpoint_whatever_later_ones_there_are(one_rank, tmp_path):
    """A run resumed from step 2 because step_10 was damaged must not have retention
    (keep=1) delete its fresh step_4 and keep only the damaged step_10."""
    model, optimizer = one_rank
    ck = tmp_path / "checkpoints"
    save_checkpoint(ck, 2, model, optimizer, {"step": 2}, keep=3)
    shutil.copytree(ck / "step_2", ck / "step_10")
    damaged = sorted((ck / "step_10").glob("*.distcp"))[0]
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 64)
    save_checkpoint(ck, 4, model, optimizer, {"step": 4}, keep=1)
    assert sorted(p.name for p in ck.iterdir()) == ["step_10", "step_4"]
    assert checkpoint_problem(ck / "step_4") is None
    assert "was changed or damaged after the save" in checkpoint_problem(ck / "step_10")


def test_a_save_that_never_finished_is_no_checkpoint_to_keep(tmp_path):
    """`--resume auto` counts no `.step_N.tmp` among the checkpoints it refuses to lose: one
    alone (a crash or a full disk during the first save) is not a checkpoint."""
    from llmsplit.errors import ConfigError
    from llmsplit.io.run_dir import usable_checkpoint

    (tmp_path / ".step_4.tmp").mkdir()
    assert usable_checkpoint(tmp_path)[0] is None
    (tmp_path / "step_2").mkdir()  # no marker, no metadata: a checkpoint that cannot be used
    with pytest.raises(ConfigError, match=r"no checkpoint in .* can be used \(\.step_4\.tmp: a write that never "
                                          r"finished; step_2: it has no \.metadata"):
        usable_checkpoint(tmp_path)


@pytest.mark.parametrize("failure", ["enospc", "zip_writer"])
def test_a_full_disk_while_saving_names_the_checkpoint_folder(one_rank, tmp_path, monkeypatch, failure):
    """ENOSPC as Python raises it, and torch's zip writer's own RuntimeError on a disk that
    has filled up, both end as "no space left on device at PATH"."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import llmsplit.io.disk_full

    def full(*args, **kwargs):
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    if failure == "zip_writer":
        monkeypatch.setattr(llmsplit.io.disk_full, "free_bytes", lambda path: 0)
    model, optimizer = one_rank
    with pytest.raises(NoSpaceLeft) as caught:
        save_checkpoint(tmp_path / "checkpoints", 3, model, optimizer, {"step": 3}, keep=3)
    assert str(caught.value).startswith(f"no space left on device at {tmp_path / 'checkpoints' / '.step_3.tmp'} "
                                        f"(saving the checkpoint of step 3)")
    assert not (tmp_path / "checkpoints" / "step_3").exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_while_logging_names_metrics_jsonl(tmp_path):
    log = MetricsLog(tmp_path, 0, 4, 1)
    log.file.close()
    log.file = open("/dev/full", "a")  # every write the kernel refuses with ENOSPC
    with pytest.raises(NoSpaceLeft, match=f"no space left on device at {tmp_path / 'metrics.jsonl'} "
                                          r"\(logging step 1\)"):
        log.add({"step": 1, "loss": 1.0})


def test_a_cut_off_metrics_line_is_dropped_with_a_warning_on_resume(tmp_path, capsys):
    lines = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')
    MetricsLog(tmp_path, 2, 8, 1).close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]
    assert "dropping line 4 of" in capsys.readouterr().err


def _cfg(*sets: str):
    return load_config(None, list(sets))


def _tokenizer(path: Path, part: slice) -> Path:
    """A byte-level BPE tokenizer.json of 300 tokens trained on `part` of Python's own
    documentation: the same size for every part, other merges and ids for another."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(list(topics.values())[part], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def test_resume_knows_a_tokenizer_by_content_not_by_name(tmp_path, monkeypatch):
    first = _tokenizer(tmp_path / "a" / "tokenizer.json", slice(0, 40))
    other = _tokenizer(tmp_path / "b" / "tokenizer.json", slice(40, 80))
    from llmsplit.io.tokenizer import load_tokenizer

    assert load_tokenizer(str(first)).vocab_size == load_tokenizer(str(other)).vocab_size  # only the content differs
    trained = _cfg(f"data.tokenizer={first}")
    state = {"data": {"seq_len": trained.data.seq_len, "global_batch": trained.train.global_batch,
                      "seed": trained.train.seed}, "inputs": run_inputs(trained)}
    monkeypatch.chdir(tmp_path)
    # The same file named relatively, and a copy elsewhere: the same tokenizer.
    assert resume_changes(state, _cfg("data.tokenizer=a/tokenizer.json")) == {}
    shutil.copy(first, tmp_path / "copy.json")
    assert resume_changes(state, _cfg("data.tokenizer=copy.json")) == {}
    changes = resume_changes(state, _cfg(f"data.tokenizer={other}", "data.seq_len=64"))
    assert sorted(changes) == ["data.seq_len", "data.tokenizer"]
    assert changes["data.seq_len"] == {"then": trained.data.seq_len, "now": 64}
    assert changes["data.tokenizer"]["then"]["name"] == str(first)


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_one_run_per_folder_and_its_record_is_never_overwritten(tmp_path, capsys):
    """A run in progress (held at its first step) locks its folder: a second run and a
    `--resume auto` of it exit 2 naming the holder, and nothing of the first is touched.
    Killed (-9), it leaves a lock file naming a dead process, which does not hold the
    folder; having never finished a step, the folder takes a new run. That run finished,
    its checkpoints lost, neither `--resume auto` (it started at step 0 over metrics.jsonl
    and summary.json) nor `--resume none` starts it over; `--overwrite` does, and the old
    run is found in previous/<time>/ byte for byte."""
    run = tmp_path / "run"
    args = ["train", "--nproc", "1", "--run-dir", str(run), *[a for s in TINY for a in ("--set", s)]]
    with open(tmp_path / "first.err", "w") as err_file:
        first = subprocess.Popen([sys.executable, "-m", "llmsplit", *args], start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=err_file,
                                 env=dict(os.environ, LLMSPLIT_FAULT="0:1:hang"))
    try:
        _wait_for(lambda: (run / "metrics.jsonl").is_file(), 120, "the first run to reach its first step")
        config = (run / "config.toml").read_text()
        for extra in ([], ["--resume", "auto"]):
            assert main(args + extra) == 2
            err = capsys.readouterr().err
            assert f"--run-dir {str(run)!r} is in use by another run (process {first.pid} on " in err, err
        assert (run / "config.toml").read_text() == config and (run / "metrics.jsonl").read_text() == ""
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the launcher and its worker
        first.wait()
    assert json.loads((run / ".lock").read_text())["pid"] == first.pid  # stale: its process is gone
    proc = train(run, *TINY, "train.steps=1")
    assert "holds a run that never finished a step; starting it again" in proc.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 1

    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    (run / "tensorboard").mkdir()  # stands for train.tensorboard's event files
    (run / "tensorboard" / "events.out").write_bytes(b"old events")
    record = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    assert {Path("metrics.jsonl"), Path("summary.json"), Path("config.toml")} <= set(record)
    for extra, said in ((["--resume", "auto"], f"--resume auto: --run-dir {str(run)!r} holds a run but no checkpoint "
                         f"in {str(run / 'checkpoints')!r} to continue it from; pass another --run-dir for a new run, "
                         f"or --resume none --overwrite to start this one over (the old run is moved into "
                         f"{str(run / 'previous')!r})"),
                        ([], f"--run-dir {str(run)!r} already holds a run; pass --resume auto to continue it, "
                         f"--overwrite to start it over (the old run is moved into {str(run / 'previous')!r}), or "
                         f"another --run-dir")):
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"llmsplit: error: {said}"], err
        assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"} \
            == record
    proc = train(run, *TINY, "train.steps=2", extra=("--overwrite",))
    [moved] = (run / "previous").iterdir()
    assert f"llmsplit: --overwrite: moved the run that {run} held into {moved}; starting it over" in proc.stderr
    assert {p.relative_to(moved): p.read_bytes() for p in moved.rglob("*") if p.is_file()} == record
    assert json.loads((run / "summary.json").read_text())["steps"] == 2
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]
    assert not (run / "tensorboard").exists()


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_in_a_worker_is_the_failure_line(tmp_path):
    """summary.json on a disk the kernel reports full (/dev/full): the worker's own error,
    naming the path, is the line that says why the run failed."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").symlink_to("/dev/full")
    proc = train(run, *TINY, "train.steps=1", check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    failed = [line for line in proc.stderr.splitlines() if line.startswith("llmsplit: training failed")]
    assert failed == [f"llmsplit: training failed: worker rank 0 failed: NoSpaceLeft: no space left on device at "
                      f"{run / 'summary.json'} (writing the run's summary); free space on that disk or write the "
                      f"run elsewhere (--run-dir, checkpoint.dir)"], proc.stderr[-2000:]
    assert "has room again, `--resume auto --run-dir" in proc.stderr
    assert "To enable traceback" not in proc.stderr


@pytest.mark.slow
def test_a_full_temporary_folder_is_named_with_the_workers_failure(tmp_path, monkeypatch):
    """torch keeps each worker's error in a file under the temporary folder; when that disk
    is full (here: said so by a patched free-space probe in the launching process) the
    failure names the folder as well as what the worker reported."""
    import tempfile

    import llmsplit
    import llmsplit.io.disk_full
    from llmsplit.api import TrainingFailed

    tmp, measured = tempfile.gettempdir(), llmsplit.io.disk_full.free_bytes
    monkeypatch.setattr(llmsplit.io.disk_full, "free_bytes", lambda path: 0 if str(path) == tmp else measured(path))
    monkeypatch.setenv("LLMSPLIT_FAULT", "0:1")
    with pytest.raises(TrainingFailed) as caught:
        llmsplit.train(None, nproc=1, run_dir=tmp_path / "run", overrides=TINY)
    assert str(caught.value) == (f"worker rank 0 failed: RuntimeError: fault injected by LLMSPLIT_FAULT=0:1; no "
                                 f"space left on device at {tmp}, where torch records the workers' errors")
    assert caught.value.hint.startswith("free space there (or set TMPDIR to a disk with room)")
