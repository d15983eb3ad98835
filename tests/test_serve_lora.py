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
    (its last) as the PEFT adapter folder `export --to peft` writes of it. One training: each costs
    seconds of the suite."""
    tmp = tmp_path_factory.mktemp("serve_lora")
    base = make_hf_folder(tmp / "base", num_hidden_layers=2)
    train(tmp / "run", f"model.hf={base}", "lora.rank=4", "lora.alpha=8", "lora.targets=q,v,down", *TRAIN, nproc=1)
    run_cli("export", "--checkpoint", str(tmp / "run"), "--to", "peft", str(tmp / "peft"))
    return base, tmp / "run" / "checkpoints" / "step_1", tmp / "peft"


def greedy(model, prompt: str, n: int, adapter: int = 0) -> list[int]:
    seq = model.engine.new_sequence(model.tokenizer.encode(prompt), SamplingParams(n, ignore_eos=True), adapter)
    model.engine.generate([seq])
    return seq.tokens


def all_at_once(served) -> list[list[list[int]]]:
    """Each prompt for the base and each adapter, all nine at once, under a token budget that
    packs prefill chunks beside the others' decodes: [adapter][prompt] -> greedy tokens."""
    e = served.engine
    seqs = [e.new_sequence(served.tokenizer.encode(p), SamplingParams(10, ignore_eos=True), k)
            for p in PROMPTS for k in range(3)]
    e.generate(seqs)
    return [[s.tokens for s in seqs[k::3]] for k in range(3)]


@pytest.fixture(scope="module")
def merged_tokens(runs):
    """The greedy tokens of the base, and of the model with each adapter merged (a run's checkpoint
    as --model, and a PEFT adapter folder as --model: merged over the base its config names)."""
    base, a, b = runs
    merged = [llmsplit.load(p, device_map="cpu", max_context=64) for p in (base, a, b)]
    run = llmsplit.load(b.parent / "run", device_map="cpu", max_context=64)
    want = [[greedy(m, p, 10) for p in PROMPTS] for m in merged]
    assert want[2] == [greedy(run, p, 10) for p in PROMPTS]  # the PEFT export merges to its run's model
    assert want[0] != want[1] and want[0] != want[2] and want[1] != want[2]  # the adapters do change the answers
    return want


def test_each_request_gets_its_adapters_merged_tokens_in_one_batch(runs, merged_tokens):
    base, a, b = runs
    served = llmsplit.load(base, device_map="cpu", max_batch=9, max_context=64, block_size=4,
                           max_num_batched_tokens=12, lora={"a": str(a), "b": str(b)})
    want = merged_tokens
    assert all_at_once(served) == want
    e = served.engine
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
    torch.testing.assert_close(served.logits(tokens), llmsplit.load(base, device_map="cpu").logits(tokens))


@pytest.mark.slow
def test_adapters_served_over_tensor_and_pipeline_workers(runs, merged_tokens):
    """--tp 2 --pp 2 at once: each stage applies its layers' adapters, each tensor-parallel rank its
    shard of them (q and v column-parallel: B's rows; down row-parallel: A's columns)."""
    base, a, b = runs
    split = llmsplit.load(base, tp=2, pp=2, max_batch=9, max_context=64, block_size=4, max_num_batched_tokens=12,
                          lora={"a": str(a), "b": str(b)})
    try:
        assert split.engine.runner.runner.bank.adapted == ["0"]  # rank 0: stage 0, layer 0
        assert all_at_once(split) == merged_tokens
    finally:
        split.close()


def test_the_server_lists_the_adapters_and_the_model_field_picks_one(runs):
    from starlette.testclient import TestClient

    from llmsplit.infer.serve.server import Server

    base, a, b = runs
    # With speculative decoding: proposals verified under the request's adapter give its merged model's text.
    served = llmsplit.load(base, device_map="cpu", max_batch=4, max_context=64, lora={"a": str(a), "b": str(b)},
                           speculative="ngram")
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


def _broken(peft, out, config=None, tensors=None):
    """A copy of the PEFT folder `peft` with its config's keys and its tensors replaced."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(peft, out)
    raw = json.loads((peft / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    save_file({**load_file(peft / "adapter_model.safetensors"), **(tensors or {})}, out / "adapter_model.safetensors")
    return out


def test_lora_flags_are_checked(runs, tmp_path):
    base, a, peft = runs
    down = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    for flags, fragment in [(["--lora", "a"], "write NAME=RUN"),
                            (["--lora", f"a={a}", "--lora", f"a={a}"], "each NAME once"),
                            (["--lora", f"a={base}"], "--lora a: "),
                            (["--lora", f"p={_broken(peft, tmp_path / 'dora', {'use_dora': True})}"],
                             "--lora p: adapter_config.json sets use_dora=True, which llmsplit does not apply"),
                            (["--lora", f"p={_broken(peft, tmp_path / 'narrow', tensors={down: torch.zeros(4, 64)})}"],
                             f"--lora p: its adapter layers.1.feed_forward.w2.lora_a is [4, 64] where this base "
                             f"(r=4) needs [4, 128]")]:
        proc = run_cli("serve", "--model", str(base), "--port", "0", *flags, check=False)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # A PEFT folder as --model: merged over its base_model_name_or_path, refused as --lora is.
    for config, tensors, fragment in [
            ({"rank_pattern": {"q_proj": 8}}, None, "sets rank_pattern={'q_proj': 8}"),
            (None, {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
             "its tensor base_model.model.lm_head.lora_A.weight adapts no q/k/v/o/gate/up/down projection"),
            ({"base_model_name_or_path": "nobody/nothing"}, None,
             "names base_model_name_or_path='nobody/nothing', which is neither a local model nor in the Hugging "
             "Face cache")]:
        bad = _broken(peft, tmp_path / f"bad{len(fragment)}", config, tensors)
        proc = run_cli("generate", "--model", str(bad), "hi", check=False)
        assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_node_started_with_other_adapters_than_node_0_is_refused(monkeypatch):
    """Every rank of a --tp/--pp split compares its --lora with node 0's, before loading anything."""
    import llmsplit.infer.runner.split as split
    from llmsplit.errors import ConfigError
    from llmsplit.infer.config import InferConfig
    from llmsplit.layout import Layout

    def node_0_serves(box, src):
        box[0] = (("a", "/runs/a"),)

    monkeypatch.setattr(split.dist, "broadcast_object_list", node_0_serves)
    spec = split.SplitSpec("model", InferConfig(tp=2), Layout(tp=2), torch.float32, 4, 64)
    with pytest.raises(ConfigError, match=r"started with --lora \(none\) but node 0 serves --lora a=/runs/a; start "
                                          r"every node with node 0's --lora flags"):
        split.same_adapters(spec)
    split.same_adapters(split.SplitSpec("model", InferConfig(tp=2, lora={"a": "/runs/a"}), Layout(tp=2), torch.float32,
                                        4, 64))
