"""`plan --mode infer --quantize`: the planner's weights are the bytes a packed load holds
(whole, per pipeline stage, per tensor-parallel rank), and what fits follows from them."""

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import llmsplit  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402
from llmsplit.cli import main  # noqa: E402
from llmsplit.io.weights import open_weights, read_weight  # noqa: E402
from llmsplit.layout import Layout, tp_shard  # noqa: E402
from llmsplit.plan.memory import layer_params, stage_params  # noqa: E402
from llmsplit.plan.states import inference_weight_bytes  # noqa: E402
from llmsplit.quant import PackedWeight, held_bytes  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_folder(tmp_path_factory.mktemp("qplan") / "llama", num_hidden_layers=2, tie=True)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """One kv head: the fused q/k/v weight has 96 rows, which the int4 layout pads to 128."""
    return make_hf_folder(tmp_path_factory.mktemp("qplan") / "kv1", num_hidden_layers=1, num_key_value_heads=1)


def _planned(cfg, layout, stage, mode):
    return inference_weight_bytes(cfg, stage_params(cfg, layout, stage), layer_params(cfg, layout.tp),
                                  layout.tp, 4, mode)


def _bytes(t) -> int:
    return sum(t.nbytes_held().values()) if isinstance(t, PackedWeight) else t.numel() * t.element_size()


@pytest.mark.parametrize("mode", ["int8", "int4", "none"])
def test_plan_weights_are_the_bytes_a_packed_load_holds(folder, padded, mode):
    for path in (folder, padded):
        m = llmsplit.load(path, quantize=mode)
        model = m.runner.model
        whole = held_bytes(model) - model.rope_cos.nbytes - model.rope_sin.nbytes
        report = llmsplit.plan(model=str(path), gpus=1, gpu="H100-80GB", mode="infer", precision="fp32",
                               quantize=mode, layout="tp=1")
        assert report["layouts"][0]["memory_per_device"]["params"] == whole, path
        assert report["workload"]["quantize"] == mode
        if mode != "none":
            assert whole < held_bytes(llmsplit.load(path, quantize="none").runner.model) / 2.5
    m = llmsplit.load(folder, quantize=mode)
    model, cfg = m.runner.model, m.config
    # pp 2: each stage holds its own units; the tied head lives on the last stage as a copy.
    stages = [nn.ModuleList([model.tok_embeddings, model.layers["0"]]),
              nn.ModuleList([model.layers["1"], model.norm, model.tok_embeddings])]
    for i, units in enumerate(stages):
        assert _planned(cfg, Layout(pp=2), i, mode) == held_bytes(units), i
    # tp 2, rank 0: the sharded packed weights, fused as the runner fuses them; the vocabulary
    # shards are read as float32 (infer/vocab_parallel.py).
    src, total = open_weights(folder), 0
    for i in range(cfg.n_layers):
        def read(name, i=i):
            name = f"layers.{i}.{name}"
            return read_weight(src, name, tp_shard(name, 0, 2), mode)
        qkv = torch.cat([read(f"attention.w{x}.weight") for x in "qkv"])
        gate_up = torch.cat([read("feed_forward.w1.weight"), read("feed_forward.w3.weight")])
        total += sum(map(_bytes, (qkv, gate_up, read("attention.wo.weight"), read("feed_forward.w2.weight"))))
        total += 4 * 2 * cfg.dim  # the two norms
    total += 4 * (cfg.vocab_size // 2 * cfg.dim + cfg.dim)
    assert _planned(cfg, Layout(tp=2), 0, mode) == total


def test_llama3_70b_int4_on_rtx4090s():
    """llama-3-70b as int4 (groups of 32, a bf16 scale and zero each: 5 bits a weight): 0.31x
    its bf16 bytes per device; on 2 × RTX4090-24GB that is 21.4 GiB of weights a card, which with
    the runtime does not fit (24.3 GiB of 23.6 at 2,048 tokens), and the plan names 4 cards,
    where it fits (13.2 GiB); int8 fits 4 too, at 0.50x the bf16 weights (which need 8)."""
    def plan(gpus, **kw):
        return llmsplit.plan(model="llama-3-70b", gpus=gpus, gpu="RTX4090-24GB", mode="infer", seq_len=2048, **kw)

    two, four, four8 = plan(2, quantize="int4"), plan(4, quantize="int4"), plan(4, quantize="int8")
    assert two["fitting"] == 0 and "4 × RTX4090-24GB" in two["advice"]
    assert four["fitting"] >= 1 and four8["fitting"] >= 1
    bf16 = plan(4, layout="pp=4")
    assert bf16["fitting"] == 0
    weights = {name: next(d for d in doc["layouts"] if d["layout"]["pp"] == 4)["memory_per_device"]["params"]
               for name, doc in (("int4", four), ("int8", four8), ("bf16", bf16))}
    assert weights["int4"] / weights["bf16"] == pytest.approx(0.323, abs=0.005)  # 5 bits, an int8 embedding
    assert weights["int8"] / weights["bf16"] == pytest.approx(0.50, abs=0.005)


@pytest.mark.parametrize("argv,needle", [
    (["--quantize", "int3", "--mode", "infer"], "--quantize 'int3' is not one of"),
    (["--quantize", "int4"], "--quantize int4 plans inference (--mode infer)"),
    (["--quantize", "int4", "--mode", "infer"], "feed_forward.w2 has 688 inputs; use --quantize int8"),
    (["--quantize", "int4", "--mode", "infer", "--layout", "tp=1"], "feed_forward.w2 has 688 inputs"),
    (["--quantize", "int8", "--mode", "infer", "--layout", "tp=4"], None),
])
def test_bad_quantize_exits_2_with_one_sentence(argv, needle, capsys):
    code = main(["plan", "--model", "tiny", "--gpus", "4", "--gpu", "H100-80GB", *argv])  # ffn_dim 688
    if needle is None:  # int8 has no groups to cut: the control case
        assert code == 0
        return
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_tp_split_that_cuts_groups_is_named():
    from llmsplit.models.presets import preset_config
    from llmsplit.layout import packed_split_problem

    cfg = preset_config("tiny-moe")  # 4 heads of 32: 128 q inputs, 16 a shard at tp=8
    assert packed_split_problem(cfg, 4, "int4") is None and packed_split_problem(cfg, 8, "int8") is None
    assert packed_split_problem(cfg, 8, "int4") == (
        "--quantize int4 under --tp 8 splits attention.wo's 128 inputs into 16 per rank, not whole groups of 32; "
        "use --tp in 1, 2 or --quantize int8")


def test_plan_and_generate_refuse_a_group_cutting_split_with_one_sentence(tmp_path, capsys):
    """ffn 672 under --tp 2: 336 inputs of feed_forward.w2 a rank, not whole int4 groups. `plan`
    and `generate` refuse it through the same layout rule, exit 2, before any worker starts."""
    import time

    folder = make_hf_folder(tmp_path / "ffn672", num_hidden_layers=1, intermediate_size=672)
    sentence = ("--quantize int4 under --tp 2 splits feed_forward.w2's 672 inputs into 336 per rank, not whole "
                "groups of 32; use --tp 1 or --quantize int8")
    assert main(["plan", "--model", str(folder), "--gpus", "2", "--mode", "infer", "--quantize", "int4",
                 "--layout", "tp=2"]) == 2
    assert sentence in capsys.readouterr().err
    started = time.monotonic()
    assert main(["generate", "--model", str(folder), "--tp", "2", "--quantize", "int4", "hello"]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - started < 5  # no worker was started (they take seconds to come up)
