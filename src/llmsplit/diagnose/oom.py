"""Explaining a run that ran out of memory: the planner's breakdown of the layout that
failed, against the limit it broke, and the smallest changes the planner says would fit.

The planner's number for the failed layout is compared with the peak the run measured;
when the run measured more, the planner under-estimates on this machine, and every
suggestion is scaled up by the same ratio before it is said to fit, so a suggestion is
not one that only fits on paper; each must also leave a margin of the limit free.

Two things widen that margin, both measured on 2 CPU workers (tiny model, seq 256):
- a CPU peak is the process's resident peak: the same run measures up to ~8% apart from
  one try to the next (562 and 606 MiB for one config), and it still grows after the first
  step, where a run over its limit stops (micro_batch=16: 716 MiB at step 1, 783 by step
  4; the allocator keeps what it freed), so CPU_MARGIN > MARGIN;
- the measured ratio belongs to the layout that failed; one that changes tp or pp runs
  other collectives and keeps other activations, and its own ratio differs (dp=2 measured
  1.05-1.13x the prediction, tp=2 1.28x), so such a change needs LAYOUT_CHANGE_FACTOR more.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..config import Config, layout_of, workload_of
from ..errors import ConfigError
from ..layout import Layout, check
from ..models.llama import LlamaConfig
from ..plan.api import runnable
from ..plan.hardware import Device
from ..plan.search import Candidate, evaluate, host_budget, single_changes, smallest_fit_advice

MiB, GiB = 1 << 20, 1 << 30
MARGIN = 0.08  # of the limit, left free by every suggestion (allocator peaks: GPUs)
CPU_MARGIN = 0.20  # resident-set peaks on a CPU vary from run to run and grow after step 1
LAYOUT_CHANGE_FACTOR = 1.15  # a suggestion that changes tp or pp: the ratio transfers less well
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
    base, work = layout_of(cfg, world), workload_of(cfg)
    margin = CPU_MARGIN if device.kind == "cpu" else MARGIN
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
        if (lay.tp, lay.pp) != (base.tp, base.pp):
            needs *= LAYOUT_CHANGE_FACTOR
        # A change that fits only just is no answer to an out-of-memory stop: peaks vary
        # from step to step and the planner is an estimate, so keep a margin.
        if needs <= (1 - margin) * device.memory_bytes and cand.memory.host <= host_budget(device) and \
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
    """`failure`: a worker's `MemoryLimitExceeded.details` (or a CUDA OOM's figures). Returns {"text": what to print,
    "breakdown", "scale", "suggestions": [[--set items], ...]}."""
    dev = budget_device(device, failure)
    base, work = layout_of(cfg, world), workload_of(cfg)
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


# ---------------------------------------------------------------- generate / serve

INFER_TERMS = ("weights", "kv_cache", "workspace", "staging", "reserve")


def infer_failure_from_cuda(error: BaseException, where: str) -> dict:
    """A CUDA out-of-memory error at load or generation time, as `explain_infer_oom` reads it:
    the device named in torch's message (else the one that allocated most), the allocator's
    peak there and the device's total memory."""
    import re

    import torch

    m = re.search(r"GPU (\d+)", str(error))
    n = torch.cuda.device_count()
    index = int(m.group(1)) if m else max(range(n), key=torch.cuda.max_memory_allocated)
    return {"device": f"cuda:{index}", "peak_bytes": torch.cuda.max_memory_allocated(index),
            "limit_bytes": torch.cuda.get_device_properties(index).total_memory, "where": where}


@dataclass(frozen=True)
class InferFailure:
    """A load or generation that ran out of memory, as data: the exception's traceback holds
    the half-loaded model, whose memory must be free before the budgets are read again."""

    measured: dict | None  # the CUDA stop (`infer_failure_from_cuda`); None: placement refused the budgets


def infer_oom_errors() -> tuple[type[BaseException], ...]:
    """What a load or a generation raises when the model does not fit: placement refused the
    memory budgets before loading, or CUDA ran out."""
    import torch

    from ..plan.placement import PlacementError

    return PlacementError, torch.OutOfMemoryError


def infer_failure(error: BaseException, where: str) -> InferFailure:
    """`error`, one of `infer_oom_errors()` raised while `where` ("loading the model", "generating")."""
    from ..plan.placement import PlacementError

    return InferFailure(None if isinstance(error, PlacementError) else infer_failure_from_cuda(error, where))


