"""GRPO (issue 47 item 3): the loss, advantages and KL on a fixed batch against a hand-worked
reference, and its value and gradient against the formula written out token by token."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import TINY, run_cli, train
from llmsplit.data.loader import IGNORE
from llmsplit.io.weights import RunWeights
from llmsplit.train.grpo import GroupRelativeObjective, group_advantages


def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    std = math.sqrt(4 * 0.25 / 3)  # unbiased, as TRL's torch.std
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def _batch():
    """Two rows of three target columns (+ the row index): row 0 scores its last two tokens,
    row 1 all three."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.tensor([[IGNORE, 2, 4, 0], [1, 3, 0, 1]])
    return logits, targets


def _by_hand(logits, targets, adv, ref, beta, kind, denominator):
    """The loss written out token by token (ratio 1: one optimizer step per generation)."""
    logp = torch.log_softmax(logits.detach().double(), -1)
    total = 0.0
    for r in range(targets.shape[0]):
        terms = []
        for t in range(targets.shape[1] - 1):
            tok = int(targets[r, t])
            if tok == IGNORE:
                continue
            lp = float(logp[r, t, tok])
            kl = math.exp(ref[r][t] - lp) - (ref[r][t] - lp) - 1 if ref is not None else 0.0
            terms.append(-adv[r] + beta * kl)
        total += sum(terms) / (len(terms) if kind == "grpo" else 1)
    return total / denominator


