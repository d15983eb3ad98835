"""`llmsplit eval` against lm-eval's own `hf` backend on the same Hugging Face folder and task.

`python -m benchmarks.lm_eval_peer [--questions 100] [--rounds 3]`: a local 4-choice task
(written here: sums, like tests/test_eval.py's) scored on SmolLM2-135M-Instruct (its Q4_1 GGUF
dequantized to an fp32 Hugging Face folder, as benchmarks/offload.py makes it), each side as
its own command line in a fresh process (`llmsplit eval`; `lm_eval --model hf` at its defaults:
batch size 1, fp32 on CPU), in alternating order each round. Wall time per run (load
included), the medians, and whether the two gave the same accuracy and log-likelihoods.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .offload import _folder

TASK = """task: sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
fewshot_split: test
num_fewshot: {shots}
metric_list:
  - metric: acc
"""


def write_task(folder: Path, questions: int, shots: int) -> None:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sums.jsonl", "w") as f:
        for _ in range(questions):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            f.write(json.dumps({"question": f"What is {a} plus {b}?", "answer": 0,
                                "choices": [str(a + b), str(a + b + 1), str(a + b - 10), str(a * b)]}) + "\n")
    (folder / "sums.yaml").write_text(TASK.format(data=folder / "sums.jsonl", shots=shots))


def command(side: str, model: Path, tasks: Path, out: Path) -> list[str]:
    if side == "llmsplit":
        return [sys.executable, "-m", "llmsplit", "eval", "--model", str(model), "--tasks", "sums",
                "--include-path", str(tasks), "--output", str(out)]
    return [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
            "--tasks", "sums", "--include_path", str(tasks), "--device", "cpu", "--log_samples",
            "--output_path", str(out)]


def scores(side: str, out: Path) -> tuple[float, list[float]]:
    """(accuracy, every choice's log-likelihood in sample order)."""
    if side == "llmsplit":
        results = json.loads((out / "results.json").read_text())
        samples = results["samples"]["sums"]
    else:
        results = json.loads(next(out.rglob("results_*.json")).read_text())
        samples = [json.loads(line) for line in next(out.rglob("samples_sums_*.jsonl")).read_text().splitlines()]
    samples = sorted(samples, key=lambda s: s["doc_id"])
    return results["results"]["sums"]["acc,none"], [float(r[0][0]) for s in samples for r in s["resps"]]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lm_eval_peer")
    ap.add_argument("--questions", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shots", type=int, default=5, help="examples before each question (default 5, as MMLU's)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, label = _folder(tmp, quick=False)
        write_task(tmp / "tasks", args.questions, args.shots)
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        times: dict[str, list[float]] = {"llmsplit": [], "hf": []}
        found = {}
        for r in range(args.rounds):
            for side in (("llmsplit", "hf") if r % 2 == 0 else ("hf", "llmsplit")):
                out = tmp / f"out-{side}-{r}"
                load = os.getloadavg()[0]
                start = time.perf_counter()
                subprocess.run(command(side, model, tmp / "tasks", out), env=env, check=True, capture_output=True)
                times[side].append(time.perf_counter() - start)
                found[side] = scores(side, out)
                print(f"round {r} {side:8s} {times[side][-1]:7.1f} s  load {load:.2f}", flush=True)
        worst = max(abs(a - b) for a, b in zip(found["llmsplit"][1], found["hf"][1]))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{label}, {args.questions} questions x 4 choices, {args.shots}-shot: llmsplit eval {med['llmsplit']:.1f} s, "
              f"lm-eval hf {med['hf']:.1f} s (medians of {args.rounds}), {med['hf'] / med['llmsplit']:.2f}x; "
              f"accuracy {found['llmsplit'][0]:.3f} vs {found['hf'][0]:.3f}, largest log-likelihood gap {worst:.2e}")


if __name__ == "__main__":
    main()
