"""Serving several LoRA adapters over one base (issue 17, `serve --lora NAME=RUN`): requests
for different adapters and for the base are batched in the same steps (decodes and prefill
chunks packed together), and each one's greedy tokens are those of `llmsplit.load(RUN)`, the
model with that adapter merged; prefixes are cached per adapter; /v1/models lists them and
an unknown model name is a 404 naming the key."""

import pytest
import torch

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from helpers import run_cli, train  # noqa: E402
from llmsplit.infer.engine import SamplingParams  # noqa: E402

PROMPTS = ["The def statement", "A class is", "import os and sys, then for x in range of the list"]
TRAIN = ["data.seq_len=32", "train.global_batch=4", "train.micro_batch=4", "train.steps=3", "train.lr=5e-2",
         "checkpoint.every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base Hugging Face folder and two adapters on it: a LoRA run's first checkpoint, and the run
    (its last). One training: each costs seconds of the suite."""
    tmp = tmp_path_factory.mktemp("serve_lora")
    base = make_hf_folder(tmp / "base", num_hidden_layers=2)
    train(tmp / "run", f"model.hf={base}", "lora.rank=4", "lora.alpha=8", "lora.targets=q,v,down", *TRAIN, nproc=1)
    return base, tmp / "run" / "checkpoints" / "step_1", tmp / "run"


def greedy(model, prompt: str, n: int, adapter: int = 0) -> list[int]:
    seq = model.engine.new_sequence(model.tokenizer.encode(prompt), SamplingParams(n, ignore_eos=True), adapter)
    model.engine.generate([seq])
    return seq.tokens


def test_each_request_gets_its_adapters_merged_tokens_in_one_batch(runs):
    base, a, b = runs
    served = llmsplit.load(base, device_map="cpu", max_batch=9, max_context=64, block_size=4,
                           max_num_batched_tokens=12, lora={"a": str(a), "b": str(b)})
    merged = [llmsplit.load(p, device_map="cpu", max_context=64) for p in (base, a, b)]
    want = [[greedy(m, p, 10) for p in PROMPTS] for m in merged]
    assert want[0] != want[1] and want[0] != want[2] and want[1] != want[2]  # the adapters do change the answers
    # All nine at once, under a token budget that packs prefill chunks beside the others' decodes.
    e = served.engine
    seqs = [e.new_sequence(served.tokenizer.encode(p), SamplingParams(10, ignore_eos=True), k)
            for p in PROMPTS for k in range(3)]
    e.generate(seqs)
    assert [[s.tokens for s in seqs[k::3]] for k in range(3)] == want
    # Prefixes are cached per adapter: the base's blocks of a prompt are no use to adapter a ...
    hits = e.pool.hit_tokens
    assert greedy(served, PROMPTS[2], 4, 0) == want[0][2][:4] and e.pool.hit_tokens > hits
    hits = e.pool.hit_tokens
    assert greedy(served, PROMPTS[2], 4, 1) == want[1][2][:4] and e.pool.hit_tokens > hits  # (a's own cached ones)
    e.pool.__init__(e.pool.num_blocks, e.pool.block_size)  # an empty cache
    greedy(served, PROMPTS[2], 4, 0)
    hits = e.pool.hit_tokens
    assert greedy(served, PROMPTS[2], 4, 1) == want[1][2][:4] and e.pool.hit_tokens == hits
    # ... and a plain forward (no adapter asked for) is the base's.
    tokens = torch.tensor([served.tokenizer.encode(PROMPTS[0])])
    torch.testing.assert_close(served.logits(tokens), merged[0].logits(tokens))


def test_the_server_lists_the_adapters_and_the_model_field_picks_one(runs):
    from starlette.testclient import TestClient

    from llmsplit.infer.server import Server

    base, a, b = runs
    served = llmsplit.load(base, device_map="cpu", max_batch=4, max_context=64, lora={"a": str(a), "b": str(b)})
    want = llmsplit.load(b, device_map="cpu", max_context=64).generate(PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    with TestClient(Server(served, "base").app) as c:
        models = c.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("base", None), ("a", "base"), ("b", "base")]
        assert c.get("/v1/models/b").json()["parent"] == "base"
        r = c.post("/v1/completions", json={"model": "b", "prompt": PROMPTS[0], "max_tokens": 8, "ignore_eos": True,
                                                "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "b" and r.json()["choices"][0]["text"] == want
        r = c.post("/v1/completions", json={"model": "c", "prompt": PROMPTS[0]})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert "'c' does not exist; this server serves 'base', 'a', 'b'" in r.json()["error"]["message"]


def test_lora_flags_are_checked(runs, tmp_path):
    base, a, _ = runs
    for flags, fragment in [(["--lora", "a"], "write NAME=RUN"),
                            (["--lora", f"a={a}", "--lora", f"a={a}"], "each NAME once"),
                            (["--lora", f"a={a}", "--tp", "2"], "drop --tp/--pp/--compile or --lora"),
                            (["--lora", f"a={base}"], "--lora a: ")]:
        proc = run_cli("serve", "--model", str(base), "--port", "0", *flags, check=False)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