@pytest.mark.parametrize("kind,beta", [("grpo", 0.0), ("grpo", 0.04), ("dr_grpo", 0.04)])
def test_loss_and_gradient_equal_the_hand_worked_reference(kind, beta):
    logits, targets = _batch()
    adv = [1.5, -0.5]
    ref = [[0.0, -1.2, -2.0], [-0.7, -1.9, -1.1]] if beta else None
    objective = GroupRelativeObjective(SimpleNamespace(epsilon=0.2, beta=beta, loss=kind), torch.device("cpu"))
    objective.set_rollouts(torch.tensor(adv), None if ref is None else torch.tensor(ref))
    denominator = 2.0 if kind == "grpo" else 2.0 * 3
    loss = objective.loss(logits, targets, denominator)
    assert float(loss.detach()) == pytest.approx(_by_hand(logits, targets, adv, ref, beta, kind, denominator), rel=1e-6)
    loss.backward()
    # d loss / d logits: each scored token's coefficient times (one-hot - softmax).
    p = torch.softmax(logits.detach().double(), -1)
    expected = torch.zeros_like(p)
    for r in range(2):
        scored = [t for t in range(3) if targets[r, t] != IGNORE]
        for t in scored:
            tok = int(targets[r, t])
            lp = math.log(float(p[r, t, tok]))
            dkl = -math.exp(ref[r][t] - lp) + 1 if ref is not None else 0.0  # d kl / d logp
            coef = (-adv[r] + beta * dkl) / (len(scored) if kind == "grpo" else 1) / denominator
            onehot = torch.zeros(5, dtype=torch.double)
            onehot[tok] = 1
            expected[r, t] = coef * (onehot - p[r, t])
    assert torch.allclose(logits.grad.double(), expected, atol=1e-6)
    figures = objective.step_record(SimpleNamespace(global_sum=lambda t: t))
    assert figures["clip_ratio"] == 0.0  # the ratio is 1: one optimizer step per generation batch
    if beta:
        kls = [math.exp(ref[r][t] - math.log(float(p[r, t, int(targets[r, t])]))) -
               (ref[r][t] - math.log(float(p[r, t, int(targets[r, t])]))) - 1
               for r in range(2) for t in range(3) if targets[r, t] != IGNORE]
        assert figures["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-5)
    else:
        assert "kl" not in figures


# ---------------------------------------------------------------- runs

REWARD = '''
import os

CALLS = [0]


def lowercase(prompts, completions, **columns):
    """The share of a completion's characters that are lowercase letters; raises at call
    FAIL_AT_CALL (a grader that went down mid-run)."""
    CALLS[0] += 1
    if CALLS[0] == int(os.environ.get("FAIL_AT_CALL", "0")):
        raise ValueError("the grader is down")
    return [sum(c.islower() for c in text) / max(len(text), 1) for text in completions]
'''


def grpo_sets(tmp_path, steps: int, *extra: str) -> list[str]:
    (tmp_path / "rewards.py").write_text(REWARD)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Item {i}:", "id": i}) + "\n"
                                                    for i in range(20)))
    return [*TINY, f"train.steps={steps}", "train.warmup_steps=0", "train.global_batch=16", "train.micro_batch=4",
            "train.objective=grpo", f"grpo.rewards={tmp_path / 'rewards.py'}:lowercase", "grpo.num_generations=4",
            "grpo.max_completion_tokens=12", f"data.source={tmp_path / 'prompts.jsonl'}", "data.eval_fraction=0.2",
            "train.lr=3e-3", *extra]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_layouts_equal_one_process_and_the_engine_holds_the_trained_weights(tmp_path):
    """DDP and ZeRO-1/2/3 over 2 workers, and tp + LoRA, against one process: the same
    completions (rewards), loss and gradient norm at every step; the engine's weights after the
    last step equal the checkpoint's bit for bit (gathered from FSDP shards; under tp + LoRA
    only adapters move)."""
    one, zero3, tp_lora = tmp_path / "one", tmp_path / "zero3", tmp_path / "tp_lora"
    train(one, *grpo_sets(tmp_path, 3, "train.eval_every=3"))
    train(zero3, *grpo_sets(tmp_path, 3, "train.eval_every=3", "parallel.zero=3"), nproc=2,
          env={"LLMSPLIT_DUMP_ENGINE": str(tmp_path / "zero3-engine")})
    want = records(one)
    for zero in (0, 1, 2):  # DDP, and the optimizer state / gradients sharded
        train(tmp_path / f"zero{zero}", *grpo_sets(tmp_path, 3, "train.eval_every=3", f"parallel.zero={zero}"), nproc=2)
    for name in ("zero0", "zero1", "zero2", "zero3"):
        got = records(tmp_path / name)
        assert len(got) == len(want), name
        for a, b in zip(got, want):
            assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"], name
            assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert got[-1]["eval_reward"] == pytest.approx(want[-1]["eval_reward"], abs=1e-9)
    # A reward function that fails at step 3: the run stops naming it, and its step-2 checkpoint
    # resumes into the step 3 of the run that never stopped.
    crashed = tmp_path / "crashed"
    out = train(crashed, *grpo_sets(tmp_path, 3, "train.eval_every=3", "checkpoint.every=2"), check=False,
                env={"FAIL_AT_CALL": "3"})
    assert out.returncode == 1, out.stderr
    assert "reward function 'lowercase' raised ValueError: the grader is down; fix the function" in out.stderr
    train(crashed, extra=("--resume", "auto"))
    resumed = records(crashed)[-1]
    assert resumed["step"] == 3 and resumed["reward"] == want[2]["reward"]
    assert resumed["grad_norm"] == pytest.approx(want[2]["grad_norm"], rel=1e-5)
    engine = torch.load(tmp_path / "zero3-engine" / "engine-step3.pt", weights_only=True)
    trained = RunWeights(zero3)
    for name in trained.names():
        assert torch.equal(engine[name], trained.read(name)), name

    lora = ("lora.rank=4", "lora.alpha=8")
    train(tp_lora, *grpo_sets(tmp_path, 2, "train.eval_every=2", "parallel.tp=2", *lora),
          nproc=2, env={"LLMSPLIT_DUMP_ENGINE": str(tmp_path / "tp-engine")})
    train(tmp_path / "lora_one", *grpo_sets(tmp_path, 2, "train.eval_every=2", *lora))
    for a, b in zip(records(tp_lora), records(tmp_path / "lora_one"), strict=True):  # tp + LoRA as one process
        assert a["reward"] == b["reward"] and abs(a["loss"] - b["loss"]) <= 1e-5
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    engine = torch.load(tmp_path / "tp-engine" / "engine-step2.pt", weights_only=True)
    adapters = read_adapters_of(tp_lora)
    assert adapters and all(torch.equal(engine[name], t) for name, t in adapters.items() if name.endswith("lora_a"))
    for name, b in adapters.items():
        if name.endswith("lora_b"):
            assert torch.equal(engine[name + "_scaled"], b * 2.0), name


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_a_qlora_base_under_zero3_equals_one_process_and_the_engine_holds_the_trained_base(tmp_path, base):
    """GRPO over a quantized base (QLoRA): ZeRO-3 over 2 workers logs one process's rewards,
    losses and gradient norms, and each rank's engine holds the base exactly as training
    computes with it (dequantized shard by shard, to the bit) with the adapters on top."""
    from llmsplit.adapters.qlora import dequantize, quantize_weight
    from llmsplit.config import model_config
    from llmsplit.io.run_dir import read_run_config
    from llmsplit.io.tokenizer import load_tokenizer
    from llmsplit.models.llama import Transformer

    qlora = ("lora.rank=4", "lora.alpha=8", f"lora.base={base}", "model.dim=256", "model.ffn_dim=512")  # NF4's blocks
    one, zero3 = tmp_path / "q_one", tmp_path / "q_zero3"
    train(one, *grpo_sets(tmp_path, 2, *qlora))
    train(zero3, *grpo_sets(tmp_path, 2, *qlora, "parallel.zero=3"), nproc=2,
          env={"LLMSPLIT_DUMP_ENGINE": str(tmp_path / "q-engine")})
    for a, b in zip(records(zero3), records(one), strict=True):
        assert a["reward"] == b["reward"] and abs(a["loss"] - b["loss"]) <= 1e-6
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    cfg = read_run_config(one)
    init = Transformer(model_config(cfg, load_tokenizer(cfg.data.tokenizer).vocab_size))
    init.init_weights(cfg.train.seed)  # the base training drew from its seed, then quantized
    engine = torch.load(tmp_path / "q-engine" / "engine-step1.pt", weights_only=True)
    quantized = 0
    for name, w in init.state_dict().items():
        if name not in engine:
            continue  # rope tables the engine builds for its own context
        if name.startswith("layers.") and w.dim() == 2:  # the linear layers' weights: quantized in training
            w, quantized = dequantize(quantize_weight(w, base)), quantized + 1
        assert torch.equal(engine[name], w), name
    assert quantized == 2 * 7 and any(name.endswith("lora_b_scaled") for name in engine)


