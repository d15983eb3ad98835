"""Checkpoints written under one layout resume under any other and continue exactly;
damaged checkpoints are skipped (`--resume auto`) or refused before any worker starts
(`--resume PATH`); loading never unpickles code. Real gloo process groups, tiny model.

One zero 3 × 2 run of 8 steps (checkpoints every 2 steps, keep 3) is the uninterrupted
reference; every resumed run must log its losses for the steps it runs.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from helpers import assert_close_losses, losses, train
from llmsplit.cli import main

pytestmark = pytest.mark.slow

# Four layers so that two pipeline ranks hold two each.
MP = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
      "data.seq_len=32", "train.global_batch=8", "train.micro_batch=2", "train.steps=8", "train.warmup_steps=2",
      "checkpoint.every=2"]

INTO = {  # name: (workers, settings) of the layouts a zero 3 × 2 checkpoint resumes into
    "one_process": (1, []),
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "zero3x4": (4, ["parallel.zero=3"]),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("source") / "run"
    train(run, *MP, "parallel.zero=3", "checkpoint.keep=3", nproc=2)
    return run


@pytest.fixture(scope="module")
def resumed(source, tmp_path_factory):
    """resumed(name) -> run folder of the zero 3 step-4 checkpoint continued as INTO[name]."""
    root = tmp_path_factory.mktemp("resumed")
    done: dict[str, Path] = {}

    def _resumed(name: str) -> Path:
        if name not in done:
            nproc, sets = INTO[name]
            train(root / name, *MP, *sets, nproc=nproc, extra=("--resume", str(source / "checkpoints" / "step_4")))
            done[name] = root / name
        return done[name]

    return _resumed


def test_keep_holds_only_the_newest_checkpoints(source):
    assert sorted(p.name for p in (source / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]


@pytest.mark.parametrize("name", list(INTO))
def test_a_zero3_checkpoint_continues_exactly_under_another_layout(source, resumed, name):
    run = resumed(name)
    assert_close_losses(losses(run), losses(source)[4:])
    assert json.loads((run / "summary.json").read_text())["world_size"] == INTO[name][0]


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_tp_and_pp_checkpoints_continue_exactly_as_zero3(source, resumed, name, tmp_path):
    # Pipeline ranks each wrote only their stages' tensors; the zero 3 ranks read all of them.
    train(tmp_path / "run", *MP, "parallel.zero=3", nproc=2,
          extra=("--resume", str(resumed(name) / "checkpoints" / "step_6")))
    assert_close_losses(losses(tmp_path / "run"), losses(source)[6:])


def _flip(data: Path, offset: int = 4096, size: int = 4096) -> None:
    """Damage `size` bytes in place, the file's size unchanged (what a bad disk sector or a
    stray write leaves; the loss jumped from 2.78 to 6.09 on the next step when this went
    unnoticed)."""
    with open(data, "r+b") as f:
        f.seek(offset)
        block = f.read(size)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in block))


def test_auto_resume_skips_damaged_checkpoints_and_takes_a_new_layout(source, tmp_path):
    """`--resume auto` continues a run from its own config.toml under --set parallel.tp=2,
    passing over a half-written folder and a checkpoint with 4 KiB flipped inside a data
    file, with a warning each, and over the cut-off last line of metrics.jsonl."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    (run / "summary.json").unlink()
    ck = run / "checkpoints"
    (ck / "step_8").rename(ck / ".step_8.tmp")  # as if the crash came before the rename
    (ck / ".step_8.tmp" / "train_state.json").unlink()
    data = sorted((ck / "step_6").glob("*.distcp"))[-1]
    _flip(data)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 2.7')  # a crash in the middle of a line
    proc = train(run, "parallel.tp=2", nproc=2, extra=("--resume", "auto"))
    assert f"skipping checkpoint {ck / '.step_8.tmp'}: a write that never finished" in proc.stderr
    assert f"skipping checkpoint {ck / 'step_6'}: data file {data.name} was changed or damaged after the save " \
           f"(crc32 " in proc.stderr
    assert f"dropping line 9 of {run / 'metrics.jsonl'}, which is cut off" in proc.stderr
    assert f"resumed from {ck / 'step_4'} at step 4" in proc.stderr
    assert_close_losses(losses(run), losses(source))
    assert json.loads((run / "summary.json").read_text())["layout"]["tp"] == 2


