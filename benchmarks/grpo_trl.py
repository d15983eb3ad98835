"""`python -m benchmarks.grpo_trl --model HF_FOLDER`: GRPO speed in llmsplit (rollouts from its
own paged engine inside the training job) against TRL's GRPOTrainer (rollouts from transformers'
`generate`), side by side in one run, the order alternating each round (issue 47's check: GRPO
tokens/s, rollout + training, at least 2x TRL's). Needs `trl` importable (a benchmark-only peer:
`pip install trl`); not part of the suite.

Both sides: the same model (fp32, full fine-tuning), the same prompts (sums, chat template), 4
prompts a step x 4 completions each (global batch 16 completions, one micro-batch), completions
of at most 32 tokens sampled at temperature 1, beta 0 (no reference: TRL's default), lr 1e-6,
the same two reward functions, one process on the CPU, each at its own thread defaults. The
figure is completion tokens per second of whole steps (generation, rewards, forward and
backward, optimizer), the median over steps 2.. of each round (step 1 warms up).
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

STEPS, PROMPTS, GROUP, MAX_TOKENS, LR = 6, 4, 4, 32, 1e-6

REWARDS = '''
import re


def _text(c):
    return c if isinstance(c, str) else c[0]["content"]  # TRL passes a conversational completion as messages


def correct(prompts, completions, answer, **columns):
    found = [re.search(r"-?\\d+", _text(c)) for c in completions]
    return [float(m is not None and int(m.group()) == a) for m, a in zip(found, answer)]


def number_only(prompts, completions, **columns):
    return [float(re.fullmatch(r"\\s*-?\\d+\\.?\\s*", _text(c)) is not None) for c in completions]
'''


def write_inputs(folder: Path) -> tuple[Path, Path]:
    rng = random.Random(0)
    rows = []
    for _ in range(200):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                     "answer": a + b})
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sums_rewards.py").write_text(REWARDS)
    return folder / "sums.jsonl", folder / "sums_rewards.py"


def llmsplit_steps(model: Path, data: Path, rewards: Path, run: Path) -> list[tuple[float, float]]:
    """(seconds, completion tokens) of each step."""
    sets = [f"model.hf={model}", "train.objective=grpo", f"data.source={data}", "data.seq_len=128",
            f"train.global_batch={PROMPTS * GROUP}", f"train.micro_batch={PROMPTS * GROUP}", f"train.steps={STEPS}",
            f"train.lr={LR}", "train.lr_schedule=constant", "train.warmup_steps=0",
            f'grpo.rewards=["{rewards}:correct","{rewards}:number_only"]', f"grpo.num_generations={GROUP}",
            f"grpo.max_completion_tokens={MAX_TOKENS}"]
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--run-dir", str(run), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step_time_s"], r["completions/mean_length"] * PROMPTS * GROUP) for r in rows]


def trl_steps(model: Path, data: Path, rewards: Path, out: Path) -> list[tuple[float, float]]:
    """The same in a child process (its own threads and imports), read back as JSON."""
    cmd = [sys.executable, "-m", "benchmarks.grpo_trl", "--model", str(model), "--trl-child", str(data),
           str(rewards), str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [tuple(x) for x in json.loads((out / "steps.json").read_text())]


def run_trl(model: Path, data: Path, rewards: Path, out: Path) -> None:
    import importlib.util

    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("sums_rewards", rewards)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.append(time.perf_counter())

    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * GROUP, num_generations=GROUP,
                      max_completion_length=MAX_TOKENS, temperature=1.0, beta=0.0, learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, max_steps=STEPS, logging_steps=1,
                      report_to=[], save_strategy="no", use_cpu=True, seed=0, bf16=False, fp16=False)
    trainer = GRPOTrainer(model=policy, args=args, reward_funcs=[module.correct, module.number_only],
                          train_dataset=datasets.load_dataset("json", data_files=str(data))["train"],
                          processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    marks.append(time.perf_counter())
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history if "completions/mean_length" in r]
    steps = [(b - a, n * PROMPTS * GROUP) for a, b, n in zip(marks, marks[1:], lengths)]
    (out / "steps.json").write_text(json.dumps(steps))


def wait_for_quiet(limit: float = 1.5, patience_s: float = 240) -> float:
    """The 1-minute load once below `limit` (the side before has left it high), or after waiting
    `patience_s`: what each side starts at, printed with its figure."""
    deadline = time.monotonic() + patience_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a Hugging Face folder (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the rounds as JSON here")
    ap.add_argument("--trl-child", nargs=3, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_child:
        run_trl(args.model, *args.trl_child)
        return 0
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, rewards = write_inputs(tmp)
        for r in range(args.rounds):
            sides = ["llmsplit", "trl"] if r % 2 == 0 else ["trl", "llmsplit"]
            got = {}
            for side in sides:
                load = wait_for_quiet()
                run = tmp / f"{side}-{r}"
                run.mkdir()
                steps = (llmsplit_steps if side == "llmsplit" else trl_steps)(args.model.resolve(), data, rewards, run)
                rates = [n / s for s, n in steps[1:]]
                got[side] = {"tokens_per_s": statistics.median(rates), "steps": steps, "load_before": load}
            ratio = got["llmsplit"]["tokens_per_s"] / got["trl"]["tokens_per_s"]
            rounds.append({"order": sides, **got, "ratio": ratio})
            print(f"round {r + 1} ({' then '.join(sides)}): llmsplit {got['llmsplit']['tokens_per_s']:.1f} "
                  f"completion tokens/s, TRL {got['trl']['tokens_per_s']:.1f}: {ratio:.2f}x "
                  f"(load {got[sides[0]]['load_before']:.2f} / {got[sides[1]]['load_before']:.2f})", flush=True)
    print(f"median over {len(rounds)} rounds: {statistics.median(r['ratio'] for r in rounds):.2f}x")
    if args.out:
        args.out.write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
