"""The planner end to end: what fits where, the advice when nothing does, bad input, and
configs that `llmsplit train` accepts."""

import json
import shlex

import pytest

from llmsplit import plan
from llmsplit.cli import main
from llmsplit.config import load_config, model_config, validate
from llmsplit.models.presets import preset_config
from llmsplit.plan.cost import model_flops_per_token, training_cost
from llmsplit.plan.hardware import get_device
from llmsplit.layout import Layout, Workload


def test_llama3_70b_on_64_h100_has_layouts_that_fit_none_over_80gb():
    report = plan(model="llama-3-70b", gpus=64, gpu="H100-80GB", seq_len=8192, top=1000)
    fitting = [lay for lay in report["layouts"] if lay["fits"]]
    assert fitting and report["fitting"] == len(fitting)
    # "80GB" is 80 GiB of HBM, of which torch can use 79.1 GiB.
    assert all(lay["memory_per_device"]["total"] <= report["hardware"]["memory_bytes"] < 80 * 2**30
               for lay in fitting)
    # Ranked by predicted throughput, and every term is there and adds up.
    speeds = [lay["tokens_per_s"] for lay in fitting]
    assert speeds == sorted(speeds, reverse=True)
    mem = fitting[0]["memory_per_device"]
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    # MFU as PaLM defines it: achieved model FLOPs over the 64 devices' bf16 peak (989 TFLOP/s
    # each). Training FLOPs per token at s 8192, by hand: 6 × 69,501,714,432 matmul weights
    # (70,553,706,496 less the 128256·8192 embedding table and 161 norms of 8192) + 12·80·8192·8192
    # for attention = 481,434,796,032.
    for lay in fitting[:5]:
        assert lay["mfu"] == pytest.approx(lay["tokens_per_s"] * 481_434_796_032 / (64 * 989e12))
    # Replicating the whole model cannot fit: 16 bytes × 70.6 B parameters.
    ddp = plan(model="llama-3-70b", gpus=64, gpu="H100-80GB", seq_len=8192, layout="zero=0,tp=1,pp=1")
    assert not ddp["layouts"][0]["fits"] and "model state" in ddp["layouts"][0]["why_not"]


def test_llama3_70b_on_one_rtx4090_fits_nothing_and_names_the_device_count():
    report = plan(model="llama-3-70b", gpus=1, gpu="RTX4090-24GB", seq_len=8192)
    assert report["fitting"] == 0
    assert "needs at least" in report["advice"] and "× RTX4090-24GB" in report["advice"]
    assert all(lay["why_not"] for lay in report["layouts"])


def test_a_workload_no_layout_can_run_is_refused_for_its_own_reason():
    """A sequence longer than the model's positions refuses every layout: the sentence says
    so (it said "no layout divides 4 device(s) ... use a global batch divisible by the device
    count", which sent a user after the batch)."""
    from llmsplit.errors import ConfigError
    from llmsplit.plan.search import search

    with pytest.raises(ConfigError, match=r"^data.seq_len=32768 exceeds model.max_seq_len=256"):
        search(preset_config("tiny"), Workload(seq_len=32768, global_batch=1), 4, get_device("H100-80GB"))


def test_why_not_proposes_a_change_that_fits():
    report = plan(model="llama-3-8b", gpus=8, gpu="H100-80GB", seq_len=8192, global_batch=16,
                  layout="zero=3,micro_batch=2,activation_checkpoint=none")
    why = report["layouts"][0]["why_not"]
    assert "activations" in why and "use " in why
    fix = why.split("use ")[1].split(" or ")[0]
    fixed = plan(model="llama-3-8b", gpus=8, gpu="H100-80GB", seq_len=8192, global_batch=16,
                 layout=f"zero=3,micro_batch=2,activation_checkpoint=none,{fix}".replace(
                     "activation_checkpoint=none,activation_checkpoint", "activation_checkpoint"))
    assert fixed["layouts"][0]["fits"]


