"""Flags are checked before anything loads (issue 22): a value out of range exits 2 with one
line naming the flag, from the parser, before a model is opened; the CLI refuses exactly the
sampling values the library refuses; every option's help says its default; `train
--help-config` lists every config key with its default, description and allowed values; a typo of a
key or flag is answered with the closest one; `plan` exits 1 when nothing fits."""

import dataclasses
import json

import pytest

import llmsplit
from llmsplit.cli import COMMANDS, main
from llmsplit.cli_args import build_parser
from llmsplit.config import Config, ConfigError
from llmsplit.infer.engine import SamplingParams


class Loaded(Exception):
    """Raised where the command would open a model: the flags were accepted."""


@pytest.fixture
def no_loading(monkeypatch):
    # Imported before the patch: a module first imported under it would keep the refusing
    # open_weights bound for every later test (test_infer_cli failed after this file alone).
    import llmsplit.infer.api  # noqa: F401

    def refuse(*args, **kwargs):
        raise Loaded()

    monkeypatch.setattr("llmsplit.io.weights.open_weights", refuse)
    monkeypatch.setattr(llmsplit, "load", refuse)


@pytest.mark.parametrize("argv,said", [
    (["generate", "--max-new-tokens", "-1"], "--max-new-tokens -1 must be at least 1"),
    (["generate", "--temperature", "-1"], "--temperature -1 must be at least 0"),
    (["generate", "--top-p", "2"], "--top-p 2 must be at most 1"),
    (["generate", "--top-p", "0"], "--top-p 0 must be more than 0"),
    (["generate", "--top-k", "0"], "--top-k 0 must be at least 1"),
    (["generate", "--max-context", "1"], "--max-context 1 must be at least 2"),
    (["generate", "--tp", "0"], "--tp 0 must be at least 1"),
    (["generate", "--max-new-tokens", "lots"], "argument --max-new-tokens: 'lots' is not an integer"),
    (["serve", "--max-batch", "0"], "--max-batch 0 must be at least 1"),
    (["serve", "--port", "70000"], "--port 70000 must be at most 65535"),
    (["serve", "--drain-timeout", "-5"], "--drain-timeout -5 must be at least 0"),
    (["generate", "--quantize", "int3"], "argument --quantize: invalid choice: 'int3'"),
    (["serve", "--quantize", "fp8"], "argument --quantize: invalid choice: 'fp8'"),
])
def test_a_bad_value_exits_2_naming_the_flag_before_any_model_opens(no_loading, capsys, argv, said):
    code = main([argv[0], "--model", "SmolLM2-135M-Instruct.Q4_1.gguf", *argv[1:], "hi"])
    err = capsys.readouterr().err
    assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert "_" not in err.split("error:")[1].split("(")[0]  # a flag, not the Python parameter


def test_train_and_plan_counts_are_checked_while_parsing(capsys):
    assert main(["train", "--nproc", "0"]) == 2
    assert "--nproc 0 must be at least 1" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--gpus", "1", "--top", "0"]) == 2
    assert "--top 0 must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("name,values", [("max_new_tokens", [-1, 0, 1, 64]),
                                         ("temperature", [-1.0, -0.001, 0.0, 0.7]),
                                         ("top_p", [-0.5, 0.0, 0.5, 1.0, 1.0001, 2.0]), ("top_k", [-1, 0, 1, 40])])
def test_the_cli_refuses_exactly_what_the_library_refuses(no_loading, capsys, name, values):
    for value in values:
        try:
            SamplingParams(**{name: value}).check()
            library_accepts = True
        except ConfigError:
            library_accepts = False
        try:
            main(["generate", "--model", "m.gguf", f"--{name.replace('_', '-')}", str(value), "hi"])
            cli_accepts = False
        except Loaded:
            cli_accepts = True
        capsys.readouterr()
        assert cli_accepts == library_accepts, (name, value)


