"""`python -m benchmarks.dpo_trl --model HF_FOLDER`: DPO in llmsplit against TRL's DPOTrainer on
the same model, rows, batches, beta and optimizer, step by step: loss, rewards/margins,
rewards/accuracies and the gradient norm (issue 47's check: step 1 within 1e-4, 10 steps within
1e-3). Needs `trl` importable (a benchmark-only peer: `pip install trl`); not part of the suite.

Both sides: fp32, the folder's own chat template, the pairs in the order llmsplit's sampler draws
them (TRL's sampler replaced by a sequential one over rows laid out in that order), one process,
global batch 4 pairs in one micro-batch, AdamW with llmsplit's betas (0.9, 0.95) and eps 1e-8,
constant lr, no weight decay, clipping at 1.0, sigmoid loss, reference log-probs precomputed.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, BATCH, BETA, LR, SEQ = 10, 4, 0.1, 2e-5, 64
COUNTRIES = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
             "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo"}


def preference_rows(path: Path, n: int = 40) -> list[dict]:
    """Capital-city questions: the chosen reply names the capital, the rejected one another city."""
    rng = random.Random(0)
    names = list(COUNTRIES)
    rows = []
    for i in range(n):
        country = names[i % len(names)]
        wrong = COUNTRIES[names[(i + rng.randint(1, len(names) - 1)) % len(names)]]
        ask = ["What is the capital of {}?", "Name the capital city of {}.", "Which city is the capital of {}?",
               "{}: what is its capital?"][i // len(names) % 4].format(country)
        rows.append({"prompt": [{"role": "user", "content": ask}],
                     "chosen": [{"role": "assistant", "content": f"The capital of {country} is {COUNTRIES[country]}."}],
                     "rejected": [{"role": "assistant", "content": f"The capital of {country} is {wrong}."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def llmsplit_records(model: Path, data: Path, run: Path) -> list[dict]:
    sets = [f"model.hf={model}", "train.objective=dpo", f"data.source={data}", f"data.seq_len={SEQ}",
            f"train.global_batch={BATCH}", f"train.micro_batch={BATCH}", f"train.steps={STEPS}", f"train.lr={LR}",
            "train.lr_schedule=constant", "train.warmup_steps=0", "train.weight_decay=0", f"dpo.beta={BETA}"]
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--run-dir", str(run), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def order(rows: list[dict]) -> list[dict]:
    """The rows in the order llmsplit's sampler gives them to steps 1..STEPS."""
    from llmsplit.data.loader import BatchSampler

    sampler = BatchSampler.__new__(BatchSampler)  # only the permutation: window_ids needs no tokens
    sampler.global_batch, sampler.seed, sampler.n_windows, sampler._perms = BATCH, 0, len(rows), {}
    return [rows[i] for step in range(STEPS) for i in sampler.window_ids(step)]


def trl_records(model: Path, rows: list[dict], out: Path) -> list[dict]:
    import datasets
    import torch
    import transformers
    from torch.utils.data import SequentialSampler
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    torch.manual_seed(0)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
                     max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
                     weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                     beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=True, max_length=SEQ + 1,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                     dataloader_num_workers=0, bf16=False, fp16=False)
    trainer = InOrder(model=policy, args=args, train_dataset=datasets.Dataset.from_list(order(rows)),
                      processing_class=tokenizer)
    trainer.train()
    return [r for r in trainer.state.log_history if "loss" in r]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a Hugging Face folder (e.g. SmolLM2-135M-Instruct)")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = preference_rows(tmp / "pairs.jsonl")
        ours = llmsplit_records(args.model.resolve(), tmp / "pairs.jsonl", tmp / "run")
        theirs = trl_records(args.model.resolve(), rows, tmp / "trl")
    table = []
    print("step  loss llmsplit / TRL         margins llmsplit / TRL     accuracy  grad_norm llmsplit / TRL")
    for a, b in zip(ours, theirs):
        row = {"step": a["step"], "loss": [a["loss"], b["loss"]],
               "margins": [a["rewards/margins"], b["rewards/margins"]],
               "accuracies": [a["rewards/accuracies"], b["rewards/accuracies"]],
               "grad_norm": [a["grad_norm"], b["grad_norm"]]}
        table.append(row)
        print(f"{a['step']:>4}  {a['loss']:.6f} / {b['loss']:.6f}   {a['rewards/margins']:+.6f} / "
              f"{b['rewards/margins']:+.6f}   {a['rewards/accuracies']:.2f} / {b['rewards/accuracies']:.2f}   "
              f"{a['grad_norm']:.5f} / {b['grad_norm']:.5f}")
    worst = {key: max(abs(r[key][0] - r[key][1]) for r in table) for key in ("loss", "margins", "grad_norm")}
    first = {key: abs(table[0][key][0] - table[0][key][1]) for key in ("loss", "margins")}
    print(f"largest difference over {len(table)} steps: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()) +
          f"; step 1: loss {first['loss']:.2e}, margins {first['margins']:.2e}")
    if args.out:
        args.out.write_text(json.dumps({"steps": table, "largest": worst, "step1": first}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
