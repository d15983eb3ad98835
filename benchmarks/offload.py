"""CPU + disk offload: llmsplit against Accelerate's `dispatch_model` on the same weights.

Both sides get the same CPU memory budget, sized so that about half of the layers must live
on disk; each builds its own map from it (Accelerate: `infer_auto_device_map`, weights only;
llmsplit: weights plus its KV cache and workspace, so it may put more on disk) and writes the
disk part under its own offload folder. Then greedy decode, EOS ignored, at batch 1 and 4,
in alternating order (the whole model in memory is benchmarks/infer.py's comparison). Full
mode uses the real SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized to fp32 by transformers and saved as a
Hugging Face folder that both load); quick mode a small random Llama. Accelerate is optional
(CI installs only the test extra): without it only llmsplit's rows are measured.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .infer import PROMPT, _random_llama, _smollm_gguf

TITLE = "Offload: llmsplit cpu + disk vs Accelerate dispatch_model (decode, CPU, fp32)"
BATCHES = (1, 4)
CONTEXT = 128


def _folder(tmp: Path, quick: bool) -> tuple[Path, str]:
    """A Hugging Face folder both sides load: the real model in full mode, else a tiny one."""
    gguf = None if quick else _smollm_gguf(tmp)
    if gguf is None:
        return _random_llama(tmp), "random Llama, 4 layers, dim 256"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp / "smollm2"
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers will not save a model it read from GGUF: copy the dequantized weights into a plain one.
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder, "SmolLM2-135M-Instruct (Q4_1 GGUF → fp32 Hugging Face folder)"


def _budget(folder: Path) -> int:
    """The CPU bytes with which llmsplit keeps the first half of the layers in memory and puts
    the second half on disk: by its own accounting (weights, KV cache, workspace, two layers
    of staging). Accelerate, counting weights only, fits more layers in the same budget."""
    from llmsplit.infer.api import run_sizes
    from llmsplit.infer.config import InferConfig
    from llmsplit.io.hf import HFWeights
    from llmsplit.plan.placement import place

    source = HFWeights(folder)
    _, sizes = run_sizes(source, InferConfig(dtype="float32", max_batch=max(BATCHES), max_context=CONTEXT))
    n = source.config.n_layers
    # Half of the layers; a tiny model keeps only its first on the CPU, or its two staging
    # buffers would cost as much as the layers sent to disk save.
    dmap = {f"layers.{i}": "disk" for i in range(n // 2 if n >= 8 else 1, n)}
    dmap[""] = "cpu"
    return place(source.config, {"cpu": None, "disk": None}, dmap, sizes).usage["cpu"]["total"]


def _tokens_per_s(fn, batch: int, new: int) -> float:
    t0 = time.perf_counter()
    fn(batch, new)
    return batch * new / (time.perf_counter() - t0)


def _ours(folder: Path, budget: int, off: Path):
    import llmsplit

    m = llmsplit.load(str(folder), max_batch=max(BATCHES), max_context=CONTEXT, max_memory={"cpu": budget},
                      offload_dir=str(off))
    disk = sum(d == "disk" for u, d in m.device_map.items() if u.startswith("layers."))

    def run(batch, new):
        m.generate([PROMPT] * batch if batch > 1 else PROMPT, max_new_tokens=new, ignore_eos=True)
    return run, disk, m.close


def _accelerate(folder: Path, budget: int, off: Path):
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    dmap = infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=model._no_split_modules)
    disk = sum(d == "disk" for u, d in dmap.items() if ".layers." in u)
    model = dispatch_model(model, dmap, offload_dir=str(off))
    ids = AutoTokenizer.from_pretrained(str(folder))(PROMPT, return_tensors="pt").input_ids

    def run(batch, new):
        with torch.no_grad():
            out = model.generate(ids.repeat(batch, 1), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert out.shape[1] - ids.shape[1] == new
    return run, disk, lambda: None


def main(quick: bool = False) -> dict:
    import importlib.util

    import torch

    # BENCH_THREADS=1 on a crowded shared machine: OpenMP threads that wait for a descheduled
    # sibling slow both sides far more than one thread per process does.
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", 0)) or max(1, os.cpu_count() or 1))
    have_accelerate = importlib.util.find_spec("accelerate") is not None
    rounds, new = (1, 2) if quick else (3, 16)
    batches = BATCHES[:1] if quick else BATCHES
    results: dict[str, dict[int, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder, label = _folder(tmp, quick)
        budget = _budget(folder)
        sides = [("llmsplit", _ours)] + ([("transformers + accelerate", _accelerate)] if have_accelerate else [])
        runs = {name: build(folder, budget, tmp / f"off-{name.split()[0]}") for name, build in sides}
        for run, _, _ in runs.values():  # warm-up: page cache, first-call allocations
            run(1, 1 if quick else 4)
        for batch in batches:
            for r in range(rounds):
                for name in list(runs) if r % 2 == 0 else list(reversed(runs)):
                    tps = _tokens_per_s(runs[name][0], batch, new)
                    results.setdefault(name, {}).setdefault(batch, []).append(tps)
                    print(f"{name}, cpu + disk, batch {batch}, round {r + 1}: {tps:.1f} tokens/s", file=sys.stderr)
        disk_layers = {name: disk for name, (_, disk, _) in runs.items()}
        for _, _, close in runs.values():
            close()
    medians = {k: {b: statistics.median(v) for b, v in per.items()} for k, per in results.items()}
    ratios = {}
    if have_accelerate:
        for b in batches:
            ratios[b] = medians["llmsplit"][b] / medians["transformers + accelerate"][b]
    return {"model": label, "budget": budget, "new_tokens": new, "rounds": rounds, "per_round": results,
            "median": medians, "disk_layers": disk_layers, "ratio": ratios, "accelerate": have_accelerate}


def plot(r: dict, out_dir) -> list[Path]:
    from .plots import bars

    names = list(r["median"])
    batches = list(next(iter(r["median"].values())))
    panels = [(f"tokens/s, batch {b}", [r["median"][n][b] for n in names]) for b in batches]
    labels = [n.replace("transformers + accelerate", "transformers\n+ accelerate") for n in names]
    return [bars(Path(out_dir) / "offload.png", f"{r['model']}: cpu + disk offload, decode, CPU, fp32",
                 labels, panels)]


def to_markdown(r: dict) -> list[str]:
    mib = r["budget"] / 2**20
    batches = list(next(iter(r["median"].values())))
    rows = [f"{r['model']}; the same CPU budget, {mib:.0f} MiB, given to both (what llmsplit needs to keep "
            f"half of the layers in memory, counting its KV cache, workspace and staging; Accelerate counts "
            f"weights only); greedy, {r['new_tokens']} new tokens (EOS ignored), prefill included; median of "
            f"{r['rounds']} alternating rounds; tokens/s over all sequences.", "",
            "| cpu + disk offload | layers on disk | " + " | ".join(f"batch {b}" for b in batches) + " |",
            "| --- | ---: |" + " ---: |" * len(batches)]
    for name, per in r["median"].items():
        rows.append(f"| {name} | {r['disk_layers'][name]} | " + " | ".join(f"{per[b]:.1f}" for b in batches) + " |")
    if r["ratio"]:
        rows.append("| **ratio llmsplit / accelerate** | | "
                    + " | ".join(f"**{r['ratio'][b]:.2f}**" for b in batches) + " |")
    else:
        rows += ["", "accelerate is not installed: its rows were skipped."]
    return rows