def test_pipeline_stages_equal_one_process_and_every_engine_holds_the_whole_model(tmp_path):
    """GRPO with the model in 2 pipeline stages: the same completions, loss and gradient norm as
    one process at every step, and rank 0's engine (stage 0's) holds every stage's layers, equal
    to the checkpoint's bit for bit (each stage's weights broadcast to the other)."""
    one, pp = tmp_path / "one", tmp_path / "pp"
    kl = "grpo.beta=0.04"  # the reference too: a frozen copy in every rank's engine, every stage's layers
    train(one, *grpo_sets(tmp_path, 3, "train.eval_every=3", kl))
    train(pp, *grpo_sets(tmp_path, 3, "train.eval_every=3", kl, "parallel.pp=2"), nproc=2,
          env={"LLMSPLIT_DUMP_ENGINE": str(tmp_path / "pp-engine")})
    for a, b in zip(records(pp), records(one), strict=True):
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-5, abs=1e-9)
    assert records(pp)[-1]["eval_reward"] == pytest.approx(records(one)[-1]["eval_reward"], abs=1e-9)
    engine = torch.load(tmp_path / "pp-engine" / "engine-step3.pt", weights_only=True)
    trained = RunWeights(pp)
    assert {n.split(".")[1] for n in trained.names() if n.startswith("layers.")} == {"0", "1"}
    for name in trained.names():
        assert torch.equal(engine[name], trained.read(name)), name
    lora = ("lora.rank=4", "lora.alpha=8")  # under LoRA only the adapters move, every stage's
    train(tmp_path / "pp_lora", *grpo_sets(tmp_path, 2, "train.eval_every=2", "parallel.pp=2", *lora), nproc=2,
          env={"LLMSPLIT_DUMP_ENGINE": str(tmp_path / "pp-lora-engine")})
    train(tmp_path / "lora_one", *grpo_sets(tmp_path, 2, "train.eval_every=2", *lora))
    for a, b in zip(records(tmp_path / "pp_lora"), records(tmp_path / "lora_one"), strict=True):
        assert a["reward"] == b["reward"] and abs(a["loss"] - b["loss"]) <= 1e-6
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    engine = torch.load(tmp_path / "pp-lora-engine" / "engine-step2.pt", weights_only=True)
    adapters = read_adapters_of(tmp_path / "pp_lora")
    assert {n.split(".")[1] for n in adapters} == {"0", "1"}
    for name, t in adapters.items():
        want = (engine[name + "_scaled"], t * 2.0) if name.endswith("lora_b") else (engine[name], t)
        assert torch.equal(*want), name


