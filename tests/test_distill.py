"""Distillation (`train.teacher`, issue 46 item 3): the KL term against a hand-worked value, the
objective's mix of KL and next-token loss, runs under ZeRO-3 and pipeline x tensor parallel on
packed chat rows logging the single process's loss, gradient norm and KL at every step, a
student that moves towards its teacher, and a teacher refused before any worker starts."""

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close_losses, losses, run_cli, train
from test_chat_train import conversations

TEACHER = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
           "data.seq_len=128", "train.global_batch=4", "train.micro_batch=2", "train.steps=8", "train.lr=0.01"]
STUDENT = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_dim=64",
           "data.seq_len=128", "train.global_batch=4", "train.micro_batch=2", "train.steps=3", "train.warmup_steps=1",
           "data.format=chat", "data.eval_fraction=0.1", "train.eval_every=2", "train.distill_weight=0.75",
           "train.distill_temperature=2"]


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_kl_term_matches_torch_kl_div_on_the_scored_tokens():
    from llmsplit.train.distill import distill_kl

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 9, generator=g)  # a padded teacher head
    targets = torch.tensor([[1, -100, 2], [3, 4, -100]])
    got = distill_kl(student, teacher, targets, temperature=2.0)
    s, t = F.log_softmax(student / 2, -1), F.log_softmax(teacher[..., :7] / 2, -1)
    per_token = F.kl_div(s, t, log_target=True, reduction="none").sum(-1)
    assert got.item() == pytest.approx(4 * per_token[targets != -100].sum().item(), rel=1e-6)
    assert distill_kl(teacher[..., :7], teacher, targets, 1.0).abs().item() < 1e-6  # a perfect student: 0


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    base = tmp_path_factory.mktemp("distill")
    (base / "chat.jsonl").write_text(conversations())
    train(base / "teacher", *TEACHER, "data.format=chat", f"data.source={base / 'chat.jsonl'}", nproc=1)
    return base


def test_the_objective_mixes_kl_and_the_next_token_loss(teacher):
    from llmsplit.config import load_config
    from llmsplit.data.loader import Batch
    from llmsplit.train.distill import DistillObjective, distill_kl
    from llmsplit.train.objectives import token_loss

    cfg = load_config(None, [f"train.teacher={teacher / 'teacher'}", "train.distill_weight=0.25"])
    obj = DistillObjective(cfg.train, torch.device("cpu"))
    inputs = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = inputs.roll(-1, 1)
    targets[0, :5] = -100
    batch = obj.carry(Batch(inputs, targets))
    assert batch.targets.shape == (2, 32) and torch.equal(batch.targets[:, 16:], inputs)
    logits = torch.randn(2, 16, 258)
    with torch.no_grad():
        want_t = obj.teacher(inputs)
    kl, ce = distill_kl(logits, want_t, targets, 1.0), token_loss(logits, targets, 1.0)
    assert obj.loss(logits, batch.targets, 3.0).item() == pytest.approx((0.25 * kl + 0.75 * ce).item() / 3, rel=1e-5)
    with obj.evaluating():  # evaluations: the next-token loss alone
        assert obj.loss(logits, batch.targets, 3.0).item() == pytest.approx(ce.item() / 3, rel=1e-6)

    class OneRank:
        global_sum = staticmethod(lambda t: t)

    tokens = int((targets != -100).sum())
    assert obj.step_record(OneRank()) == pytest.approx({"distill_kl": kl.item() / tokens, "distill_ce": ce.item() / tokens})


@pytest.fixture(scope="module")
def one(teacher):
    data = f"data.source={teacher / 'chat.jsonl'}"
    train(teacher / "one", *STUDENT, data, f"train.teacher={teacher / 'teacher'}", nproc=1)
    return data, teacher / "one"


@pytest.mark.slow
@pytest.mark.parametrize("nproc, layout", [(4, ["parallel.pp=2", "parallel.tp=2"]), (2, ["parallel.zero=3"])],
                         ids=["pp2-tp2", "zero3"])
def test_layouts_log_the_single_process_run(teacher, one, tmp_path, nproc, layout):
    train(tmp_path / "run", *STUDENT, one[0], f"train.teacher={teacher / 'teacher'}", *layout, nproc=nproc)
    assert_close_losses(losses(tmp_path / "run"), losses(one[1]))
    for a, b in zip(records(tmp_path / "run"), records(one[1])):
        for name in ("distill_kl", "distill_ce", "eval_loss"):
            if name in b:
                assert a[name] == pytest.approx(b[name], rel=1e-5), (a["step"], name)