def test_auto_resume_with_every_checkpoint_damaged_stops_and_deletes_nothing(source, tmp_path, capsys):
    """Not a fresh start from step 0 (which replaced metrics.jsonl and let retention delete
    the damaged checkpoints): exit 2, each checkpoint named with what is wrong with it."""
    run = tmp_path / "run"
    shutil.copytree(source, run)
    for ck in (run / "checkpoints").iterdir():
        _flip(sorted(ck.glob("*.distcp"))[0])
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert main(["train", "--run-dir", str(run), "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"llmsplit: error: --resume auto: no checkpoint in "
                                               f"{str(run / 'checkpoints')!r} can be used (step_8: data file "), err
    assert all(f"{name}: data file __0_0.distcp was changed or damaged" in err[0]
               for name in ("step_8", "step_6", "step_4")), err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_generate_and_export_refuse_a_damaged_checkpoint_and_fall_back_from_a_run(source, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(source, run)
    data = sorted((run / "checkpoints" / "step_8").glob("*.distcp"))[0]
    _flip(data)
    named = f"checkpoint {str(run / 'checkpoints' / 'step_8')!r} cannot be used: data file {data.name} was " \
            f"changed or damaged after the save"
    assert main(["generate", "--model", str(run / "checkpoints" / "step_8"), "--max-new-tokens", "2", "hi"]) == 2
    assert named in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_8"), "--to", "hf",
                 str(tmp_path / "hf")]) == 2
    assert named in capsys.readouterr().err and not (tmp_path / "hf").exists()
    # The run folder: its newest good checkpoint, and a word about the one passed over.
    assert main(["export", "--checkpoint", str(run), "--to", "hf", str(tmp_path / "hf")]) == 0
    assert f"skipping checkpoint {run / 'checkpoints' / 'step_8'}: data file {data.name}" in capsys.readouterr().err


def _damaged(source: Path, tmp_path: Path, how: str) -> Path:
    ck = tmp_path / "step_4"
    shutil.copytree(source / "checkpoints" / "step_4", ck)
    if how == "truncated":
        data = sorted(ck.glob("*.distcp"))[0]
        data.write_bytes(data.read_bytes()[:1000])
    elif how == "no_marker":
        (ck / "train_state.json").unlink()
    elif how == "half_metadata":
        (ck / ".metadata").write_bytes((ck / ".metadata").read_bytes()[:300])
    elif how == "missing_data":
        sorted(ck.glob("*.distcp"))[-1].unlink()
    elif how == "flipped":
        _flip(sorted(ck.glob("*.distcp"))[0])
    elif how in ("outside", "absolute"):
        _point_data_at(ck, "../../outside.distcp" if how == "outside" else "/etc/passwd")
    return ck