def explain_infer_failure(failure: InferFailure, model, config, *, max_batch_flag: bool,
                          min_context: int = 16) -> dict:
    """`explain_infer_oom` (its report) for `failure` of `llmsplit.load(model, config)` (an
    `InferConfig`), on the memory budgets as they are once the failed load is gone. Call it
    after leaving the `except` block (see `InferFailure`)."""
    import gc

    import torch

    from ..infer.api import placement_inputs
    from ..io.weights import open_weights

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # so that the budgets read below are the device's, not the failed load's
    source = open_weights(model)
    sizes, budgets, mode = placement_inputs(source, config)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return explain_infer_oom(source.config, sizes, budgets, mode, failure.measured, offload_dir=config.offload_dir,
                             max_batch_flag=max_batch_flag, gpus=gpus, min_context=min_context)


def explain_infer_oom(cfg: LlamaConfig, sizes, budgets: dict, mode, failure: dict | None, *, offload_dir,
                      max_batch_flag: bool, gpus: int = 0, min_context: int = 16) -> dict:
    """Why a model does not fit for generation and the changes of flags that would: one flag
    where one is enough, else a few together (`_budget_changes`).

    `sizes`/`budgets`/`mode` are what `plan.placement.place` was given; `failure` is None when
    placement refused the budgets before loading, else a measured CUDA stop
    (`infer_failure_from_cuda`). Every suggestion is checked by `place` itself on the same
    budgets (shrunk by measured/predicted for a measured stop, less MARGIN), so applying it
    makes the load fit. No --max-context below `min_context` (the prompt must fit) is offered.
    Returns {"text", "breakdown", "scale", "suggestions": [[flag, value, ...], ...]}."""
    from ..plan.placement import MODES, PlacementError, fmt_bytes, kind, place, units, usage_by_device

    exec_device = next((d for d in budgets if kind(d) not in ("cpu", "disk")), "cpu")
    on_one = {u: exec_device for u, _ in units(cfg, sizes.dtype_bytes)}
    whole = usage_by_device(cfg, on_one, exec_device, replace(sizes, cpu_moe_layers=0))[exec_device]  # all there
    scale = 1.0
    if failure is not None:
        try:
            seen = place(cfg, budgets, mode, sizes).usage.get(failure["device"], {}).get("total", 0)
        except PlacementError:
            seen = 0
        scale = max(1.0, failure["peak_bytes"] / seen) if seen else 1.0
    shrunk = {d: (None if v is None else int(v * (1 - MARGIN) / (scale if kind(d) not in ("cpu", "disk") else 1)))
              for d, v in budgets.items()}

    def fits(s, disk: bool) -> bool:
        try:
            place(cfg, {**shrunk, "disk": None} if disk else shrunk, mode, s)
            return True
        except PlacementError:
            return False

    offload = offload_dir is None and isinstance(mode, str) and mode in MODES
    found = _budget_changes(sizes, fits, offload=offload, max_batch_flag=max_batch_flag, min_context=min_context)
    found = sorted(found + [[change] for change in _split_changes(cfg, sizes, budgets, scale, gpus)], key=len)

    shown = {d: v for d, v in budgets.items() if d != "disk"}
    head = (f"out of memory on {failure['device']} while {failure['where']}: the allocator peaked at "
            f"{fmt_bytes(failure['peak_bytes'])} of {fmt_bytes(failure['limit_bytes'])}" if failure else
            "out of memory: the model does not fit the memory budgets (" +
            ", ".join(f"{d} {fmt_bytes(v)}" for d, v in shown.items()) + ")")
    lines = [head, f"what generation needs, all on {exec_device} ({sizes.batch} × {sizes.context} tokens of KV "
                   f"cache, {sizes.dtype_bytes}-byte weights):"]
    lines += [f"  {term:<10} {fmt_bytes(whole[term]):>11}" for term in INFER_TERMS
              if whole[term] or term in ("weights", "kv_cache", "workspace")]
    lines.append(f"  {'total':<10} {fmt_bytes(whole['total']):>11}")
    if scale > 1.0:
        lines.append(f"(the run measured {scale:.2f}× what placement predicts on {failure['device']}; the "
                     f"suggestions allow for that)")
    if found:
        lines.append("changes that fit (each checked by the placement, with a margin; fewest flags first):")
        flags = [" ".join(f"{flag} {value}" for flag, value, _ in change) for change in found]
        width = max(len(f) for f in flags)
        lines += [f"  {f:<{width}}  # " + "; ".join(why for _, _, why in change) for f, change in zip(flags, found)]
    else:
        tried = ["--max-context"] + ["--max-batch"] * max_batch_flag + ["--offload-dir"] * offload + \
                ["--dtype bf16"] * (sizes.dtype_bytes == 4) + ["--tp/--pp"] * (gpus > 1)
        lines.append(f"no change of {', '.join(tried)} fits, alone or together; raise --max-memory (or use a "
                     f"machine with more memory)")
    return {"text": "\n".join(lines), "breakdown": {k: whole[k] for k in (*INFER_TERMS, "total")}, "scale": scale,
            "suggestions": [[part for flag, value, _ in change for part in (flag, value)] for change in found]}


