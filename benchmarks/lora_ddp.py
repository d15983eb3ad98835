"""`PYTHONPATH=PEERS python -m benchmarks.lora_ddp`: LoRA fine-tuning on 2 CPU workers,
`llmsplit train --set lora.rank=16` (DDP) against a torchrun + DDP + PEFT + transformers loop
(plain_hf_ddp.py --lora-rank 16), same random Llama folder, rows, batch, AdamW, fp32, rank 16
on every linear layer. Alternating rounds; tokens/s is the median step after the warm-up,
peak memory each rank's resident peak (VmHWM). PEERS holds peft (benchmark-only)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

from .finetune import FULL, WARMUP, llama_folder, run_llmsplit, run_plain

RANK, ROUNDS, STEPS, NPROC = 16, 4, 6, 2
SHAPE = dict(global_batch=8, micro_batch=4, seq_len=256)


def main(argv) -> None:
    ours, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, params = llama_folder(tmp / "llama", **FULL)
        for r in range(ROUNDS):
            for who in (("plain", "ours") if r % 2 == 0 else ("ours", "plain")):
                if who == "plain":
                    out = tmp / f"plain{r}.json"
                    res = run_plain(folder, NPROC, STEPS, SHAPE, out, extra=("--lora-rank", str(RANK)))
                    res["peak"] = max(json.loads(out.read_text())["peak_mem_bytes"])
                    plain.append(res)
                else:
                    run = tmp / f"run{r}"
                    res = run_llmsplit(folder, NPROC, STEPS, SHAPE, run, extra=(f"lora.rank={RANK}", "lora.alpha=16",
                                                                                 "train.weight_decay=0.1"))
                    res["peak"] = max(x["peak_mem_bytes"] for x in json.loads((run / "summary.json").read_text())
                                      ["per_rank"])
                    ours.append(res)
            print(f"round {r + 1}: plain {plain[-1]['tps']:.0f} tokens/s, llmsplit {ours[-1]['tps']:.0f}", file=sys.stderr)
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    print(f"LoRA rank {RANK} on every linear layer of a {params / 1e6:.1f}M-parameter Llama, {NPROC} workers, "
          f"global batch {SHAPE['global_batch']} x {SHAPE['seq_len']}, micro-batch {SHAPE['micro_batch']}, fp32")
    print("| | tokens/s (median) | per round | peak per rank (MiB) | step-1 loss |\n| --- | ---: | --- | ---: | ---: |")
    for name, rows in (("llmsplit train, lora.rank=16 (DDP)", ours), ("torchrun + DDP + PEFT + transformers", plain)):
        per_round = ", ".join(f"{x['tps']:.0f}" for x in rows)
        print(f"| {name} | {med(rows, 'tps'):.0f} | {per_round} | "
              f"{med(rows, 'peak') / 2**20:.0f} | {rows[0]['loss1']:.5f} |")
    print(f"ratio: {med(ours, 'tps') / med(plain, 'tps'):.2f}x tokens/s, {med(ours, 'peak') / med(plain, 'peak'):.2f}x peak")


if __name__ == "__main__":
    main(sys.argv[1:])
