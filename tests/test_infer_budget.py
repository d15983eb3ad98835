"""Generation under a memory budget (issue 22): `generate` sizes its KV cache to the prompt
and --max-new-tokens, the out-of-memory explainer offers changes of several flags where no
single one fits, each of which runs, and the offload folder generate made is gone after it.

README's own example, `--max-memory cpu=200MB --offload-dir ...` on SmolLM2-135M, is checked
two ways: its budget arithmetic on SmolLM2's real shape (pure placement, no weights), and the
same command, budget scaled, on a random model of SmolLM2's proportions (30 layers, a tied
embedding eight times the size of a layer, grouped-query attention) that runs in seconds."""

import shlex
from pathlib import Path

import pytest

from llmsplit.cli_args import build_parser
from llmsplit.diagnose.oom import explain_infer_oom
from llmsplit.infer.api import generation_context
from llmsplit.infer.runner.budgets import detect_budgets
from llmsplit.plan.placement import PlacementError, Sizes, place
from llmsplit.models.llama import LlamaConfig

README = Path(__file__).resolve().parents[1] / "README.md"
SMOLLM2_135M = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, vocab_size=49152, ffn_dim=1536,
                           max_seq_len=8192, rope_theta=100000.0, tie_embeddings=True)


def readme_offload_example() -> list[str]:
    """The arguments of README's disk-offload example line, as a shell would split them."""
    line = next(ln for ln in README.read_text().splitlines() if ln.startswith("llmsplit generate")
                and "--offload-dir" in ln and "--max-memory" in ln)
    return shlex.split(line.split("#")[0])[1:]


def test_the_readme_offload_example_fits_smollm2_as_written():
    from llmsplit.cli import COMMANDS

    args = build_parser(COMMANDS).parse_args(readme_offload_example())
    assert args.max_context is None and args.dtype is None  # nothing that the example does not say
    budgets = detect_budgets(args.max_memory, args.offload_dir)
    # SmolLM2's tokenizer is byte-level BPE: a token is at least one byte of the prompt.
    context = generation_context(len(" ".join(args.prompt).encode()), args.max_new_tokens)
    fitted = place(SMOLLM2_135M, budgets, "auto", Sizes(context=context))
    where = fitted.device_map
    assert "disk" in where.values() and where["tok_embeddings"] == where["output"] == "cpu"
    assert fitted.usage["cpu"]["total"] <= budgets["cpu"]
    # The cache the model's own context would take (the old default) does not fit ...
    with pytest.raises(PlacementError):
        place(SMOLLM2_135M, budgets, "auto", Sizes(context=4096))
    # ... and without the offload folder no one flag would have fixed that; the explainer
    # offers flags together, each of which the placement accepts on the budgets as given.
    cpu_only = {d: v for d, v in budgets.items() if d != "disk"}
    report = explain_infer_oom(SMOLLM2_135M, Sizes(context=4096), cpu_only, "auto", None, offload_dir=None,
                               max_batch_flag=False)
    assert report["suggestions"] and all(len(s) >= 4 for s in report["suggestions"]), report["text"]
    for flags in report["suggestions"]:
        change = dict(zip(flags[::2], flags[1::2]))
        two_bytes = change.get("--dtype") == "bf16"
        sizes = Sizes(context=int(change.get("--max-context", 4096)), dtype_bytes=4 - 2 * two_bytes,
                      kv_dtype_bytes=4 - 2 * two_bytes)
        place(SMOLLM2_135M, {**cpu_only, "disk": None} if "--offload-dir" in change else cpu_only, "auto", sizes)


@pytest.fixture(scope="module")
def smol_shaped(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import make_hf_folder, train_tokenizer

    folder = make_hf_folder(tmp_path_factory.mktemp("smol") / "smol", tie=True, hidden_size=64,
                            intermediate_size=176, num_hidden_layers=30, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=6144, max_position_embeddings=4096)
    train_tokenizer(6144).save(str(folder / "tokenizer.json"))  # every id the model picks is text
    return folder


# SmolLM2's 200 MB, scaled: here too 3 of the 30 layers stay in memory, 27 are read from disk.
SCALED_BUDGET = "cpu=3500KB"


def test_the_readme_offload_example_runs_and_removes_its_folder(smol_shaped, tmp_path, capsys):
    from llmsplit.cli import main

    offload = tmp_path / "made" / "off"
    args = readme_offload_example()
    for flag, value in (("--model", str(smol_shaped)), ("--max-memory", SCALED_BUDGET), ("--offload-dir", str(offload))):
        args[args.index(flag) + 1] = value
    assert main(args + ["--show-device-map"]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    assert "layers.3 .. layers.29: disk" in err and out.strip()
    assert not (tmp_path / "made").exists()  # llmsplit made both folders: both are gone
    # A folder that was there before stays, with what the user had put in it.
    offload.mkdir(parents=True)
    (offload / "notes.txt").write_text("mine")
    assert main(args + ["--max-new-tokens", "4"]) == 0 and out.startswith(capsys.readouterr().out.rstrip("\n"))
    assert [p.name for p in offload.iterdir()] == ["notes.txt"]


def test_the_combination_the_explainer_prints_runs(smol_shaped, tmp_path, capsys):
    """The old default cache (the model's context, 4096 tokens) does not fit the budget, and
    no single flag fixes it; each printed line of flags, added to the command, runs."""
    from llmsplit.cli import main

    cmd = ["generate", "--model", str(smol_shaped), "--max-memory", SCALED_BUDGET, "--max-context", "4096",
           "--max-new-tokens", "4", "Hello"]
    assert main(cmd) == 1
    err = capsys.readouterr().err
    lines = [ln.split("#")[0].split() for ln in err.splitlines() if ln.startswith("  --")]
    assert lines and all(len(flags) >= 4 for flags in lines), err
    assert err.rstrip().endswith("hint: add the flags of one line above to the same command")
    for flags in lines:
        flags = [str(tmp_path / "off") if f == "DIR" else f for f in flags]
        assert main(cmd + flags) == 0, capsys.readouterr().err
    assert not (tmp_path / "off").exists()


def test_no_hint_without_flags_to_add(smol_shaped, tmp_path, capsys):
    from llmsplit.cli import main

    assert main(["generate", "--model", str(smol_shaped), "--max-memory", "cpu=100KB", "--offload-dir",
                 str(tmp_path / "off"), "Hello"]) == 1
    err = capsys.readouterr().err
    assert "fits, alone or together; raise --max-memory" in err and "hint:" not in err, err
