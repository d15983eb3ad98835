"""DPO (issue 47 item 2): the loss and its figures against hand-worked values, preference rows
read in TRL's three shapes with only the replies scored, bad rows refused before any worker
starts, and real runs under pipeline x tensor parallel and under ZeRO-3 with LoRA (resumed from
another layout's checkpoint) logging the single process's loss, gradient norm and figures."""

import json
import math
import random

import pytest
import torch

from helpers import assert_close_losses, losses, run_cli, train

SETS = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "data.seq_len=128", "train.global_batch=4", "train.micro_batch=2", "train.steps=4", "train.warmup_steps=1",
        "train.objective=dpo", "data.eval_fraction=0.1", "train.eval_every=2", "checkpoint.every=2"]
FIGURES = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected"]


def preference_rows(n: int = 40) -> str:
    """Rows in each of TRL's shapes: chosen replies from one half of the words, rejected from the other."""
    rng = random.Random(0)
    words = "alpha beta gamma delta split model layer token batch shard pipe tensor".split()
    rows = []
    for i in range(n):
        prompt = " ".join(rng.choices(words, k=rng.randint(2, 8)))
        good, bad = (" ".join(rng.choices(half, k=rng.randint(1, 10))) for half in (words[:6], words[6:]))
        user = {"role": "user", "content": prompt}
        if i % 3 == 0:
            rows.append({"prompt": [user], "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})
        elif i % 3 == 1:  # implicit prompt: whole conversations that share it
            rows.append({"chosen": [user, {"role": "assistant", "content": good}],
                         "rejected": [user, {"role": "assistant", "content": bad}]})
        else:
            rows.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return "".join(json.dumps(r) + "\n" for r in rows)


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- the maths, by hand


def test_dpo_losses_match_hand_worked_values():
    from llmsplit.train.dpo import dpo_losses

    c, r, rc, rr = (torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0))  # logits = (2) - (0) = 2
    softplus = lambda x: math.log1p(math.exp(x))
    assert dpo_losses(c, r, rc, rr, 0.1).item() == pytest.approx(softplus(-0.2), rel=1e-6)
    assert dpo_losses(c, r, rc, rr, 0.1, "sigmoid", 0.1).item() == pytest.approx(
        0.9 * softplus(-0.2) + 0.1 * softplus(0.2), rel=1e-6)
    assert dpo_losses(c, r, rc, rr, 0.1, "ipo").item() == pytest.approx((2 - 5) ** 2, rel=1e-6)


def test_sequence_logps_sum_the_scored_tokens_only():
    from llmsplit.data.loader import IGNORE
    from llmsplit.train.dpo import sequence_logps

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    targets = torch.tensor([[3, 4, IGNORE, 7, 1, 0], [IGNORE, IGNORE, 2, 2, IGNORE, 0]])
    got, counts = sequence_logps(logits, targets)
    logp = logits.log_softmax(-1)
    want = [sum(logp[row, t, targets[row, t]].item() for t in range(5) if targets[row, t] != IGNORE) for row in (0, 1)]
    assert got.tolist() == pytest.approx(want, rel=1e-6) and counts.tolist() == [4, 2]


def test_objective_figures_and_filler_pairs():
    """Two real pairs and a filler one: the loss is the real pairs' sum over the denominator, the
    figures TRL's, the filler (pair index NO_PAIR) counts nowhere."""
    from llmsplit.config.objective import DpoSection
    from llmsplit.data.preference import NO_PAIR
    from llmsplit.train.dpo import PreferenceObjective, dpo_losses

    obj = PreferenceObjective(DpoSection(beta=0.5), torch.device("cpu"))
    obj.tables["train"] = torch.tensor([[-2.0, -3.0], [-1.0, -1.0]])
    # Row logps from logits that put all mass on token 0 or spread it; targets pick tokens.
    logits = torch.zeros(6, 1, 2)
    logits[:, 0, 0] = torch.tensor([0.0, 5.0, 1.0, -1.0, 0.0, 0.0])
    targets = torch.tensor([[0, 0], [1, 0], [0, 1], [1, 1], [0, NO_PAIR], [1, NO_PAIR]])
    loss = obj.loss(logits, targets, denominator=2.0)
    logp = logits[:, 0].log_softmax(-1)[torch.arange(6), targets[:, 0]]
    want = dpo_losses(logp[[0, 2]], logp[[1, 3]], torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -1.0]), 0.5)
    assert loss.item() == pytest.approx(want.sum().item() / 2, rel=1e-6)

    class OneRank:  # global_sum on one process: the sum itself
        global_sum = staticmethod(lambda t: t)

    figures = obj.step_record(OneRank())
    reward_c = 0.5 * (logp[[0, 2]] - torch.tensor([-2.0, -1.0]))
    reward_r = 0.5 * (logp[[1, 3]] - torch.tensor([-3.0, -1.0]))
    assert figures["rewards/chosen"] == pytest.approx(reward_c.mean().item(), rel=1e-6)
    assert figures["rewards/margins"] == pytest.approx((reward_c - reward_r).mean().item(), rel=1e-5)
    assert figures["rewards/accuracies"] == pytest.approx((reward_c > reward_r).float().mean().item())
    assert figures["logps/rejected"] == pytest.approx(logp[[1, 3]].mean().item(), rel=1e-6)
    assert obj.pending == []  # a record starts the next step's figures afresh


