"""Enumerate layouts, keep those that fit, rank them by predicted tokens/s, and say why
the others do not fit with a change that the model has checked would make them fit."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ConfigError
from ..layout import Layout, Workload, check
from ..layout.rules import divisors
from ..models.llama import LlamaConfig
from .cost import StepCost, step_cost
from .hardware import Device
from .memory import Breakdown, memory_per_device

GiB = 1024 ** 3


@dataclass
class Candidate:
    layout: Layout
    memory: Breakdown
    cost: StepCost | None
    fits: bool
    why_not: str | None = None

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "fits": self.fits, "why_not": self.why_not,
                "memory_per_device": self.memory.to_dict(),
                "host_bytes_per_device": self.memory.host,
                "step_time_s": self.cost.step_time_s if self.cost else None,
                "tokens_per_s": self.cost.tokens_per_s if self.cost else None,
                "mfu": self.cost.mfu if self.cost else None}


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def host_budget(device: Device) -> int:
    return device.host_memory_bytes // device.gpus_per_node


def fits(mem: Breakdown, device: Device) -> bool:
    return mem.total <= device.memory_bytes and mem.host <= host_budget(device)


def evaluate(cfg: LlamaConfig, layout: Layout, work: Workload, device: Device, with_cost: bool = True) -> Candidate:
    mem = memory_per_device(cfg, layout, work, device)
    ok = fits(mem, device)
    return Candidate(layout, mem, step_cost(cfg, layout, work, device) if with_cost else None, ok)


# ---------------------------------------------------------------- enumeration

def _powers_of_two_dividing(n: int) -> list[int]:
    out, d = [], 1
    while d <= n:
        if n % d == 0:
            out.append(d)
        d *= 2
    return out


def enumerate_layouts(cfg: LlamaConfig, work: Workload, world: int, device: Device, minimal: bool = False):
    """Every layout that `layout.check` accepts (so `llmsplit train` or inference runs it) on
    `world` devices. `minimal` keeps only the options that use the least memory (for "how
    many devices would it take")."""
    for tp in divisors(min(world, device.gpus_per_node)):
        if world % tp:
            continue
        for pp in divisors(world // tp):
            # Context parallel in training: every degree the ranks divide by (layout.check keeps
            # those the sequence allows), so a sequence too long for one device is split.
            for cp in [1] if work.mode == "infer" else divisors(world // (tp * pp)):
                dp = world // (tp * pp * cp)
                if work.mode == "infer":
                    variants = [Layout(dp=dp, tp=tp, pp=pp)]
                elif work.global_batch % dp:
                    continue  # no micro-batch size makes this dp divide the batch
                else:
                    variants = _training_variants(cfg, work, device, tp, pp, dp, minimal, cp)
                yield from (lay for lay in variants if accepts(cfg, lay, work, world))


def accepts(cfg: LlamaConfig, layout: Layout, work: Workload, world: int) -> bool:
    """Does `layout.check` (the rules training and inference enforce) accept the layout?"""
    try:
        check(cfg, layout, work, world)
    except ConfigError:
        return False
    return True


def _training_variants(cfg, work, device, tp, pp, dp, minimal, cp=1):
    per_rank = work.global_batch // dp
    zeros = [0] if dp == 1 else ([1, 2, 3] if minimal else [0, 1, 2, 3])
    if cp > 1:  # long sequences: the cp ranks shard the model state too (torchtitan's FSDP + CP)
        zeros = [3]
    schedules = ["1f1b"]
    if pp > 1:
        schedules = ["1f1b", "zbv"] if minimal else ["1f1b", "interleaved_1f1b", "zbv"]
    micro = [1] if minimal else _powers_of_two_dividing(per_rank)
    checkpoints = ["full"] if minimal else ["none", "selective", "full"]
    # Expert parallel for MoE models: every degree that divides a replica's ranks and the
    # experts, beside tp and hybrid sharding too (the rules in layout/ say which combinations run).
    eps = [e for e in divisors(dp) if e == 1 or (cfg.n_experts and cfg.n_experts % e == 0)]
    for zero in zeros:
        replicas = [1]
        shard_in_node = device.gpus_per_node // tp
        if zero >= 2 and dp > shard_in_node and shard_in_node > 1 and dp % shard_in_node == 0:
            replicas.append(dp // shard_in_node)  # hybrid: shard inside a node, replicate across
        for r in replicas:
            for sched in schedules:
                v = 2 if sched in ("interleaved_1f1b", "zbv") else 1
                for mb in micro:
                    for ac in checkpoints:
                        for ep in [e for e in eps if (dp // r) % e == 0] if zero != 1 else [1]:
                            yield Layout(dp=dp, dp_replicate=r, zero=zero, tp=tp, pp=pp, pp_schedule=sched,
                                         pp_virtual_stages=v if sched == "interleaved_1f1b" else 1,
                                         micro_batch=mb, activation_checkpoint=ac, ep=ep, cp=cp)
    # A model too big for the devices' memory can still train with its sharded state on
    # the host (FSDP's CPU offload), on a single device too.
    if device.kind != "cpu":
        for mb in [1] if minimal else _powers_of_two_dividing(per_rank)[:3]:
            for ac in ("full",) if minimal else ("selective", "full"):
                sched = "1f1b"
                yield Layout(dp=dp, zero=3, tp=tp, pp=pp, pp_schedule=sched, micro_batch=mb,
                             activation_checkpoint=ac, offload="cpu")


# ---------------------------------------------------------------- search

def search(cfg: LlamaConfig, work: Workload, world: int, device: Device, layout: Layout | None = None) -> dict:
    """All layouts that run (or just `layout`), fitting ones first, fastest first."""
    if layout is not None:
        check(cfg, layout, work, world)
        layouts = [layout]
    else:
        layouts = list(enumerate_layouts(cfg, work, world, device))
        if not layouts:
            check(cfg, Layout(), work, 1)  # what refuses every layout, not a layout's (a sequence too long, say)
            raise ConfigError(f"no layout divides {world} device(s) for this model and a global batch of "
                              f"{work.global_batch}; use a global batch divisible by the device count")
    candidates = [evaluate(cfg, lay, work, device) for lay in layouts]
    # Fitting layouts fastest first; the others closest to fitting first.
    candidates.sort(key=lambda c: (not c.fits, -c.cost.tokens_per_s if c.fits else c.memory.total))
    advice = None
    if not any(c.fits for c in candidates):
        if layout is None or not any(fits(memory_per_device(cfg, lay, work, device), device)
                                     for lay in enumerate_layouts(cfg, work, world, device)):
            advice = smallest_fit_advice(cfg, work, world, device)
        else:
            advice = f"other layouts fit on {world} × {device.name}: run without --layout to rank them"
    for cand in candidates:
        if not cand.fits:
            cand.why_not = explain(cfg, cand, work, device, advice)
    if layout is not None and advice and candidates[0].why_not and "use " in candidates[0].why_not:
        advice = None  # the layout's own explanation already names the fix
    return {"candidates": candidates, "advice": advice, "excluded": closest_excluded(candidates),
            "runnable": [c for c in candidates if c.fits]}


def closest_excluded(candidates: list[Candidate], n: int = 3) -> list[Candidate]:
    """The layouts left out that a user would want most: those faster than the best fitting one
    (why they lose is the news), closest to fitting first; with none faster, the closest."""
    best = next((c for c in candidates if c.fits), None)
    if best is None:
        return []  # the layouts shown are then the excluded ones, each with its reason
    left_out = [c for c in candidates if not c.fits]
    faster = [c for c in left_out if c.cost.tokens_per_s > best.cost.tokens_per_s]
    return (faster or left_out)[:n]


def explain(cfg: LlamaConfig, cand: Candidate, work: Workload, device: Device, advice: str | None) -> str:
    """Which term breaks the budget, and one change (checked by the model) that fixes it."""
    mem, budget = cand.memory, device.memory_bytes
    if mem.total <= budget:  # only the host side is short
        reason = (f"offloaded state {_gib(mem.host)} per device exceeds this node's host memory share "
                  f"{_gib(host_budget(device))}")
    else:
        terms = {"model state": mem.params + mem.grads + mem.optimizer, "activations": mem.activations,
                 "communication buffers": mem.comm_buffers}
        name, value = max(terms.items(), key=lambda kv: kv[1])
        rest = mem.total - value
        reason = f"{name} {_gib(value)} > {_gib(budget)} − {_gib(rest)} of everything else"
    fixes = [f for f in single_changes(cand.layout, cfg, work, device)
             if fits(memory_per_device(cfg, f[1], work, device), device)]
    if fixes:
        return f"{reason}: use {' or '.join(text for text, _ in fixes[:2])}"
    return f"{reason}; {advice}" if advice else f"{reason}; no single change of this layout fits"


def single_changes(layout: Layout, cfg: LlamaConfig, work: Workload, device: Device):
    """Layouts one key away, cheapest in speed first."""
    out = []
    order = ["none", "selective", "full"]
    for ac in order[order.index(layout.activation_checkpoint) + 1:]:
        out.append((f"activation_checkpoint={ac}", replace(layout, activation_checkpoint=ac)))
    if layout.micro_batch > 1:
        out.append((f"micro_batch={layout.micro_batch // 2}", replace(layout, micro_batch=layout.micro_batch // 2)))
    if layout.dp > 1:
        for z in range(layout.zero + 1, 4):
            out.append((f"zero={z}", replace(layout, zero=z)))
    for key in ("tp", "pp"):
        if layout.dp % 2 == 0:
            bigger = replace(layout, **{key: getattr(layout, key) * 2}, dp=layout.dp // 2, dp_replicate=1)
            out.append((f"{key}={getattr(bigger, key)}", bigger))
    if layout.offload == "none" and device.kind != "cpu":
        out.append(("zero=3 with offload=cpu", replace(layout, zero=3, dp_replicate=1, offload="cpu")))
    return [(text, lay) for text, lay in out
            if lay.tp <= device.gpus_per_node and accepts(cfg, lay, work, layout.world)]


def smallest_fit(cfg: LlamaConfig, work: Workload, world: int, device: Device, offload: bool,
                 limit: int = 16384) -> tuple[int, Layout] | None:
    """The fewest devices of this kind (doubling from `world`, in full nodes) on which some layout fits."""
    device = replace(device, gpus_per_node=device.node_size)
    n = world * 2
    while n <= limit:
        # Keep the batch per device: more devices train on a proportionally larger batch.
        lay = first_fit(cfg, replace(work, global_batch=work.global_batch * n // world), n, device, offload)
        if lay:
            return n, lay
        n *= 2
    return None


def first_fit(cfg: LlamaConfig, work: Workload, world: int, device: Device, offload: bool) -> Layout | None:
    """A layout of the least-memory options that fits `world` devices, offloaded or not."""
    for lay in enumerate_layouts(cfg, work, world, device, minimal=True):
        if (lay.offload != "none") == offload and fits(memory_per_device(cfg, lay, work, device), device):
            return lay
    return None


def smallest_fit_advice(cfg: LlamaConfig, work: Workload, world: int, device: Device) -> str:
    plain = smallest_fit(cfg, work, world, device, offload=False)
    parts = []
    if plain:
        parts.append(f"it needs at least {plain[0]} × {device.name} (e.g. {_layout_text(plain[1])})")
    if device.kind != "cpu":
        off = smallest_fit(cfg, work, world, device, offload=True)
        if off and (not plain or off[0] < plain[0]):
            parts.append(f"{off[0]} × {device.name} with offload=cpu (e.g. {_layout_text(off[1])})")
    if not parts:
        return f"no count of {device.name} up to 16384 fits; shorten the sequence or the batch"
    return "nothing fits on " + f"{world} × {device.name}: " + ", or ".join(parts)


def _layout_text(lay: Layout) -> str:
    return ",".join(lay.settings())
