"""Context parallel training (`parallel.cp`, issue 48): loss and gradient norm at every step
equal to one process for cp 2 and 4, ring and all-to-all, combined with dp × ZeRO-3, tensor
parallel, packed chat documents and LoRA; a cp checkpoint resumes under cp 1 and cp 4; what cp
does not combine with yet is refused before any worker starts.

Cases share launches to stay cheap on a 2-core CI machine: one single-process baseline per
kind of data (plain text; packed chat with LoRA adapters), and each parallel run covers
several combinations at once.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import assert_close_losses, losses, run_cli, train
from llmsplit.cli import main
from llmsplit.errors import ConfigError
from llmsplit.layout import Layout, Workload, check
from llmsplit.models.llama import LlamaConfig

MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128"]
TEXT = [*MODEL, "data.seq_len=64", "train.global_batch=4", "train.micro_batch=2", "train.steps=3",
        "train.warmup_steps=1"]
# Packed conversations, loss on the assistant's turns, evaluated on held-out ones; LoRA on every
# projection (the adapters of q, k and v train through the context-parallel attention).
CHAT = [*MODEL, "data.seq_len=128", "train.global_batch=4", "train.micro_batch=2", "train.steps=3",
        "train.warmup_steps=1", "data.format=chat", "data.eval_fraction=0.1", "train.eval_every=3",
        "lora.rank=4", "lora.alpha=8"]

# name: (workers, settings) of the text runs compared with the single-process one
TEXT_RUNS = {
    "cp4-ring-full-checkpointing": (4, ["parallel.cp=4", "memory.activation_checkpoint=full"]),
    "dp2-cp2-alltoall-zero3": (4, ["parallel.cp=2", "parallel.cp_mode=alltoall", "parallel.zero=3"]),
    "cp2-tp2": (4, ["parallel.cp=2", "parallel.tp=2", "checkpoint.every=2"]),
    # Every ZeRO stage and hybrid sharding reduce (and shard) over dp × cp.
    "dp2-cp2-zero1": (4, ["parallel.cp=2", "parallel.zero=1"]),
    "dp2-cp2-zero2": (4, ["parallel.cp=2", "parallel.zero=2"]),
    "hybrid2-cp2-zero3": (4, ["parallel.cp=2", "parallel.zero=3", "parallel.dp_replicate=2"]),
    # Pipeline stages: each sends its share of a micro-batch on (gpipe: all forwards, then all backwards).
    "cp2-pp2-gpipe": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.pp_schedule=gpipe"]),
}


def conversations(n: int = 48) -> str:
    rng = random.Random(0)
    words = "alpha beta gamma delta split model layer token batch shard ring chunk".split()
    rows = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 2)):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 6)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 8)))})
        rows.append({"messages": messages})
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def text_one(tmp_path_factory):
    run = tmp_path_factory.mktemp("cp-text") / "one"
    train(run, *TEXT, nproc=1)
    return run


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("cp-runs"), {}

    def run(name: str):
        if name not in done:
            nproc, sets = TEXT_RUNS[name]
            train(root / name, *TEXT, *sets, nproc=nproc)
            done[name] = root / name
        return done[name]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TEXT_RUNS))
def test_text_runs_log_the_single_process_loss_and_grad_norm(text_one, text_runs, name):
    run = text_runs(name)
    assert_close_losses(losses(run), losses(text_one))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == TEXT_RUNS[name][0] and summary["layout"]["cp"] in (2, 4)


@pytest.mark.slow
def test_a_cp2_checkpoint_continues_exactly_under_cp1_and_cp4(text_one, text_runs, tmp_path):
    source = text_runs("cp2-tp2") / "checkpoints" / "step_2"
    for name, nproc, sets in (("cp1", 1, []), ("cp4", 4, ["parallel.cp=4"])):
        train(tmp_path / name, *TEXT, *sets, nproc=nproc, extra=("--resume", str(source)))
        assert_close_losses(losses(tmp_path / name), losses(text_one)[2:])


@pytest.mark.slow
def test_packed_documents_with_lora_log_the_single_process_losses_with_and_without_pipeline_stages(tmp_path):
    (tmp_path / "chat.jsonl").write_text(conversations())
    data = f"data.source={tmp_path / 'chat.jsonl'}"
    train(tmp_path / "one", *CHAT, data, nproc=1)
    train(tmp_path / "cp2", *CHAT, data, "parallel.cp=2", nproc=2)
    # Pipeline stages each get their share's documents with every micro-batch.
    train(tmp_path / "cp2pp2", *CHAT, data, "parallel.cp=2", "parallel.pp=2", nproc=4)
    evals = {name: [r["eval_loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text()
                                                   .splitlines()) if "eval_loss" in r]
             for name in ("cp2", "cp2pp2", "one")}
    assert len(evals["one"]) == 1
    for name in ("cp2", "cp2pp2"):
        assert_close_losses(losses(tmp_path / name), losses(tmp_path / "one"))
        assert_close_losses(evals[name], evals["one"])
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["padding_fraction"] < 0.5  # rows hold several documents, so cp splits some


@pytest.mark.slow
def test_a_mixture_of_experts_routes_and_balances_as_one_process_under_cp(tmp_path):
    """Routing is per token, so a cp rank's share routes as the whole row would; the experts'
    token counts (and the bias balancing that moves on them) sum disjoint shares; with expert
    parallel, an expert's gradient is averaged over its replicas' cp ranks too. Loss, grad norm
    and every step's tokens per expert equal one process's: cp 2, and dp 2 × ep 2 × cp 2 ZeRO-3."""
    sets = ["model.preset=tiny-moe", "data.seq_len=64", "train.global_batch=4", "train.steps=3",
            "train.warmup_steps=1", "train.moe_bias_rate=0.01"]
    train(tmp_path / "one", *sets, "train.micro_batch=4", nproc=1)
    train(tmp_path / "cp2", *sets, "train.micro_batch=2", "parallel.cp=2", nproc=2)
    train(tmp_path / "ep2cp2", *sets, "train.micro_batch=2", "parallel.cp=2", "parallel.ep=2", "parallel.zero=3",
          nproc=4)
    counts = {name: [r["tokens_per_expert"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text()
                                                         .splitlines())] for name in ("cp2", "ep2cp2", "one")}
    assert len(counts["one"]) == 3
    for name in ("cp2", "ep2cp2"):
        assert_close_losses(losses(tmp_path / name), losses(tmp_path / "one"))
        assert counts[name] == counts["one"], name


@pytest.mark.slow
def test_a_sliding_window_attends_as_one_process_under_the_ring_and_alltoall(text_one, tmp_path):
    """Keys fewer than model.sliding_window positions back, masked over global positions per
    block of the ring: 12 against chunks of 16 (cp 2) and 8 tokens (cp 4), so blocks lie wholly
    outside the window, across its edge and inside it. The window changes the losses; cp 4
    ring and cp 2 all-to-all log one process's."""
    sets = [*TEXT, "model.sliding_window=12"]
    train(tmp_path / "one", *sets, nproc=1)
    assert losses(tmp_path / "one")[0] != losses(text_one)[0]
    for name, nproc, split in (("ring4", 4, ["parallel.cp=4"]),
                               ("alltoall2", 2, ["parallel.cp=2", "parallel.cp_mode=alltoall"])):
        train(tmp_path / name, *sets, *split, nproc=nproc)
        assert_close_losses(losses(tmp_path / name), losses(tmp_path / "one"))