# ---------------------------------------------------------------- the data


def test_rows_of_each_shape_score_the_reply_alone(tmp_path):
    from llmsplit.data.preference import PreferenceSampler, read_preference_files
    from llmsplit.io.tokenizer import load_tokenizer

    tok = load_tokenizer("byte")
    ask = {"role": "user", "content": "Sky?"}
    shapes = [{"prompt": "Sky?", "chosen": "Blue.", "rejected": "Green."},
              {"prompt": [ask], "chosen": [{"role": "assistant", "content": "Blue."}],
               "rejected": [{"role": "assistant", "content": "Green."}]},
              {"chosen": [ask, {"role": "assistant", "content": "Blue."}],
               "rejected": [ask, {"role": "assistant", "content": "Green."}]},
              # A two-turn prompt: its own assistant turn is context, never scored.
              {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}, ask],
               "chosen": "Blue.", "rejected": "Green."}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shapes))
    pairs = read_preference_files([tmp_path / "p.jsonl"], tok)
    batch = PreferenceSampler(pairs, 96, 4, 0).rows([0, 1, 2, 3])
    assert batch.inputs.shape == (8, 96) and batch.targets.shape == (8, 97)
    assert batch.targets[:, -1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # pairs side by side, their index last
    scored = [tok.decode([t for t in row[:-1].tolist() if t >= 0]) for row in batch.targets]
    assert all(text.strip().startswith("Blue.") for text in scored[0::2]), scored
    assert all(text.strip().startswith("Green.") for text in scored[1::2]), scored
    assert all("Hello" not in text and "Sky" not in text for text in scored)
    # Cut to the longest row rounded up to 8 (as TRL pads to the longest): the same scored tokens.
    cut = PreferenceSampler(pairs, 96, 4, 0, width_multiple=8).rows([0, 1, 2, 3])
    width = cut.inputs.shape[1]
    assert width % 8 == 0 and width < 96 and torch.equal(cut.inputs, batch.inputs[:, :width])
    assert torch.equal(cut.targets[:, :-1], batch.targets[:, :width]) and (batch.targets[:, width:-1] == -100).all()
    assert cut.targets[:, -1].tolist() == batch.targets[:, -1].tolist()


@pytest.mark.parametrize("row, says", [
    ({"prompt": "hi", "chosen": "yes"}, 'has no "rejected"'),
    ({"chosen": "yes", "rejected": "no"}, "has no prompt"),
    ({"prompt": "hi", "chosen": [{"role": "user", "content": "x"}], "rejected": "no"}, "no assistant message"),
    ({"prompt": "hi", "chosen": 3, "rejected": "no"}, "must be text or a non-empty list"),
    ("not json", "is not valid JSON"),
])
def test_bad_rows_are_refused_before_any_worker_starts(tmp_path, row, says):
    path = tmp_path / "pairs.jsonl"
    path.write_text(preference_rows(3) + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    out = run_cli("train", "--run-dir", str(tmp_path / "run"), *[a for s in SETS for a in ("--set", s)],
                  "--set", f"data.source={path}", check=False)
    assert out.returncode == 2 and "line 4" in out.stderr and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("sets, says", [
    (["dpo.beta=0"], "dpo.beta=0.0 must be greater than 0"),
    (["dpo.loss=hinge"], "dpo.loss='hinge' is not one of"),
    (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "applies to dpo.loss=\"sigmoid\" only"),
    (["data.format=text"], "set data.format=\"chat\""),
    (["train.objective=grpo", "grpo.rewards=r.py:f", "grpo.num_generations=2"], "no \"prompt\" key"),  # pairs, not prompts
    (["parallel.pp=2", "parallel.pp_schedule=zbv", "train.eval_every=0", "data.eval_fraction=0"], "forward-only pass"),
])
def test_bad_keys_are_refused(tmp_path, sets, says):
    (tmp_path / "pairs.jsonl").write_text(preference_rows(3))
    out = run_cli("train", "--run-dir", str(tmp_path / "run"), "--nproc", "2",
                  *[a for s in SETS + sets + [f"data.source={tmp_path / 'pairs.jsonl'}"] for a in ("--set", s)],
                  check=False)
    assert out.returncode == 2 and says in out.stderr, out.stderr


# ---------------------------------------------------------------- real runs under layouts


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """(data file, the single-process run, the single-process LoRA run)."""
    base = tmp_path_factory.mktemp("dpo")
    (base / "pairs.jsonl").write_text(preference_rows())
    data = f"data.source={base / 'pairs.jsonl'}"
    train(base / "one", *SETS, data, nproc=1)
    train(base / "lora", *SETS, data, "lora.rank=4", nproc=1)
    return data, base / "one", base / "lora"


@pytest.mark.slow
def test_the_first_step_is_the_reference_and_figures_are_logged(one):
    rows = records(one[1])
    assert rows[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)  # policy == reference: every margin 0
    assert all(rows[0][name] == 0 for name in FIGURES[:3])
    assert all(name in r for r in rows for name in FIGURES)
    assert rows[-1]["rewards/accuracies"] > 0.5 and rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((one[1] / "summary.json").read_text())
    assert summary["eval_loss"] == rows[-1]["eval_loss"] and "eval_rewards/margins" in summary


def _assert_same_run(got, want, first_step: int = 1):
    assert_close_losses(losses(got), losses(want)[first_step - 1:])
    for a, b in zip(records(got), records(want)[first_step - 1:]):
        for name in FIGURES + ["eval_loss"] * ("eval_loss" in b):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-6), (a["step"], name)


@pytest.mark.slow
def test_pipeline_times_tensor_parallel_logs_the_single_process_run(one, tmp_path):
    train(tmp_path / "run", *SETS, one[0], "parallel.pp=2", "parallel.tp=2", nproc=4)
    _assert_same_run(tmp_path / "run", one[1])


@pytest.mark.slow
def test_lora_under_zero3_resumes_a_single_process_checkpoint(one, tmp_path):
    """The reference log-probs travel in the checkpoint: steps 3-4 under ZeRO-3 on 2 workers
    continue the single-process LoRA run exactly."""
    train(tmp_path / "run", *SETS, one[0], "lora.rank=4", "parallel.zero=3", nproc=2,
          extra=("--resume", str(one[2] / "checkpoints" / "step_2")))
    _assert_same_run(tmp_path / "run", one[2], first_step=3)


def test_the_planner_counts_a_pair_as_two_sequences():
    """train.micro_batch counts pairs under DPO: the planner's activations and tokens per step are
    those of twice as many sequences as the same numbers of SFT samples."""
    from dataclasses import replace

    from llmsplit.config import layout_of, load_config, model_config, workload_of
    from llmsplit.plan.cost import training_cost
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device

    sft = load_config(None, ["data.seq_len=1024", "train.global_batch=8", "train.micro_batch=2", "parallel.dp=1"])
    dpo = load_config(None, ["data.seq_len=1024", "train.global_batch=8", "train.micro_batch=2", "parallel.dp=1",
                             "train.objective=dpo"])
    model, device = model_config(sft, 258), get_device("H100-80GB")
    works = [workload_of(c) for c in (sft, dpo)]
    assert [w.rows_per_sample for w in works] == [1, 2]
    layout = layout_of(sft, 1)
    acts = [memory_per_device(model, layout, w, device).activations for w in works]
    assert acts[1] == pytest.approx(2 * acts[0], rel=0.05)
    costs = [training_cost(model, layout, w, device) for w in works]
    assert costs[1].tokens_per_s == pytest.approx(costs[0].tokens_per_s, rel=0.05)  # twice the tokens, twice the time
    assert replace(works[1], rows_per_sample=1) == works[0]