def _budget_changes(sizes, fits, *, offload: bool, max_batch_flag: bool, min_context: int) -> list[list[tuple]]:
    """Changes that make `fits(sizes, disk)` true, each a list of (flag, value, what it costs).
    --offload-dir (where `offload`) and --dtype bf16 (where the weights are 4-byte) are tried
    alone and together; each such set as it is, else with the largest --max-context (and
    --max-batch where the command has it, then both) that fits. A set that fits as it is makes
    every set that contains it no suggestion."""
    from itertools import combinations

    toggles = ([("--offload-dir", "DIR", "what fits in no budget is read from disk (slow)")]
               if offload else []) + \
              ([("--dtype", "bf16", "half the bytes (results differ slightly)")] if sizes.dtype_bytes == 4 else [])
    found, enough = [], []
    for n in range(len(toggles) + 1):
        for chosen in combinations(toggles, n):
            if any(set(e) <= set(chosen) for e in enough):
                continue
            flags = {flag for flag, _, _ in chosen}
            s = replace(sizes, dtype_bytes=2, kv_dtype_bytes=min(2, sizes.kv_dtype_bytes)) if "--dtype" in flags else sizes
            disk = "--offload-dir" in flags
            if chosen and fits(s, disk):
                enough.append(chosen)
                found.append(list(chosen))
                continue
            shrinks = _shrinks(s, lambda t, d=disk: fits(t, d), max_batch_flag, min_context)
            found += [list(chosen) + shrink for shrink in shrinks]
    return found


def _shrinks(sizes, fits, max_batch_flag: bool, min_context: int) -> list[list[tuple[str, str, str]]]:
    """The largest --max-context that `fits`; where the command has --max-batch, also the
    largest batch, and when neither alone fits, one sequence with the largest context."""
    def largest_context(s):
        return next((v for v in _halvings(s.context, max(16, min_context)) if fits(replace(s, context=v))), None)

    def context_change(v):
        return ("--max-context", str(v), f"prompt + output at most {v} tokens")

    out = []
    if (context := largest_context(sizes)) is not None:
        out.append([context_change(context)])
    if max_batch_flag:
        batch = next((v for v in _halvings(sizes.batch, 1) if fits(replace(sizes, batch=v))), None)
        if batch is not None:
            out.append([("--max-batch", str(batch), f"{batch} sequences decoded together")])
        elif not out and sizes.batch > 1 and (context := largest_context(replace(sizes, batch=1))) is not None:
            out.append([("--max-batch", "1", "one sequence at a time"), context_change(context)])
    return out


def _split_changes(cfg: LlamaConfig, sizes, budgets: dict, scale: float, gpus: int) -> list[tuple[str, str, str]]:
    """(flag, value, what it costs) for the fewest GPUs under --tp or --pp whose share of the
    model (the planner's inference memory, times `scale`) fits the smallest GPU budget."""
    from ..plan.placement import kind

    accel_budgets = [v for d, v in budgets.items() if kind(d) not in ("cpu", "disk") and v is not None]
    if gpus <= 1 or not accel_budgets:
        return []
    from .probe import local_device
    from ..layout import Layout, Workload
    from ..plan.memory import inference_memory

    work = Workload(sizes.context, sizes.batch, {4: "fp32", 2: "bf16"}.get(sizes.dtype_bytes, "bf16"), "infer")
    device = replace(local_device(gpus), memory_bytes=min(accel_budgets))
    found = []
    for n in (k for k in (2, 4, 8) if k <= gpus):
        for flag, lay in (("--tp", Layout(tp=n)), ("--pp", Layout(pp=n))):
            try:
                check(cfg, lay, work)
            except ConfigError:
                continue
            if inference_memory(cfg, lay, work, device).total * scale <= (1 - MARGIN) * device.memory_bytes:
                found.append((flag, str(n), f"{n} GPUs, one worker each"))
        if found:
            break
    return found


def _halvings(start: int, floor: int) -> list[int]:
    """start/2, start/4, ... down to floor: the largest smaller value that fits comes first."""
    out, v = [], start // 2
    while v >= floor:
        out.append(v)
        v //= 2
    return out