# ---- refused before any worker starts -------------------------------------------------------

@pytest.mark.parametrize("sets, nproc, fragment", [
    (["parallel.cp=3", "data.seq_len=128"], 3,
     "data.seq_len=128 is not divisible by 2 × parallel.cp=3 = 6: context parallel cuts each sequence into 2 × cp"),
    (["parallel.cp=3", "parallel.cp_mode=alltoall", "data.seq_len=96"], 3,
     "parallel.cp_mode=\"alltoall\" gives each of the parallel.cp=3 ranks a share of the attention heads, and "
     "model.n_heads=4 does not divide by 3; use parallel.cp in 1, 2, 4 or parallel.cp_mode=\"ring\""),
    (["parallel.cp=2", "parallel.cp_mode=ulysses"], 2, "parallel.cp_mode='ulysses' is not one of: 'ring', 'alltoall'"),
    (["parallel.cp=2"], 3, "world size 3 is not divisible by parallel.cp × parallel.tp × parallel.pp = 2"),
])
def test_bad_cp_layouts_exit_2_with_the_rule_and_the_fix(tmp_path, capsys, sets, nproc, fragment):
    args = ["train", "--nproc", str(nproc), "--run-dir", str(tmp_path / "run")]
    for s in [*MODEL, *sets]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert fragment in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("sets, fragment", [
    (["train.objective=dpo"], "train.objective=\"dpo\" does not combine with parallel.cp=2 yet; set parallel.cp=1"),
    (["train.compile=true"], "train.compile=true does not combine with parallel.cp=2 yet"),
])
def test_training_keys_cp_does_not_combine_with_yet_are_refused(sets, fragment):
    from llmsplit.config import load_config, validate

    with pytest.raises(ConfigError) as err:
        validate(load_config(None, [*MODEL, "parallel.cp=2", *sets]), 2)
    assert fragment in str(err.value)


