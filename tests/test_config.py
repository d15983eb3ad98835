import pytest

from llmsplit.config import (ConfigError, config_from_toml, load_config, model_config, record_model_sizes, to_toml,
                             validate)

from helpers import run_cli


def test_defaults_validate_on_two_workers():
    cfg = load_config()
    validate(cfg, 2, model_config(cfg, 258), 258)
    assert cfg.parallel.dp == 2 and cfg.parallel.sequence_parallel is False


def test_overrides_coerce_types_and_round_trip_through_toml(tmp_path):
    cfg = load_config(None, ["train.steps=7", "train.lr=1e-3", "train.deterministic=true", "model.dim=128",
                             "data.tokenizer=byte", "parallel.dp=-1", "train.lr=2"])
    assert cfg.train.steps == 7 and cfg.train.deterministic is True and cfg.model.dim == 128
    assert cfg.train.lr == 2.0 and isinstance(cfg.train.lr, float)  # the last override wins, int → float
    back = config_from_toml(to_toml(cfg))
    assert back == cfg
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path, ["train.steps=9"]).train.steps == 9


def test_explicit_sizes_override_the_preset():
    cfg = load_config(None, ["model.n_heads=4"])
    mc = model_config(cfg, 258)
    assert mc.n_heads == 4 and mc.n_kv_heads == 4 and mc.dim == 256


def test_a_recorded_config_keeps_head_dim_derived_unless_the_model_chose_its_own():
    """A run's config.toml records every resolved size; head_dim only where it is not
    dim // n_heads, so a copy edited to another n_heads builds heads of the new size."""
    cfg = load_config()
    record_model_sizes(cfg, model_config(cfg, 258))
    assert cfg.model.dim == 256 and cfg.model.head_dim is None
    edited = config_from_toml(to_toml(cfg).replace("n_heads = 8", "n_heads = 4"))
    assert model_config(edited, 258).head_dim == 64
    own = load_config(None, ["model.head_dim=16"])
    record_model_sizes(own, model_config(own, 258))
    assert config_from_toml(to_toml(own)).model.head_dim == 16


@pytest.mark.parametrize("sets, world, fragment", [
    (["train.steps=abc"], 2, "train.steps must be an integer"),
    (["train.bogus=1"], 2, "unknown config key 'train.bogus'"),
    (["nosection.x=1"], 2, "unknown config key 'nosection.x'"),
    (["train.steps=0"], 2, "train.steps=0 must be at least 1"),
    (["train.lr=-1"], 2, "train.lr=-1.0 must be greater than 0"),
    (["train.precision=fp8"], 2, "train.precision='fp8' is not one of"),
    (["parallel.pp_schedule=magic"], 2, "parallel.pp_schedule='magic' is not one of"),
    (["memory.activation_checkpoint=some"], 2, "memory.activation_checkpoint='some' is not one of"),
    (["parallel.zero=5"], 2, "parallel.zero=5 is not one of"),
    (["train.global_batch=6"], 4, "train.global_batch=6 is not divisible by parallel.dp × train.micro_batch"),
    (["parallel.dp=3"], 2, "parallel.dp × tp × pp = 3×1×1 = 3 but the world size is 2"),
    (["parallel.tp=3"], 2, "world size 2 is not divisible by parallel.tp × parallel.pp"),
    (["model.n_heads=6"], 2, "model.dim 256 is not a multiple of model.n_heads 6"),
    (["model.n_kv_heads=3"], 2, "model.n_heads 8 is not a multiple of model.n_kv_heads 3"),
    (["model.n_layers=1000000000"], 2, "model.n_layers is 1000000000, more layers than llmsplit builds"),
    (["data.seq_len=1024"], 2, "data.seq_len=1024 exceeds model.max_seq_len=256"),
    (["model.vocab_size=100"], 2, "model.vocab_size=100 is smaller than the tokenizer's 258 tokens"),
    (["model.preset=gpt5"], 2, "model.preset='gpt5' is not one of"),
    (["train.deterministic=maybe"], 2, "train.deterministic must be true or false"),
    (["parallel.dp=1", "parallel.pp=2", "parallel.pp_schedule=dualpipev", "train.global_batch=4",
      "train.micro_batch=2"], 2, "2 micro-batches is fewer than the 4 stages of parallel.pp_schedule=\"dualpipev\""),
])
def test_user_mistakes_are_one_clear_sentence(sets, world, fragment):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, sets)
        validate(cfg, world, model_config(cfg, 258), 258)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


BAD_CLI = [
    (["--config", "missing.toml"], "does not exist"),
    (["--set", "train.steps=abc"], "train.steps must be an integer"),
    (["--set", "train.global_batch=5"], "is not divisible"),
    (["--set", "data.source=text:/nonexistent/**/*.txt"], "matches no files"),
    (["--set", "data.source=/nonexistent/tokens.bin"], "does not exist"),
    (["--set", "parallel.zero=9"], "parallel.zero=9 is not one of"),
    (["--set", "parallel.tp=4"], "parallel.tp"),
    (["--nproc", "0"], "--nproc 0 must be at least 1"),
    (["--set", "noequals"], "must look like KEY=VALUE"),
]


@pytest.mark.parametrize("args, fragment", BAD_CLI)
def test_cli_refuses_bad_config_with_exit_2_before_any_worker(tmp_path, capsys, args, fragment):
    # In-process: the same main() the console script runs, without a new interpreter each time
    # (test_cli_refuses_invalid_toml... below goes through a real subprocess).
    from llmsplit.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "--run-dir", str(run_dir), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert fragment in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()  # nothing written


def test_cli_refuses_invalid_toml_a_bad_tokenizer_and_a_run_dir_that_is_a_file(tmp_path, capsys):
    from llmsplit.cli import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = ")
    notok = tmp_path / "tokenizer.json"
    notok.write_text("{not a tokenizer}")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    # The first through the real program (exit status and all), the others in this process.
    proc = run_cli("train", "--config", str(bad), check=False, timeout=60)
    assert proc.returncode == 2 and "is not valid TOML" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for args, fragment in ([["--set", f"data.tokenizer={notok}"], "is not a tokenizer.json"],
                           [["--run-dir", str(a_file)], "is a file"]):
        code = main(["train", *args])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "Traceback" not in err, err
    assert a_file.read_text() == "x"


def test_existing_run_is_not_overwritten(tmp_path, capsys):
    """A run that logged a step is kept (one that never finished a step may be started
    again: tests/test_run_integrity.py)."""
    from llmsplit.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[train]\nsteps = 1\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 5.6}\n')
    assert main(["train", "--run-dir", str(run_dir)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run_dir / "config.toml").read_text() == "[train]\nsteps = 1\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml", "metrics.jsonl"]


def test_every_command_has_help():
    for cmd in ([], ["train"], ["generate"], ["prepare"]):
        proc = run_cli(*cmd, "--help", timeout=60)
        assert "usage: llmsplit" in proc.stdout
