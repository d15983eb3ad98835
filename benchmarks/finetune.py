"""Fine-tuning a Hugging Face Llama folder: `llmsplit train --set model.hf=FOLDER` (DDP)
against a plain torchrun + DDP + transformers `LlamaForCausalLM` loop (plain_hf_ddp.py).

Both start from the same random weights written by `save_pretrained`, see the same token
windows (the step-1 losses must agree, which the report shows), and use the same batch,
sequence length, AdamW and fp32. The two alternate in A B B A order; each run's speed is
the median step time after WARMUP steps, and the report gives the median over rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from llmsplit.launch import free_port

from .procs import run_logged

WARMUP = 2
TITLE = "Fine-tuning a Hugging Face Llama: llmsplit vs plain torchrun + DDP + transformers"
FULL = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def llama_folder(path: Path, **sizes) -> tuple[Path, int]:
    """A random Llama saved by transformers with a byte-level BPE tokenizer (trained on
    Python's documentation, which resembles the built-in corpus); (folder, parameters)."""
    import torch
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(topics.values())[:40], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=1024,
                                         bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, **sizes))
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path, sum(p.numel() for p in model.parameters())


def _env(nproc: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc)))


def run_plain(folder: Path, nproc: int, steps: int, shape: dict, out: Path, extra=()) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(Path(__file__).with_name("plain_hf_ddp.py")),
           "--model", str(folder), "--steps", str(steps), "--global-batch", str(shape["global_batch"]),
           "--micro-batch", str(shape["micro_batch"]), "--seq-len", str(shape["seq_len"]), "--out", str(out), *extra]
    run_logged(cmd, out, env=_env(nproc), log_path=out.with_suffix(".log"))
    data = json.loads(out.read_text())
    return {"tps": data["tokens_per_step"] / statistics.median(data["step_time_s"][WARMUP:]), "loss1": data["loss"][0],
            "peak": max(data["peak_mem_bytes"])}


def run_llmsplit(folder: Path, nproc: int, steps: int, shape: dict, run_dir: Path, extra=()) -> dict:
    sets = [f"model.hf={folder}", f"train.steps={steps}", f"train.global_batch={shape['global_batch']}",
            f"train.micro_batch={shape['micro_batch']}", f"data.seq_len={shape['seq_len']}", "train.log_every=1",
            "checkpoint.every=0", *extra]
    subprocess.run([sys.executable, "-m", "llmsplit", "train", "--nproc", str(nproc), "--run-dir", str(run_dir),
                    *[x for s in sets for x in ("--set", s)]], check=True, env=_env(nproc),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens = shape["global_batch"] * shape["seq_len"]
    # peak: the largest rank's VmHWM from the reset before step 1 to the end of the last step, the
    # span plain_hf_ddp.py measures (the summary's per-rank figure also spans the final checkpoint).
    return {"tps": tokens / statistics.median([r["step_time_s"] for r in rows][WARMUP:]), "loss1": rows[0]["loss"],
            "peak": rows[-1]["peak_mem_bytes"]}


def main(quick: bool = False, rounds: int = 4, steps: int = 8, nproc: int = 2) -> dict:
    sizes, shape = (QUICK, dict(global_batch=4, micro_batch=2, seq_len=32)) if quick else \
        (FULL, dict(global_batch=8, micro_batch=4, seq_len=256))
    if quick:
        rounds, steps = 1, WARMUP + 2
    plain, ours, compiled = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, n_params = llama_folder(tmp / "llama", **sizes)
        for r in range(rounds):
            order = ("plain", "ours", "compiled") if r % 2 == 0 else ("compiled", "ours", "plain")
            for who in order:
                if who == "plain":
                    plain.append(run_plain(folder, nproc, steps, shape, tmp / f"plain{r}.json"))
                elif who == "ours":
                    ours.append(run_llmsplit(folder, nproc, steps, shape, tmp / f"run{r}"))
                elif not quick:  # compiling takes ~20 s: not in the test suite's quick run
                    compiled.append(run_llmsplit(folder, nproc, steps, shape, tmp / f"compiled{r}",
                                                 extra=("train.compile=true",)))
            print(f"round {r + 1}: plain HF DDP {plain[-1]['tps']:.0f} tokens/s, llmsplit {ours[-1]['tps']:.0f} "
                  f"(compiled {compiled[-1]['tps'] if compiled else 0:.0f}) "
                  f"tokens/s", file=sys.stderr)
    result = {"nproc": nproc, "params": n_params, "sizes": sizes, **shape, "steps": steps, "rounds": rounds,
              "plain": [p["tps"] for p in plain], "llmsplit": [o["tps"] for o in ours],
              "plain_loss1": plain[0]["loss1"], "llmsplit_loss1": ours[0]["loss1"],
              "plain_tokens_per_s": statistics.median(p["tps"] for p in plain),
              "llmsplit_tokens_per_s": statistics.median(o["tps"] for o in ours)}
    result["ratio"] = result["llmsplit_tokens_per_s"] / result["plain_tokens_per_s"]
    result["compiled"] = [c["tps"] for c in compiled]
    if compiled:
        result["compiled_tokens_per_s"] = statistics.median(result["compiled"])
        result["compiled_ratio"] = result["compiled_tokens_per_s"] / result["plain_tokens_per_s"]
    return result


def to_markdown(r: dict) -> list[str]:
    s = r["sizes"]
    return [
        f"A random Llama written by transformers' `save_pretrained` ({r['params'] / 1e6:.1f}M parameters: "
        f"{s['num_hidden_layers']} layers, hidden {s['hidden_size']}, {s['num_attention_heads']} heads / "
        f"{s['num_key_value_heads']} KV heads), {r['nproc']} CPU workers (gloo), global batch {r['global_batch']} × "
        f"{r['seq_len']} tokens, micro-batch {r['micro_batch']}, AdamW, fp32. Step-1 loss: llmsplit "
        f"{r['llmsplit_loss1']:.5f}, transformers {r['plain_loss1']:.5f} (same weights, same batch). Median tokens/s "
        f"over steps {WARMUP + 1}..{r['steps']}, median of {r['rounds']} alternating rounds.",
        "",
        "| | tokens/s (median) | per round |",
        "| --- | ---: | --- |",
        f"| llmsplit train `model.hf` (DDP) | {r['llmsplit_tokens_per_s']:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in r['llmsplit'])} |",
        f"| plain torchrun + DDP + transformers | {r['plain_tokens_per_s']:.0f} | "
        f"{', '.join(f'{x:.0f}' for x in r['plain'])} |",
        f"| **ratio** | **{r['ratio']:.3f}** | |",
    ] + ([
        f"| llmsplit with `train.compile=true` (torch.compile of each block; the first step compiles) | "
        f"{r['compiled_tokens_per_s']:.0f} | {', '.join(f'{x:.0f}' for x in r['compiled'])} |",
        f"| **ratio, compiled** | **{r['compiled_ratio']:.3f}** | |",
    ] if r.get("compiled") else [])


def plot(r: dict, out_dir: Path) -> list[Path]:
    from .plots import bars

    return [bars(Path(out_dir) / "finetune.png", f"Fine-tuning a {r['params'] / 1e6:.0f}M Llama on {r['nproc']} "
                 f"CPU workers (ratio {r['ratio']:.2f}×)", ["llmsplit", "torchrun + DDP\n+ transformers"],
                 [("tokens/s (median)", [r["llmsplit_tokens_per_s"], r["plain_tokens_per_s"]])])]