def test_the_cli_exits_2_for_a_sequence_cp_cannot_cut(tmp_path):
    proc = run_cli("train", "--nproc", "3", "--run-dir", str(tmp_path / "run"), "--set", "parallel.cp=3",
                   "--set", "data.seq_len=128", check=False)
    assert proc.returncode == 2 and "use a data.seq_len that is a multiple of 6" in proc.stderr, proc.stderr


@pytest.mark.parametrize("model, layout, fragment", [
    (LlamaConfig(attn_softcap=50.0), Layout(cp=2), "does not combine with model.attn_softcap=50.0 yet"),
    (LlamaConfig(n_heads=8), Layout(cp=4, tp=4, cp_mode="alltoall"), "model.n_heads=8 (2 per tensor-parallel rank)"),
])
def test_combinations_not_supported_yet_are_refused_by_name(model, layout, fragment):
    with pytest.raises(ConfigError, match="set parallel|use parallel") as err:
        check(model, layout, Workload(seq_len=64, global_batch=8))
    assert fragment in str(err.value)


def test_the_world_counts_cp_ranks_and_inference_refuses_cp():
    assert Layout(dp=2, cp=2, tp=2).world == 8 and Layout(dp=2, cp=2, zero=3).shard == 4
    with pytest.raises(ConfigError, match="inference does not split a prompt"):
        check(None, Layout(cp=2), Workload(seq_len=64, global_batch=1, mode="infer"))


def test_shard_rows_numbers_documents_over_the_whole_row_and_keeps_global_positions():
    import torch.distributed as dist

    from llmsplit.parallel.context_parallel import shard_rows

    class Rank1Of2:  # what shard_rows asks of a process group
        def size(self):
            return 2

        def rank(self):
            return 1

    tokens = torch.arange(8)[None]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])  # documents 1, 2, 3
    inputs, targets, pos, docs = shard_rows(tokens, tokens + 1, positions, Rank1Of2())
    assert inputs.tolist() == [[2, 3, 4, 5]] and targets.tolist() == [[3, 4, 5, 6]]
    assert pos.tolist() == [[2, 0, 1, 2]] and docs.tolist() == [[1, 2, 2, 2]]
    _, _, pos, docs = shard_rows(tokens.expand(3, -1), tokens.expand(3, -1), None, Rank1Of2())
    assert pos.tolist() == [[2, 3, 4, 5]] * 3 and docs is None
    assert not dist.is_initialized()


@pytest.mark.parametrize("mode", ["ring", "alltoall"])
def test_the_planner_counts_a_cp_ranks_share_of_the_activations_and_its_communication(mode):
    from llmsplit.models.presets import preset_config
    from llmsplit.plan.cost import training_cost
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device

    cfg, device = preset_config("llama-3-8b"), get_device("H100-80GB")
    work = Workload(seq_len=8192, global_batch=8)
    one, four = (Layout(dp=8 // cp, cp=cp, zero=3, cp_mode=mode) for cp in (1, 4))
    check(cfg, four, work, 8)
    memory = {cp: memory_per_device(cfg, lay, work, device) for cp, lay in ((1, one), (4, four))}
    assert memory[4].activations < 0.35 * memory[1].activations
    assert memory[4].detail["comm"]["cp_attention"] > 0 and "cp_attention" not in memory[1].detail["comm"]
    assert training_cost(cfg, four, work, device).detail["cp_comm_s"] > 0
    assert training_cost(cfg, one, work, device).detail["cp_comm_s"] == 0


def test_the_planner_chooses_cp_for_a_sequence_that_fits_no_other_way(capsys):
    """Llama-3-8B at 128k tokens on 8 H100s: the fastest layouts that fit split the sequence;
    `--set model.max_seq_len` raises a preset's context."""
    from llmsplit.cli import main

    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--seq-len", "131072", "--global-batch", "8",
                 "--set", "model.max_seq_len=131072", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["layouts"][0]
    assert best["fits"] and best["layout"]["cp"] > 1, best["layout"]
    assert all(c["layout"]["cp"] == 1 for c in report["layouts"] if c["layout"]["pp"] > 1)  # cp x pp: not yet
