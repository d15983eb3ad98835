"""`python -m benchmarks.lora_peft`: LoRA SFT on packed chat data, llmsplit against PEFT +
transformers, loss at every step. Needs `peft` importable (a benchmark-only peer, e.g.
`pip install --target DIR --no-deps peft accelerate` and PYTHONPATH=DIR); not part of the suite.

Both sides start from the same random Llama folder (`save_pretrained`), the same adapters
(llmsplit's initialisation, PEFT's scheme, copied into PEFT's lora_A/lora_B), the same rows
(llmsplit's packed sampler: conversations laid whole into rows, the assistant mask), fp32,
AdamW (betas 0.9/0.95, eps 1e-8, no weight decay), constant lr, clipping at 1.0. The packed
rows reach transformers as `position_ids` and a custom 4-D attention mask (causal within each
conversation), its documented way to take packed sequences; the loss is the sum of the token
losses over the tokens that carry loss divided by their count, as llmsplit's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from .finetune import QUICK, llama_folder

STEPS, RANK, ALPHA, LR, SEQ, BATCH = 10, 8, 16.0, 1e-3, 128, 4
PEFT_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
              "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
              "feed_forward.w2": "mlp.down_proj"}


def conversations(path: Path, n: int = 48) -> None:
    import random

    rng = random.Random(0)
    words = "the model splits layers over devices and trains adapters on chat data".split()
    with open(path, "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
            for _ in range(rng.randint(1, 2)):
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 8)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
            f.write(json.dumps({"messages": messages}) + "\n")


def llmsplit_losses(folder: Path, data: Path, run: Path) -> list[float]:
    sets = [f"model.hf={folder}", "data.format=chat", f"data.source={data}", f"data.seq_len={SEQ}",
            f"train.global_batch={BATCH}", f"train.micro_batch={BATCH}", f"train.steps={STEPS}", f"train.lr={LR}",
            "train.lr_schedule=constant", "train.warmup_steps=0", "train.weight_decay=0", f"lora.rank={RANK}",
            f"lora.alpha={ALPHA}"]
    cmd = [sys.executable, "-m", "llmsplit", "train", "--nproc", "1", "--run-dir", str(run)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def peft_losses(folder: Path, data: Path, run: Path) -> list[float]:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from llmsplit.adapters.lora import apply_lora, init_lora
    from llmsplit.config import load_config, model_config
    from llmsplit.config import DataSection
    from llmsplit.data.datasets import build_samplers
    from llmsplit.io.tokenizer import load_tokenizer
    from llmsplit.models.llama import Transformer, document_mask

    tok = load_tokenizer(str(folder))
    sampler, _ = build_samplers(DataSection(source=str(data), seq_len=SEQ, tokenizer=str(folder), format="chat",
                                            loss_on="assistant"), BATCH, 0, tok)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                             target_modules=[v.split(".")[1] for v in PEFT_NAMES.values()]))
    ours = Transformer(model_config(load_config(run / "config.toml"), tok.vocab_size))  # the run's sizes
    apply_lora(ours, RANK, ALPHA, 0.0, ["q", "k", "v", "o", "gate", "up", "down"])
    init_lora(ours, 0)  # the adapters llmsplit starts from (seed 0)
    theirs = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_" in name:
                _, i, *module, which = name.split(".")
                peft = PEFT_NAMES[".".join(module)]
                key = f"base_model.model.model.layers.{i}.{peft}.lora_{which[-1].upper()}.default.weight"
                theirs[key].copy_(p)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    out = []
    for step in range(STEPS):
        batch = sampler.batch(step, 0, 1)
        logits = model(input_ids=batch.inputs, attention_mask=document_mask(batch.positions),
                       position_ids=batch.positions).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten(), reduction="sum")
        loss = loss / sampler.loss_tokens(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def main(argv) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, params = llama_folder(tmp / "hf", **QUICK)
        conversations(tmp / "chat.jsonl")
        ours = llmsplit_losses(folder, tmp / "chat.jsonl", tmp / "run")
        theirs = peft_losses(folder, tmp / "chat.jsonl", tmp / "run")
    print(f"LoRA rank {RANK} on q,k,v,o,gate,up,down of a {params / 1e6:.2f}M-parameter Llama, packed chat rows "
          f"of {SEQ + 1} tokens, batch {BATCH}, fp32")
    print("| step | llmsplit | PEFT + transformers | relative difference |\n| ---: | ---: | ---: | ---: |")
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(b):.1e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