def test_every_option_has_help_that_says_its_default():
    import argparse

    sub = next(a for a in build_parser(COMMANDS)._actions if isinstance(a, argparse._SubParsersAction))
    for command, parser in sub.choices.items():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
                continue
            where = f"llmsplit {command} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, where
            text = action.help % {"default": action.default}
            if action.option_strings and action.nargs != 0 and not action.required:
                assert "default" in text, where
                if action.default not in (None, [], argparse.SUPPRESS):
                    assert str(action.default) in text, where


def test_help_config_lists_every_key_with_its_default(capsys):
    assert main(["train", "--help-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for section in dataclasses.fields(Config):
        for key, default in dataclasses.asdict(section.default_factory()).items():
            line = next(ln for ln in lines if ln.split()[:1] == [f"{section.name}.{key}"])
            shown = "unset" if default is None else str(default).lower() if isinstance(default, bool) else \
                f'"{default}"' if isinstance(default, str) else repr(default)
            assert f"default {shown}" in line, line
    assert "one of 1f1b, gpipe" in next(ln for ln in lines if ln.startswith("  parallel.pp_schedule"))


def test_help_config_says_what_each_key_means_what_it_allows_and_its_default_in_context(capsys):
    """Issue 51: a description for every key (one place: config/keys.py's DOCS, none for a key
    that is gone), the fixed values, and the default that applies with model.hf and [lora]."""
    from llmsplit.config.keys import DOCS

    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(s.default_factory())}
    assert set(DOCS) == keys
    assert main(["train", "--help-config"]) == 0
    lines = capsys.readouterr().out.splitlines()

    def said(key):  # the key's line and the description under it
        at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [key])
        return lines[at], lines[at + 1].strip()

    assert said("lora.base")[0].endswith("one of none, nf4, int8")
    assert said("lora.base")[1] == "the frozen base stored as 4-bit NF4 or int8 (QLoRA)"
    assert said("data.format")[0].endswith("one of text, chat")
    assert said("lora.targets")[0].endswith("a comma-separated list of q, k, v, o, gate, up, down")
    assert said("train.lr") == ("  train.lr                         float          default 0.003 from scratch, 2e-05 with "
                                "model.hf or model.gguf, 0.0002 with either and [lora] on (lora.rank > 0)",
                                "peak learning rate, reached after train.warmup_steps")
    assert "default 10 from scratch, 0 with model.hf or model.gguf" in said("train.warmup_steps")[0]


@pytest.mark.parametrize("argv,said", [
    (["train", "--set", "train.lrr=1e-3"], "unknown config key 'train.lrr'; did you mean train.lr? (train has: "),
    (["train", "--set", "lora.rnak=8"], "unknown config key 'lora.rnak'; did you mean lora.rank? (lora has: "),
    (["train", "--set", "trian.steps=5"], "unknown config key 'trian.steps'; did you mean train.steps? (keys look "),
    (["train", "--nprocs", "2"], "error: unrecognized arguments: --nprocs 2; did you mean --nproc? "
                                 "(llmsplit train --help lists the flags)"),
    (["serve", "--model", "m.gguf", "--max-bacth", "4"], "unrecognized arguments: --max-bacth 4; did you mean "
                                                         "--max-batch?"),
])
def test_a_typo_gets_the_closest_key_or_flag_in_the_same_sentence(capsys, argv, said):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1, err


def test_train_generate_and_serve_help_end_with_three_examples_that_parse(capsys):
    import shlex

    from llmsplit.cli_args import EXAMPLES

    parser = build_parser(COMMANDS)
    for command in ("train", "generate", "serve"):
        assert len(EXAMPLES[command]) == 3
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        for line, what in EXAMPLES[command]:
            assert f"  # {what}\n  {line}\n" in out
            args = parser.parse_args(shlex.split(line)[1:])
            assert args.func is COMMANDS[command], line


def test_plan_exits_1_and_says_so_last_when_no_layout_fits(capsys):
    nothing = ["plan", "--model", "llama-3-70b", "--gpus", "1", "--gpu", "A100-40GB", "--seq-len", "8192"]
    assert main(nothing) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "no layout of the 15 considered fits 1 × A100-40GB"
    assert main(nothing + ["--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fitting"] == 0
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8"]) == 0
    assert not capsys.readouterr().out.rstrip().splitlines()[-1].startswith("no layout")  # it ends with what to run
