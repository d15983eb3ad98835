"""`llmsplit generate` on a Hugging Face folder: the API's text, the device map, and one
clear sentence (exit 2) for each kind of bad input (a model over its memory budget is
explained with exit 1: tests/test_oom.py)."""

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from helpers import run_cli  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("cli") / "llama", num_hidden_layers=2)


def test_cli_prints_what_the_api_generates(folder, tmp_path):
    m = llmsplit.load(folder)
    want = m.generate("The def statement", max_new_tokens=8, ignore_eos=True)
    out = run_cli("generate", "--model", str(folder), "The", "def", "statement", "--max-new-tokens", "8",
                  "--ignore-eos", "--max-memory", "cpu=500KiB", "--offload-dir", str(tmp_path / "off"),
                  "--max-context", "32", "--show-device-map", "--stream", "--speculative", "ngram", "--verbose")
    assert out.stdout == want + "\n"  # speculative proposals over layers offloaded to disk: the same text
    assert "device map:" in out.stderr and ": disk" in out.stderr and "cpu:" in out.stderr
    assert re.search(r"prompt \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\); decode 7 tokens in", out.stderr), out.stderr
    assert re.search(r"speculative ngram: (\d+/\d+ proposals accepted|nothing proposed)", out.stderr), out.stderr


@pytest.mark.parametrize("args,message", [
    (["--model", "/nonexistent/model", "hi"], "does not exist"),
    (["--model", "{tmp}", "hi"], "is not a model"),
    (["--model", "{gpt2}", "hi"], "'GPT2LMHeadModel' (model_type 'gpt2') is not supported"),
    (["--model", "{folder}", "hi", "--max-memory", "cpu:1GB"], "--max-memory 'cpu:1GB' does not parse"),
    (["--model", "{folder}", "hi", "--tp", "3"], "--tp 3 does not divide"),
    (["--model", "{folder}", ""], "the prompt is empty"),
    (["--model", "{folder}", "hi", "--speculative-tokens", "0", "--speculative", "ngram"],
     "--speculative-tokens 0 must be in [1, 16]"),
    (["--model", "{folder}", "hi", "--speculative", "path/to/draft"], "--speculative 'path/to/draft' does not exist"),
])
def test_bad_input_is_one_sentence(folder, tmp_path, capsys, monkeypatch, args, message):
    # In-process: the console script's main(), without an interpreter start-up per case.
    import io

    from llmsplit.cli import main

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    args = [a.format(tmp=tmp_path, gpt2=gpt2, folder=folder) for a in args]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = main(["generate", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err


def test_eager_generation_imports_no_compiler(folder):
    # torch._dynamo and sympy cost a generate or serve process 1.3 s and 74 MiB of RSS; only
    # --compile needs them (PyTorch's Python meta kernels, reached by building on the meta
    # device, imported them before). A fresh interpreter: this one has imported them.
    script = ("import sys, llmsplit\n"
              "for quantize in (None, 'int4'):\n"
              "    m = llmsplit.load(sys.argv[1], quantize=quantize, max_context=32)\n"
              "    m.generate('The def statement', max_new_tokens=4, ignore_eos=True)\n"
              "print(sorted(n for n in ('torch._dynamo', 'sympy') if n in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]
