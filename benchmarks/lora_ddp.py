"""`python -m benchmarks.lora_ddp [--quick]`: LoRA fine-tuning on 2 CPU workers,
`llmsplit train --set lora.rank=16` (DDP) against a torchrun + DDP + PEFT + transformers loop
(plain_hf_ddp.py --lora-rank 16), same random Llama folder, rows, batch, AdamW, fp32, rank 16
on every linear layer. Alternating rounds; tokens/s is the median step after the warm-up,
peak memory each rank's resident peak (VmHWM) over the training steps: both sides reset it
right before step 1 (after the load, the adapters, the DDP wrap and the optimizer) and read it
after the last step, so neither counts loading or setup. Skipped without peft (in the test extras)."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

from .finetune import FULL, QUICK, WARMUP, llama_folder, run_llmsplit, run_plain

TITLE = "LoRA fine-tuning: llmsplit (DDP) vs torchrun + DDP + PEFT + transformers"
RANK, ROUNDS, STEPS, NPROC = 16, 4, 6, 2
SHAPE = dict(global_batch=8, micro_batch=4, seq_len=256)
QUICK_SHAPE = dict(global_batch=4, micro_batch=2, seq_len=32)


def main(quick: bool = False, rounds: int = ROUNDS, steps: int = STEPS) -> dict:
    if importlib.util.find_spec("peft") is None:  # the peer; a full `python -m benchmarks` run goes on without it
        return {"skipped": "peft is not installed (`pip install peft`)"}
    sizes, shape = (QUICK, QUICK_SHAPE) if quick else (FULL, SHAPE)
    if quick:
        rounds, steps = 1, WARMUP + 2
    ours, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, params = llama_folder(tmp / "llama", **sizes)
        for r in range(rounds):
            for who in (("plain", "ours") if r % 2 == 0 else ("ours", "plain")):
                if who == "plain":
                    plain.append(run_plain(folder, NPROC, steps, shape, tmp / f"plain{r}.json",
                                           extra=("--lora-rank", str(RANK))))
                else:
                    ours.append(run_llmsplit(folder, NPROC, steps, shape, tmp / f"run{r}",
                                             extra=(f"lora.rank={RANK}", "lora.alpha=16", "train.weight_decay=0.1")))
            print(f"round {r + 1}: plain {plain[-1]['tps']:.0f} tokens/s, llmsplit {ours[-1]['tps']:.0f}",
                  file=sys.stderr)
    return {"params": params, "nproc": NPROC, **shape, "steps": steps, "rounds": rounds, "llmsplit": ours,
            "plain": plain}


def to_markdown(r: dict) -> list[str]:
    if "skipped" in r:
        return [f"Skipped: {r['skipped']}."]
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    lines = [f"LoRA rank {RANK} on every linear layer of a {r['params'] / 1e6:.1f}M-parameter Llama, {r['nproc']} "
             f"workers, global batch {r['global_batch']} x {r['seq_len']}, micro-batch {r['micro_batch']}, fp32; "
             f"median tokens/s over steps {WARMUP + 1}..{r['steps']}, median of {r['rounds']} alternating rounds. "
             "Peak: the largest rank's VmHWM from a reset right before step 1 (both sides) to the last step.", "",
             "| | tokens/s (median) | per round | peak per rank (MiB) | step-1 loss |",
             "| --- | ---: | --- | ---: | ---: |"]
    for name, rows in ((f"llmsplit train, lora.rank={RANK} (DDP)", r["llmsplit"]),
                       ("torchrun + DDP + PEFT + transformers", r["plain"])):
        per_round = ", ".join(f"{x['tps']:.0f}" for x in rows)
        lines.append(f"| {name} | {med(rows, 'tps'):.0f} | {per_round} | "
                     f"{med(rows, 'peak') / 2**20:.0f} | {rows[0]['loss1']:.5f} |")
    ours, plain = r["llmsplit"], r["plain"]
    lines.append(f"| **ratio** | **{med(ours, 'tps') / med(plain, 'tps'):.3f}** | | "
                 f"{med(ours, 'peak') / med(plain, 'peak'):.2f}x | |")
    return lines


if __name__ == "__main__":
    print("\n".join(to_markdown(main(quick="--quick" in sys.argv[1:]))))
