"""`llmsplit export`: a training run becomes a Hugging Face folder with the same logits."""

import json

import pytest
import torch

from helpers import TINY, run_cli, train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "run"
    train(path, *TINY, "train.steps=2", nproc=2)
    return path


def test_export_loads_in_transformers_with_identical_logits(run, tmp_path):
    transformers = pytest.importorskip("transformers")
    import llmsplit

    out = tmp_path / "hf"
    proc = run_cli("export", "--checkpoint", str(run), "--to", "hf", str(out))
    assert "safetensors file(s)" in proc.stdout
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ours = llmsplit.load(str(run))
    ids = torch.tensor([ours.tokenizer.encode("Python is a programming language")])
    with torch.no_grad():
        want = ours.logits(ids)
        got = hf(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    text = "héllo, wörld\n"
    assert fast(text, add_special_tokens=False)["input_ids"] == ours.tokenizer.encode(text)
    assert fast.decode(ours.tokenizer.encode(text)) == text


def test_export_shards_large_models_and_refuses_bad_targets(run, tmp_path):
    out = tmp_path / "sharded"
    run_cli("export", "--checkpoint", str(run), "--to", "hf", str(out), "--max-shard-size", "40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    for args, fragment in ([["--checkpoint", str(run), "--to", "hf", str(out)], "is not an empty folder"],
                           [["--checkpoint", str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "o")], "does not exist"],
                           [["--checkpoint", str(run), "--to", "hf", str(tmp_path / "o2"), "--max-shard-size", "lots"],
                            "is not a size"]):
        bad = run_cli("export", *args, check=False, timeout=120)
        assert bad.returncode == 2 and fragment in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