@pytest.mark.slow
def test_the_student_moves_towards_its_teacher(teacher, one):
    rows = records(one[1])
    assert all("distill_kl" in r and "distill_ce" in r for r in rows)
    assert rows[-1]["distill_kl"] < rows[0]["distill_kl"]
    # The loss is the mix: 0.75 x KL + 0.25 x next-token loss, per token.
    assert rows[0]["loss"] == pytest.approx(0.75 * rows[0]["distill_kl"] + 0.25 * rows[0]["distill_ce"], rel=1e-4)
    summary = json.loads((one[1] / "summary.json").read_text())
    assert summary["eval_ppl"] == pytest.approx(2.718281828 ** summary["eval_loss"])  # next-token loss, comparable


@pytest.mark.parametrize("sets, says", [
    (["train.teacher={base}/nowhere"], "train.teacher '{base}/nowhere' does not exist"),
    (["train.teacher={base}/teacher", "data.tokenizer={hf}"], "has another tokenizer (byte, 258 tokens) than the data"),
    (["train.teacher={base}/teacher", "train.objective=dpo", "data.source={base}/pairs.jsonl"],
     "train.teacher distils with the next-token objective"),
    (["train.distill_weight=0"], "train.distill_weight=0.0 must be above 0 and at most 1"),
    (["train.distill_temperature=-1"], "train.distill_temperature=-1.0 must be greater than 0"),
    (["train.teacher={base}/teacher", "parallel.cp=2"], "train.teacher with parallel.cp=2 is not built yet"),
])
def test_bad_teachers_are_refused_before_any_worker_starts(teacher, tmp_path, sets, says):
    from hf_models import train_tokenizer

    from test_dpo import preference_rows

    train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (teacher / "pairs.jsonl").write_text(preference_rows(8))
    fill = dict(base=teacher, hf=tmp_path / "tokenizer.json")
    out = run_cli("train", "--run-dir", str(tmp_path / "run"), "--nproc", "2",
                  *[a for s in [*STUDENT, f"data.source={teacher / 'chat.jsonl'}", *(s.format(**fill) for s in sets)]
                    for a in ("--set", s)], check=False)
    assert out.returncode == 2 and says.format(**fill) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_planner_counts_the_teacher_and_its_logits():
    from llmsplit.config import layout_of, load_config, model_config, workload_of
    from llmsplit.plan.hardware import get_device
    from llmsplit.plan.memory import memory_per_device

    base = ["data.seq_len=512", "train.global_batch=8", "train.micro_batch=2", "parallel.dp=1"]
    plain = load_config(None, base)
    distil = load_config(None, base + ["train.teacher=t.gguf", "train.teacher_params=135000000"])
    model, device = model_config(plain, 49152), get_device("H100-80GB")
    got = [memory_per_device(model, layout_of(c, 1), workload_of(c), device) for c in (plain, distil)]
    logits = 2 * 512 * 49152 * (4 + 16)  # the teacher's fp32 logits and four float32 arrays as wide, 2 rows
    assert got[1].detail["teacher"] == {"teacher": 135_000_000 * 4, "teacher_logits": logits}
    assert got[0].detail["teacher"] == {}
    assert got[1].activations - got[0].activations == 135_000_000 * 4 + logits
    # bf16: the teacher in 2 bytes a parameter, its logits in 2 and the KL's four float32 arrays.
    bf16 = load_config(None, base + ["train.teacher=t.gguf", "train.teacher_params=1000", "train.precision=bf16"])
    got = memory_per_device(model, layout_of(bf16, 1), workload_of(bf16), device).detail["teacher"]
    assert got == {"teacher": 2000, "teacher_logits": 2 * 512 * 49152 * (2 + 16)}


def test_plan_on_a_config_with_a_teacher_counts_it(teacher, tmp_path):
    import llmsplit

    body = "[model]\ndim = 32\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nffn_dim = 64\n[data]\nseq_len = 64\n" \
           "[train]\nglobal_batch = 4\nmicro_batch = 2\n"
    (tmp_path / "plain.toml").write_text(body)
    (tmp_path / "distil.toml").write_text(body + f'teacher = "{teacher / "teacher"}"\n')
    reports = [llmsplit.plan(str(tmp_path / f"{name}.toml"), 1, layout="zero=0") for name in ("plain", "distil")]
    mems = [r["layouts"][0]["memory_per_device"] for r in reports]
    rows = reports[1]["layouts"][0]["layout"]["micro_batch"]
    # The teacher's parameters (its vocabulary padded to 264) in fp32, and its logits with the KL's four
    # float32 arrays over the student's 264 rows of head.
    params = 2 * 264 * 64 + 2 * (2 * 64 + 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128) + 64
    assert mems[1]["activations"] - mems[0]["activations"] == params * 4 + rows * 64 * 264 * (4 + 16)