def _point_data_at(ck: Path, name: str) -> None:
    """Rewrite the checkpoint's metadata so that its first data file is `name`."""
    import dataclasses

    from llmsplit.io.dcp_files import read_metadata

    metadata = read_metadata(ck)
    first = min(metadata.storage_data, key=str)
    metadata.storage_data[first] = dataclasses.replace(metadata.storage_data[first], relative_path=name)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("how,fragment", [
    ("truncated", "is truncated (1000 bytes, the metadata needs"),
    ("no_marker", "it has no train_state.json (the write did not finish)"),
    ("half_metadata", "its .metadata cannot be read"),
    ("missing_data", "is missing"),
    ("flipped", "was changed or damaged after the save (crc32 "),
    ("outside", ".metadata names the data file '../../outside.distcp', which is not a file inside the checkpoint"),
    ("absolute", ".metadata names the data file '/etc/passwd', which is not a file inside the checkpoint folder"),
])
def test_resuming_a_damaged_checkpoint_is_refused_before_any_worker(source, tmp_path, capsys, how, fragment):
    ck = _damaged(source, tmp_path, how)
    args = ["train", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--resume", str(ck)]
    assert main(args + [x for s in MP for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {str(ck)!r} cannot be used: " in err[0] and fragment in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change,fragment", [
    ("model.ffn_dim=96", "tensor layers.0.feed_forward.w1.weight is [128, 64] in the file but the config's sizes "
                         "make it [96, 64]"),
    ("model.n_layers=2", "model.n_layers is 2 but the file holds the tensors of 4 layers"),
])
def test_a_checkpoint_of_another_model_names_the_first_mismatching_tensor(source, tmp_path, capsys, change,
                                                                           fragment):
    args = ["train", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
            "--resume", str(source / "checkpoints" / "step_4")]
    assert main(args + [x for s in (*MP, change) for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not of this model: " + fragment in err[0], err


def _tokenizer_of_258(path: Path) -> Path:
    """A tokenizer.json with as many tokens as the byte tokenizer (258) and other ids for
    them: two special tokens first, then the 256 byte symbols."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["ab"], trainers.BpeTrainer(vocab_size=258, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(str(path))
    return path


@pytest.mark.parametrize("change,fragment", [
    ("data.seq_len=16", "data.seq_len 32 then, 16 now"),
    ("train.global_batch=4", "train.global_batch 8 then, 4 now"),
    ("train.seed=7", "train.seed 0 then, 7 now"),
    ("data.source=text:{tmp}/*.txt", "data.source 'builtin' then, 'text:{tmp}/*.txt' (files 1, content "),
    ("data.tokenizer={tmp}/tokenizer.json", "data.tokenizer 'byte' (fingerprint byte) then, "
                                            "'{tmp}/tokenizer.json' (fingerprint sha256:"),
])
def test_a_resume_on_other_inputs_is_refused_with_the_old_and_new_values(source, tmp_path, capsys, change,
                                                                         fragment):
    """train_state.json records what the checkpoint was trained on; a resume that changes it
    is refused before any worker starts (the byte tokenizer swapped for another of 258
    tokens took the loss from 2.78 to 10.47 when this was accepted)."""
    (tmp_path / "a.txt").write_text("some other text to train on. " * 40)
    tokenizer = _tokenizer_of_258(tmp_path / "tokenizer.json")
    from llmsplit.io.tokenizer import load_tokenizer

    assert load_tokenizer(str(tokenizer)).vocab_size == load_tokenizer("byte").vocab_size
    ck = source / "checkpoints" / "step_4"
    args = ["train", "--nproc", "1", "--run-dir", str(tmp_path / "run"), "--resume", str(ck)]
    assert main(args + [x for s in (*MP, change.format(tmp=tmp_path)) for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {str(ck)!r} was trained on other inputs: " in err[0], err
    assert fragment.format(tmp=tmp_path) in err[0] and "pass --resume-changed to continue" in err[0], err
    assert not (tmp_path / "run").exists()


def test_resume_changed_continues_on_other_inputs_and_the_summary_says_so(source, tmp_path):
    run = tmp_path / "run"
    proc = train(run, *MP, "train.seed=1", nproc=1,
                 extra=("--resume", str(source / "checkpoints" / "step_6"), "--resume-changed"))
    assert "--resume-changed: continuing" in proc.stderr and "with train.seed 0 then, 1 now" in proc.stderr
    assert json.loads((run / "summary.json").read_text())["resumed_with_changes"] == {
        "train.seed": {"then": 0, "now": 1}}
    assert len(losses(run)) == 2  # steps 7 and 8
    # What it continued with is what its own checkpoint records: resuming that needs no flag.
    assert json.loads((run / "checkpoints" / "step_8" / "train_state.json").read_text())["data"]["seed"] == 1


class _Payload:
    """Unpickling this would create `flag` (os.system), as a hostile checkpoint could."""

    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.flag}",)


def test_a_checkpoint_whose_metadata_would_run_code_is_refused_unread(source, tmp_path, capsys):
    ck = _damaged(source, tmp_path, "none")
    flag = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(_Payload(flag)))
    args = ["train", "--nproc", "1", "--run-dir", str(tmp_path / "run"), "--resume", str(ck)]
    assert main(args + [x for s in MP for x in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert "refers to posix.system, which a checkpoint never contains" in err, err
    assert not flag.exists()


def test_resume_of_nothing_is_refused(tmp_path, capsys):
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--resume", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
