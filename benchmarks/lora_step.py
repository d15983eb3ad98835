"""`PYTHONPATH=PEERS python -m benchmarks.lora_step [--profile]`: where one rank's LoRA step goes,
llmsplit against PEFT + transformers, in one process on one thread (what each of lora_ddp's 2
workers runs, without the other worker and the gradient all-reduce): CPU seconds (user, system)
and minor page faults per step, median after 2 warm-up steps, so that a loaded machine changes the
figures less than it changes wall time. llmsplit runs its own `Trainer.train_step` (the config of
a 1-step `llmsplit train` of the same folder); PEFT the loop of plain_hf_ddp.py on the same
batches. `--profile`: torch.profiler's table of step 3, by operator and input shape."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .finetune import FULL, llama_folder

RANK, STEPS, SEQ, BATCH = 16, 6, 256, 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def ours(folder: Path, tmp: Path):
    from llmsplit.config import config_from_toml
    from llmsplit.launch import free_port, join_job
    from llmsplit.train.hangs import HangReporter
    from llmsplit.train.trainer import Trainer

    sets = [f"model.hf={folder}", "train.steps=1", f"train.global_batch={BATCH}", f"train.micro_batch={BATCH}",
            f"data.seq_len={SEQ}", "checkpoint.every=0", f"lora.rank={RANK}", f"lora.alpha={RANK}"]
    subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--run-dir", str(tmp / "cfg"),
                    *[x for s in sets for x in ("--set", s)]], check=True, capture_output=True)
    cfg = config_from_toml((tmp / "cfg" / "config.toml").read_text())
    cfg.train.steps = STEPS
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LLMSPLIT_THREADS="1")
    trainer = Trainer(cfg, str(tmp / "run"), "none", join_job(600), HangReporter(600))
    return lambda step: trainer.train_step(step)["loss"]


def peft(folder: Path, tmp: Path):
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from llmsplit.data.corpus import load_tokens
    from llmsplit.data.loader import BatchSampler
    from llmsplit.io.tokenizer import load_tokenizer

    model = get_peft_model(LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).train(),
                           LoraConfig(r=RANK, lora_alpha=RANK, lora_dropout=0.0, target_modules=TARGETS))
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=2e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sampler = BatchSampler(load_tokens("builtin", load_tokenizer(str(folder))), SEQ, BATCH, 0)

    def step(s):
        mb = sampler.rank_batch(s - 1, 0, 1)
        loss = F.cross_entropy(model(input_ids=mb[:, :-1]).logits.float().flatten(0, 1), mb[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def measure(who: str, profile: bool) -> None:
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, _ = llama_folder(tmp / "llama", **FULL)
        step = (ours if who == "llmsplit" else peft)(folder, tmp)
        rows = []
        for s in range(1, STEPS + 1):
            prof = torch.profiler.profile(record_shapes=True) if profile and s == 3 else None
            if prof:
                prof.start()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            loss = step(s)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if prof:
                prof.stop()
                print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=20))
            rows.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt, loss))
    med = lambda i: statistics.median(r[i] for r in rows[2:])  # noqa: E731
    print(f"| {who} | {med(0):.3f} | {med(1):.3f} | {med(2):.0f} | {rows[0][3]:.5f} |", flush=True)


def main(argv) -> None:
    if argv and argv[0] in ("llmsplit", "peft"):
        return measure(argv[0], "--profile" in argv)
    print(f"One rank's LoRA step (rank {RANK}, every linear), {BATCH} x {SEQ} tokens, 1 thread, median of steps 3..{STEPS}")
    print("| | user CPU s / step | system CPU s / step | minor faults / step | step-1 loss |\n| --- | ---: | ---: | ---: | ---: |")
    for who in ("peft", "llmsplit"):  # each in a process of its own: the allocators and imports apart
        subprocess.run([sys.executable, "-m", "benchmarks.lora_step", who, *argv], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main(sys.argv[1:])
