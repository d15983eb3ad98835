"""Chat SFT runs (issue 17): packed conversations with the assistant mask, evaluated on held-out
conversations, log the single-process training and evaluation losses under pipeline x tensor
parallel and under ZeRO-2 data parallel; summary.json and `llmsplit plot` carry the figures."""

import json
import random

import pytest
from helpers import assert_close_losses, losses, run_cli, train

pytestmark = pytest.mark.slow

SETS = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
        "data.seq_len=256", "train.global_batch=4", "train.micro_batch=1", "train.steps=3", "train.warmup_steps=1",
        "data.format=chat", "data.eval_fraction=0.1", "train.eval_every=2"]


def conversations(n: int = 64) -> str:
    rng = random.Random(0)
    words = "alpha beta gamma delta split model layer token batch shard pipe tensor".split()
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 12)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 20)))})
        rows.append({"messages": messages} if i % 4 else
                    {"prompt": messages[-2]["content"], "completion": messages[-1]["content"]})
    return "".join(json.dumps(r) + "\n" for r in rows)


def eval_losses(run) -> list[float]:
    return [r["eval_loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in r]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat")
    (base / "chat.jsonl").write_text(conversations())
    # The same conversations prepared ahead of time: a run on either reads the same tokens and mask.
    run_cli("prepare", str(base / "chat.jsonl"), "--out", str(base / "chat.tok"), "--format", "chat")
    train(base / "one", *SETS, f"data.source={base / 'chat.jsonl'}", "train.micro_batch=4", nproc=1)
    return base


def test_summary_and_plot_carry_the_mask_and_the_evaluation(data):
    from llmsplit.diagnose.plot import plot_run

    summary = json.loads((data / "one" / "summary.json").read_text())
    assert 0.2 < summary["loss_token_fraction"] < 0.6 and 0 < summary["padding_fraction"] < 0.5
    assert summary["eval_loss"] == eval_losses(data / "one")[-1] and len(eval_losses(data / "one")) == 2
    assert summary["eval_ppl"] == pytest.approx(2.718281828 ** summary["eval_loss"])
    assert data / "one" / "plots" / "loss.png" in plot_run(data / "one")


@pytest.mark.parametrize("nproc, layout", [(4, ["parallel.pp=2", "parallel.tp=2"]), (2, ["parallel.zero=2"])],
                         ids=["pp2-tp2", "dp2-zero2"])
def test_layouts_log_the_single_process_losses(data, tmp_path, nproc, layout):
    train(tmp_path / "run", *SETS, f"data.source={data / 'chat.tok'}", *layout, nproc=nproc)
    assert_close_losses(losses(tmp_path / "run"), losses(data / "one"))
    assert_close_losses(eval_losses(tmp_path / "run"), eval_losses(data / "one"))
