"""Explaining a run that ran out of memory: the planner's breakdown of the layout that
failed, against the limit it broke, and the smallest changes the planner says would fit.

The planner's number for the failed layout is compared with the peak the run measured;
when the run measured more, the planner under-estimates on this machine, and every
suggestion is scaled up by the same ratio before it is said to fit, so a suggestion is
not one that only fits on paper; each must also leave MARGIN of the limit free.
"""

from __future__ import annotations

from dataclasses import fields, replace

from ..config import Config
from ..models.llama import LlamaConfig
from ..plan.api import layout_of_config, runnable, workload_of_config
from ..plan.hardware import Device
from ..plan.layout import Layout
from ..plan.search import Candidate, evaluate, host_budget, single_changes, smallest_fit_advice

MiB, GiB = 1 << 20, 1 << 30
MARGIN = 0.08  # of the limit, left free by every suggestion
TERMS = ("params", "grads", "optimizer", "activations", "comm_buffers", "overhead")
_SECTION = {"micro_batch": "train", "activation_checkpoint": "memory", "offload": "memory"}


def config_key(layout_key: str) -> str:
    return f"{_SECTION.get(layout_key, 'parallel')}.{layout_key}"


def set_args(before: Layout, after: Layout) -> list[str]:
    """The `--set KEY=VALUE` items that turn the config of `before` into that of `after`."""
    return [f"{config_key(f.name)}={getattr(after, f.name)}" for f in fields(Layout)
            if getattr(after, f.name) != getattr(before, f.name)]


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= 10 * GiB else f"{n / MiB:.0f} MiB"


def budget_device(device: Device, failure: dict) -> Device:
    """The device with the limit that was broken as its memory. On a GPU memory.limit_bytes
    counts the allocator's bytes only (what torch.cuda.max_memory_allocated sees), so the
    CUDA context and NCCL buffers come on top of it."""
    extra = device.runtime_bytes if device.kind != "cpu" and failure["source"] == "memory.limit_bytes" else 0
    return replace(device, memory_bytes=failure["limit_bytes"] + extra)


def seen_bytes(total: int, device: Device) -> int:
    """The part of a predicted total that the run's peak measures: everything on a CPU (the
    process's resident peak), all but the CUDA context and NCCL buffers on a GPU."""
    return total - (0 if device.kind == "cpu" else device.runtime_bytes)


def suggestions(cfg: Config, model_cfg: LlamaConfig, world: int, device: Device, scale: float,
                limit: int = 3) -> list[tuple[Layout, Candidate]]:
    """Layouts one or two keys away from the config's that `llmsplit train` runs and that
    fit `device` (after `scale`), fewest keys first, then fastest first."""
    base, work = layout_of_config(cfg, world), workload_of_config(cfg)
    options: dict[Layout, int] = {}
    for _, one in single_changes(base, model_cfg, work, device):
        options.setdefault(one, 1)
        for _, two in single_changes(one, model_cfg, work, device):
            options.setdefault(two, 2)
    fitting = []
    for lay, keys in options.items():
        if lay == base:
            continue
        cand = evaluate(model_cfg, lay, work, device)
        needs = cand.memory.total + (scale - 1) * seen_bytes(cand.memory.total, device)
        # A change that fits only just is no answer to an out-of-memory stop: peaks vary
        # from step to step and the planner is an estimate, so keep a margin.
        if needs <= (1 - MARGIN) * device.memory_bytes and cand.memory.host <= host_budget(device) and \
                runnable(cfg, model_cfg, lay, world):
            fitting.append((keys, -cand.cost.tokens_per_s, lay, cand))
    fitting.sort(key=lambda f: f[:2])
    out, outcomes = [], set()
    for _, _, lay, cand in fitting:
        # A second key that changes nothing (zero=1 once dp is 1) is not another suggestion.
        outcome = (cand.memory.total, round(cand.cost.tokens_per_s, 6))
        if outcome not in outcomes:
            outcomes.add(outcome)
            out.append((lay, cand))
    return out[:limit]


def explain_oom(cfg: Config, model_cfg: LlamaConfig, world: int, device: Device, failure: dict) -> dict:
    """`failure` as `train.limits.parse_oom` reads it. Returns {"text": what to print,
    "breakdown", "scale", "suggestions": [[--set items], ...]}."""
    dev = budget_device(device, failure)
    base, work = layout_of_config(cfg, world), workload_of_config(cfg)
    current = evaluate(model_cfg, base, work, dev)
    predicted_seen = seen_bytes(current.memory.total, dev)
    scale = max(1.0, failure["peak_bytes"] / predicted_seen) if predicted_seen > 0 else 1.0
    found = suggestions(cfg, model_cfg, world, dev, scale)

    lay = base.to_dict()
    shown = " ".join(f"{k}={lay[k]}" for k in ("dp", "zero", "tp", "pp", "micro_batch", "activation_checkpoint",
                                                "offload"))
    bd = current.memory.to_dict()
    lines = [f"out of memory: rank {failure['rank']} peaked at {_size(failure['peak_bytes'])} at {failure['where']}, "
             f"over the limit of {_size(failure['limit_bytes'])} ({failure['source']})",
             f"the planner's memory per device for this layout ({shown}) on {world} × {device.name}:"]
    lines += [f"  {term:<13} {_size(bd[term]):>10}" for term in TERMS]
    lines.append(f"  {'total':<13} {_size(bd['total']):>10}   measured {_size(failure['peak_bytes'])}, "
                 f"limit {_size(failure['limit_bytes'])}")
    if scale > 1.0:
        lines.append(f"(this run measured {scale:.2f}× what the planner predicts; the suggestions allow for that)")
    if found:
        lines.append("changes that the planner says fit (fewest keys first, then fastest first):")
        for new, cand in found:
            args = " ".join(f"--set {item}" for item in set_args(base, new))
            lines.append(f"  {args}    # predicted {_size(cand.memory.total)}, "
                         f"{cand.cost.tokens_per_s:.0f} tokens/s")
    elif dev.runtime_bytes >= dev.memory_bytes:
        lines.append(f"no layout fits: a worker needs {_size(dev.runtime_bytes)} before its first tensor; "
                     f"raise the limit")
    else:
        lines.append(f"no change of one or two keys fits; {smallest_fit_advice(model_cfg, work, world, dev)}")
    return {"text": "\n".join(lines), "breakdown": bd, "scale": scale,
            "suggestions": [set_args(base, new) for new, _ in found]}