def read_adapters_of(run_dir: Path) -> dict:
    from llmsplit.io import dcp_files
    from llmsplit.io.run_dir import read_run_config, resolve_checkpoint

    _, ck = resolve_checkpoint(run_dir)
    saved = dcp_files.saved_model_shapes(dcp_files.read_metadata(ck))
    state = {"model": {name: torch.empty(shape) for name, shape in saved.items() if "lora_" in name}}
    dcp_files.load(state, ck)
    assert read_run_config(run_dir).lora.rank == 4
    return state["model"]


def test_the_reward_rises(tmp_path):
    """A tiny model from its seed learns a trivial reward (lowercase letters) in 12 steps."""
    run = tmp_path / "run"
    out = train(run, *grpo_sets(tmp_path, 12, "train.eval_every=12", "train.lr=1e-2"))
    rewards = [r["reward"] for r in records(run)]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.05, rewards
    assert "reward" in out.stdout + out.stderr
    assert 0 <= records(run)[-1]["eval_reward"] <= 1
    pytest.importorskip("matplotlib")
    from llmsplit.diagnose.plot import plot_run

    assert run / "plots" / "reward.png" in plot_run(run)  # `llmsplit plot`: reward against step


def test_the_planner_counts_the_rollout_engine():
    """Each rank's engine: the whole model in fp32, a reference copy with beta > 0 (none under
    LoRA: the base is the reference), and the KV pool of its share of the step's completions."""
    from llmsplit.config import layout_of, load_config, model_config, workload_of
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device
    from llmsplit.models.weight_shapes import model_params

    base = ["data.seq_len=1024", "train.global_batch=16", "train.micro_batch=2", "parallel.dp=2",
            "train.objective=grpo", "grpo.rewards=m:f", "grpo.num_generations=4"]
    engines = {}
    for name, extra in {"sft": ["train.objective=sft"], "grpo": [], "beta": ["grpo.beta=0.04"],
                        "lora": ["grpo.beta=0.04", "lora.rank=8"]}.items():
        cfg = load_config(None, base + extra)
        model = model_config(cfg, 258)
        bd = memory_per_device(model, layout_of(cfg, 2), workload_of(cfg), get_device("H100-80GB"))
        engines[name] = bd.detail["rollout_engine"]
    weights = model_params(model) * 4
    kv = 2 * model.n_layers * model.n_kv_heads * model.head_dim * 4 * 8 * 1024  # 8 completions a rank
    assert engines["sft"] == {}
    assert engines["grpo"] == {"weights": weights, "reference": 0, "kv_pool": kv}
    assert engines["beta"]["reference"] == weights
    assert engines["lora"]["reference"] == 0 and engines["lora"]["weights"] > weights  # base + adapters


def test_a_prompt_and_its_completion_longer_than_a_row_are_refused_before_training(tmp_path):
    out = run_cli("train", "--run-dir", str(tmp_path / "run"), *[a for s in grpo_sets(tmp_path, 2, "data.seq_len=16")
                                                                  for a in ("--set", s)], check=False)
    assert out.returncode == 2 and "grpo.max_completion_tokens is 12: more than data.seq_len=16" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
