"""`llmsplit eval`: lm-evaluation-harness over the engine, in-process. A local multiple-choice
task (its YAML and JSONL written here: nothing is downloaded) scored on a tiny Hugging Face
folder gives each choice's log-likelihood as transformers computes it, tokenized as lm-eval's
`hf` backend tokenizes, and the accuracy those imply."""

import json
import random

import pytest

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from helpers import run_cli  # noqa: E402
from hf_models import make_hf_folder  # noqa: E402

TASK = """task: llmsplit_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder):
    rng = random.Random(0)
    rows = []
    for _ in range(12):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"question": f"What is {a} plus {b}?", "answer": 0,
                     "choices": [str(a + b), str(a + b + 1), f"the number {a * b + 2}", str(abs(a - b) + 3)]})
    folder.mkdir()
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums.yaml").write_text(TASK.format(data=folder / "sums.jsonl"))


def reference(tok, model, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's hf backend, by hand: the pair encoded whole without special tokens, the
    continuation's tokens those after the context's, scored by transformers in fp32."""
    import torch

    whole = tok(context + continuation, add_special_tokens=False).input_ids
    n = len(whole) - len(tok(context, add_special_tokens=False).input_ids)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    rows = logprobs[len(whole) - n - 1:len(whole) - 1]
    target = torch.tensor(whole[-n:])
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def test_eval_scores_a_local_task_as_the_hf_backend_would(tmp_path):
    folder = make_hf_folder(tmp_path / "llama", num_hidden_layers=2)
    write_task(tmp_path / "tasks")
    out = tmp_path / "out"
    proc = run_cli("eval", "--model", str(folder), "--tasks", "llmsplit_sums", "--include-path",
                   str(tmp_path / "tasks"), "--output", str(out), "--max-batch", "5",
                   env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert "llmsplit_sums" in proc.stdout and "acc" in proc.stdout, proc.stdout
    results = json.loads((out / "results.json").read_text())
    samples = results["samples"]["llmsplit_sums"]
    assert len(samples) == 12
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    worst, right = 0.0, 0
    for sample in samples:
        ours = [r[0] for r in sample["resps"]]
        theirs = [reference(tok, model, *args) for args in sample["arguments"]]
        worst = max(worst, max(abs(a[0] - b[0]) for a, b in zip(ours, theirs)))
        assert [a[1] for a in ours] == [b[1] for b in theirs]
        right += max(range(4), key=lambda i: theirs[i][0]) == sample["target"]
    assert worst < 1e-4, worst
    assert results["results"]["llmsplit_sums"]["acc,none"] == pytest.approx(right / 12)


def test_an_unknown_task_is_refused_before_the_model_loads(monkeypatch, capsys):
    import lm_eval.tasks

    from llmsplit.cli import main

    class NoTasks:  # lm-eval's index of its ~14,000 task files takes 12 s to build: not needed here
        def __init__(self, **kwargs):
            pass

        def match_tasks(self, names):
            return []

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", NoTasks)
    assert main(["eval", "--model", "no/such/model", "--tasks", "no_such_task"]) == 2
    assert "--tasks: lm-eval knows no task 'no_such_task'; name one of its tasks" in capsys.readouterr().err