def test_flops_and_pipeline_bubble():
    cfg = preset_config("llama-2-7b")
    # 6 × matmul parameters + 12·L·h·s. Llama-2-7B's 6,738,415,616 parameters less the embedding
    # table (32000·4096 = 131,072,000, a lookup) and 65 norms of 4096 (266,240) leave
    # 6,607,077,376 matmul weights: 6 × that = 39,642,464,256, plus 12·32·4096·4096 = 6,442,450,944.
    assert model_flops_per_token(cfg, 4096) == 39_642_464_256 + 6_442_450_944
    dev = get_device("H100-80GB")
    work = Workload(seq_len=4096, global_batch=32)
    one = training_cost(cfg, Layout(dp=1, pp=4, micro_batch=1, pp_schedule="1f1b", activation_checkpoint="full"),
                        work, dev)
    inter = training_cost(cfg, Layout(dp=1, pp=4, micro_batch=1, pp_schedule="interleaved_1f1b",
                                      pp_virtual_stages=2, activation_checkpoint="full"), work, dev)
    mb = one.detail["compute_s"] / 32
    assert one.detail["bubble_s"] == pytest.approx(3 * mb)  # (p − 1) micro-batch times
    assert inter.detail["bubble_s"] == pytest.approx(3 * mb / 2)


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-9", "--gpus", "8"], "llama-3-70b"),
    (["--model", "llama-3-8b", "--gpus", "8", "--gpu", "V100"], "H100-80GB"),
    (["--model", "llama-3-8b", "--gpus", "0"], "--gpus 0"),
    (["--model", "llama-3-8b", "--gpus", "-3"], "--gpus -3"),
    (["--model", "llama-3-8b", "--gpus", "8", "--layout", "tp=3"], "not divisible by parallel.tp × parallel.pp = 3"),
    (["--model", "llama-3-8b", "--gpus", "6", "--layout", "tp=3"], "tp=3 does not divide"),
    (["--model", "llama-3-8b", "--gpus", "8", "--layout", "pp=8,tp=1"], None),
    (["--model", "llama-3-8b", "--gpus", "6", "--layout", "pp=6"], None),  # uneven, as training allows
    (["--model", "llama-3-8b", "--gpus", "64", "--layout", "pp=64"], "needs at least 64 layers"),
    (["--model", "llama-3-8b", "--gpus", "8", "--layout", "zero=7"], "zero=7"),
    (["--model", "llama-3-8b", "--gpus", "8", "--seq-len", "0"], "--seq-len 0"),
])
def test_bad_input_exits_2_with_one_sentence(argv, needle, capsys):
    code = main(["plan", *argv])
    err = capsys.readouterr().err
    if needle is None:  # a valid layout: the control case
        assert code == 0
        return
    assert code == 2
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unparsable_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npreset = ")
    assert main(["plan", "--model", str(bad), "--gpus", "2", "--gpu", "cpu"]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_json_shape(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["params"] == 8_030_261_248  # Llama-3-8B as Meta publishes it (8.03 B)
    assert doc["hardware"]["gpu"] == "H100-80GB" and len(doc["layouts"]) == 3
    lay = doc["layouts"][0]
    assert set(lay["memory_per_device"]) == {"params", "grads", "optimizer", "activations", "comm_buffers",
                                             "overhead", "total"}
    assert all(isinstance(v, int) for v in lay["memory_per_device"].values())
    assert {"layout", "fits", "why_not", "step_time_s", "tokens_per_s", "mfu"} <= set(lay)


def test_inference_mode(capsys):
    assert main(["plan", "--model", "llama-3-70b", "--gpus", "2", "--gpu", "H200-141GB", "--mode", "infer",
                 "--seq-len", "8192", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fitting"] >= 1
    best = doc["layouts"][0]
    # 70.6 B bf16 weights over 2 devices, plus the KV cache.
    assert best["memory_per_device"]["params"] == pytest.approx(2 * 70.55e9 / 2, rel=0.02)


def test_emit_config_is_accepted_by_train(tmp_path, capsys):
    src = tmp_path / "run.toml"
    src.write_text('[model]\npreset = "tiny"\n[data]\nseq_len = 64\n[train]\nsteps = 2\nglobal_batch = 8\n'
                   'micro_batch = 2\n')
    out = tmp_path / "plan.toml"
    assert main(["plan", "--model", str(src), "--gpus", "2", "--gpu", "cpu", "--emit-config", str(out)]) == 0
    text = capsys.readouterr().out
    # A CPU worker's memory is the host's: each layout says how much per worker and per node.
    assert "GiB per worker, " in text and " GiB per node" in text
    assert text.rstrip().endswith(f"llmsplit train --config {out} --nproc 2  # train it")
    cfg = load_config(out)
    validate(cfg, 2, model_config(cfg, 258), 258)
    assert cfg.train.steps == 2 and cfg.data.seq_len == 64  # the rest of the source config is kept
    # The preset path writes a config too.
    out2 = tmp_path / "preset.toml"
    assert main(["plan", "--model", "tiny", "--gpus", "2", "--gpu", "cpu", "--seq-len", "128",
                 "--emit-config", str(out2)]) == 0
    cfg2 = load_config(out2)
    validate(cfg2, 2, model_config(cfg2, 258), 258)


def test_text_says_host_ram_per_device_and_node_why_faster_layouts_lose_and_what_to_run_next(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--gpus", "8", "--gpu", "H100-80GB"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    # Full fine-tuning of 70.55 B parameters at 16 bytes each fits 8 × 80 GB only offloaded:
    # 131.4 GiB of host RAM per device, 8 of them on the node.
    layout_lines = [line for line in lines if line.startswith("     dp=")]
    assert len(layout_lines) == 5 and all(" GiB per device, " in line and " of 2048 GiB per node" in line
                                          for line in layout_lines)
    assert "(host RAM 131.4 GiB per device, 1051.3 of 2048 GiB per node)" in layout_lines[0]
    # Each term's name is explained once, under the table.
    legend = lines[lines.index("legend:") + 1:]
    for name in ("params", "grads", "optim", "acts", "comm", "overhead", "total", "model state", "host RAM"):
        assert sum(line.startswith(f"  {name} ") for line in legend) == 1, name
    assert any(line.startswith("  comm        communication buffers: ") for line in legend)
    # The faster layouts left out, one line each with its reason and a change that fits.
    head = lines.index("faster layouts left out, closest to fitting first:")
    left_out = lines[head + 1:head + 4]
    assert all(line.startswith("  dp=") and "tok/s): " in line for line in left_out)
    assert "model state 131.4 GiB > 79.1 GiB" in left_out[0] and left_out[0].endswith("use zero=3 with offload=cpu")
    # It ends with what to run: LoRA and QLoRA, which fit without offload, else the offloaded config.
    nxt = lines.index("next: full fine-tuning fits only with offload=cpu on 8 × H100-80GB; LoRA and QLoRA fit on "
                      "the devices alone:")
    commands = [line.split("  #")[0].strip() for line in lines[nxt + 1:]]
    base = "llmsplit plan --model llama-3-70b --gpus 8 --gpu H100-80GB"
    assert commands == [f"{base} --set lora.rank=16", f"{base} --set lora.rank=16 --set lora.base=nf4",
                        f"{base} --emit-config plan.toml"]
    for command in commands[:2]:  # the suggestions work, and fit without offload
        assert main(shlex.split(command)[1:] + ["--json", "--top", "1"]) == 0
        best = json.loads(capsys.readouterr().out)["layouts"][0]
        assert best["fits"] and best["layout"]["offload"] == "none" and best["host_bytes_per_node"] == 0
    # --json has the same, in new fields beside the old ones.
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(lay["host_bytes_per_node"] == 8 * lay["host_bytes_per_device"] for lay in doc["layouts"])
    assert [lay["why_not"] for lay in doc["closest_excluded"]] == [line.split("tok/s): ")[1] for line in left_out]
    assert [step["command"] for step in doc["next_step"]["steps"]] == commands


def test_when_nothing_fits_but_qlora_does_it_says_so_before_the_last_line(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "1", "--gpu", "RTX4090-24GB", "--top", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "faster layouts left out, closest to fitting first:" not in lines  # the layouts shown are those
    nxt = lines.index("next: full fine-tuning does not fit on 1 × RTX4090-24GB; QLoRA fits on the devices alone:")
    assert lines[nxt + 1].startswith("  llmsplit plan --model llama-3-8b --gpus 1 --gpu RTX4090-24GB --set "
                                     "lora.rank=16 --set lora.base=nf4  # QLoRA")
    assert lines[-1] == "no layout of the 15 considered fits 1 × RTX4090-24GB"


@pytest.mark.parametrize("run, says", [
    ({"rows_per_sample": 2}, "train.objective=\"dpo\" does not combine with parallel.cp=2 yet"),
    ({"rollout_rows": 8, "rollout_context": 4096}, "train.objective=\"grpo\" with parallel.cp=2 is not built yet"),
    ({"teacher_params": 10**8}, "train.teacher with parallel.cp=2 is not built yet"),
    ({"compile": True}, "train.compile=true does not combine with parallel.cp=2 yet"),
])
def test_the_search_leaves_context_parallel_out_of_runs_it_cannot_split(run, says):
    """The runs cp does not split are refused by the layout rules themselves (layout/context.py),
    so the search that --auto and plan run never proposes cp for them (it did: validation then
    refused the layout it had chosen)."""
    from llmsplit.errors import ConfigError
    from llmsplit.layout import check
    from llmsplit.plan.search import enumerate_layouts

    cfg, work = preset_config("tiny"), Workload(seq_len=256, global_batch=8, **run)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        check(cfg, Layout(dp=1, cp=2), work, 2)
    assert not any(lay.cp > 1 for lay in enumerate_layouts(cfg, work, 4, get_device("H100-80GB")))
    assert any(lay.cp > 1 for lay in enumerate_layouts(cfg, Workload(seq_len=256, global_batch=8), 4,
                                                       get_device("H100-80GB")))


def test_plan_on_a_dpo_or_grpo_config_counts_its_pairs_and_its_engine(tmp_path):
    """`plan` on a config file sees the run it describes (config.workload_of), flags in place of
    its values: a DPO step's activations hold two rows a sample, a GRPO step adds its engine."""
    from llmsplit.config import to_toml

    reports = {}
    for objective in ("sft", "dpo", "grpo"):
        cfg = load_config(None, ["model.preset=tiny", f"train.objective={objective}", "grpo.rewards=[\"r.py:f\"]",
                                 "train.global_batch=8", "data.seq_len=256"])
        path = tmp_path / f"{objective}.toml"
        path.write_text(to_toml(cfg))
        reports[objective] = plan(model=str(path), gpus=1, gpu="H100-80GB", layout="micro_batch=8",
                                  seq_len=128)
    peak = {k: r["layouts"][0]["memory_per_device"]["total"] for k, r in reports.items()}
    assert all(r["workload"]["seq_len"] == 128 for r in reports.values())
    assert peak["dpo"] > peak["sft"] and peak["grpo"] > peak["sft"], peak
