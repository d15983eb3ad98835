"""Device maps from memory budgets: which device holds each part of the model for generation.

`place` is a pure function of the model config and the budgets, so it is tested with fake
budgets of several GPUs. Unlike Accelerate's `infer_auto_device_map`, which counts weights
only, every device is charged for what generation really allocates there: the weights of
its modules, the KV cache of its layers for batch × context tokens, an activation
workspace and a runtime reserve (CUDA context, allocator slack). Layers that fit on no
accelerator are offloaded: their weights sit in CPU memory (or on disk, memory-mapped) and
are brought to the execution device one layer at a time, so the execution device also
pays for their KV cache and for two layers of staging (the running one and the prefetched one).

Units, in model order: `tok_embeddings`, `layers.0` … `layers.{n-1}`, `norm`, `output`.
`Sizes.cpu_moe_layers` keeps MoE layers' experts in CPU memory, charged there (the runner's
cpu_experts.py runs them). A pure model of memory, beside the planner: the inference runner
places with it, the out-of-memory explainer (diagnose/oom.py) re-places with it; the budgets
themselves are measured on the machine by the runner (infer/runner/budgets.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..models.llama import LlamaConfig

GiB = 1 << 30
MODES = ("auto", "balanced", "sequential")
# CUDA context, cuBLAS workspaces and allocator fragmentation: what a device loses before
# the first tensor is allocated. The CPU budget is already what the OS reports as available.
DEFAULT_RESERVE = {"cuda": 768 << 20, "cpu": 0, "disk": 0}


class PlacementError(ConfigError):
    """The budgets cannot hold the model (a user-fixable sizing problem: exit 2)."""


@dataclass(frozen=True)
class Sizes:
    """What placement needs to know about the run, besides the model config."""
    batch: int = 1  # sequences decoded together
    context: int = 2048  # tokens per sequence (prompt + generated)
    dtype_bytes: int = 4  # weights and activations
    kv_dtype_bytes: float = 4  # per key/value element, scales included (kv_cache.kv_element_bytes)
    reserve: dict = field(default_factory=lambda: dict(DEFAULT_RESERVE))
    kv_tokens: int | None = None  # the KV pool, shared by all sequences (None: batch full contexts)
    # {unit: bytes} of units whose weights stay packed (int4/int8, `io.weights.packed_unit_bytes`)
    # while resident; a unit offloaded to disk is widened, so streaming counts its float bytes.
    packed_bytes: dict = field(default_factory=dict)
    cpu_moe_layers: int = 0  # the first N MoE layers keep their routed experts in CPU memory

    @property
    def pool_tokens(self) -> int:
        return self.kv_tokens or self.batch * self.context


@dataclass
class Placement:
    device_map: dict[str, str]  # unit -> "cuda:0" | "cpu" | "disk" ...
    exec_device: str  # where offloaded (cpu/disk) units run
    usage: dict[str, dict[str, int]]  # device -> bytes by kind and "total"
    budgets: dict[str, int | None]
    cpu_experts: list[int] = field(default_factory=list)  # layers whose routed experts stay in CPU memory

    def describe(self) -> str:
        """The map as `--show-device-map` prints it: runs of units, then bytes per device."""
        lines, run = [], []
        for unit, dev in list(self.device_map.items()) + [("", None)]:
            if run and dev != run[-1][1]:
                first, last = run[0][0], run[-1][0]
                lines.append(f"  {first if first == last else first + ' .. ' + last}: {run[0][1]}")
                run = []
            run.append((unit, dev))
        if any(_offloaded(d, self.exec_device) for d in self.device_map.values()):
            lines.append(f"  offloaded units run on: {self.exec_device}")
        if self.cpu_experts:
            first, last = self.cpu_experts[0], self.cpu_experts[-1]
            lines.append(f"  experts of layers.{first}{'' if first == last else ' .. layers.' + str(last)}: cpu")
        for dev, u in self.usage.items():
            budget = self.budgets.get(dev)
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in u.items() if k != "total" and v)
            lines.append(f"  {dev}: {fmt_bytes(u['total'])} of {fmt_bytes(budget) if budget is not None else 'unlimited'}"
                         f" ({parts or 'nothing'})")
        return "device map:\n" + "\n".join(lines)


def units(cfg: LlamaConfig, dtype_bytes: int, packed: dict | None = None) -> list[tuple[str, int]]:
    """(unit, weight bytes) in model order; `packed` overrides the bytes of packed units."""
    layer = cfg.layer_params() * dtype_bytes
    emb = cfg.vocab_size * cfg.dim * dtype_bytes
    out = ([("tok_embeddings", emb)] + [(f"layers.{i}", layer) for i in range(cfg.n_layers)]
           + [("norm", cfg.dim * dtype_bytes), ("output", emb)])
    return [(u, (packed or {}).get(u, b)) for u, b in out]


def kv_bytes_per_layer(cfg: LlamaConfig, s: Sizes) -> int:
    return int(2 * cfg.n_kv_heads * cfg.head_dim * s.kv_dtype_bytes * s.pool_tokens)


def workspace_bytes(cfg: LlamaConfig, s: Sizes, holds_output: bool) -> int:
    """Activations of the largest step: the prefill of one full-context sequence (the engine
    prefills one sequence at a time) or a decode step of the whole batch, whichever is larger.
    Per token: the residual stream and its normed copy, q/k/v, attention output, the two MLP
    inputs and their product (x3 ffn), and the gathered keys/values of the paged cache.
    Attention scores are not counted: the fused kernels (CPU flash and CUDA SDPA) stream them.
    The device holding `output` also keeps fp32 logits for every sequence of the batch."""
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    per_token = (4 * cfg.dim + 2 * kv_dim + 3 * cfg.active_ffn_dim()) * s.dtype_bytes + 2 * kv_dim * max(s.kv_dtype_bytes, s.dtype_bytes)
    tokens = max(s.context, s.batch)
    return tokens * per_token + (4 * s.batch * cfg.vocab_size if holds_output else 0)


def kind(device: str) -> str:
    return device.split(":")[0]


def place(cfg: LlamaConfig, budgets: dict[str, int | None], mode: str | dict = "auto",
          sizes: Sizes = Sizes()) -> Placement:
    """A device map for `cfg` within `budgets` ({device: bytes or None for unlimited}, in
    preference order: accelerators first, then "cpu", then "disk" when offloading to disk
    is allowed). `mode`: "auto"/"sequential" fill the devices in order; "balanced" spreads
    the model evenly over the accelerators when it fits on them; a device name puts
    everything there; a dict {unit or prefix: device} is an explicit map."""
    order = [d for d in budgets if kind(d) not in ("cpu", "disk")] + [d for d in ("cpu", "disk") if d in budgets]
    exec_device = order[0] if order and order[0] != "disk" else "cpu"
    all_units = units(cfg, sizes.dtype_bytes, sizes.packed_bytes)
    if isinstance(mode, dict) or mode not in MODES:
        explicit = mode if isinstance(mode, dict) else {"": mode}
        dmap = _explicit_map(all_units, explicit)
        accel = [d for d in dict.fromkeys(dmap.values()) if kind(d) not in ("cpu", "disk")]
        exec_device = accel[0] if accel else "cpu"
        _check(usage_by_device(cfg, dmap, exec_device, sizes), budgets, cfg, sizes)
        return _placement(cfg, dmap, exec_device, budgets, sizes)
    if mode == "balanced":
        accel = [d for d in order if kind(d) not in ("cpu", "disk")]
        dmap = _balanced(cfg, all_units, accel, budgets, sizes) if accel else None
        if dmap is not None:
            return _placement(cfg, dmap, exec_device, budgets, sizes)
    dmap = _fill(cfg, all_units, order, budgets, exec_device, sizes)
    if dmap is None:
        # Everything on the last tier shows the shortfall against the budgets.
        dmap = {u: order[-1] if order else "cpu" for u, _ in all_units}
        _check(usage_by_device(cfg, dmap, exec_device, sizes), budgets, cfg, sizes, whole=True)
    return _placement(cfg, dmap, exec_device, budgets, sizes)


def _placement(cfg, dmap, exec_device, budgets, s: Sizes) -> Placement:
    return Placement(dmap, exec_device, usage_by_device(cfg, dmap, exec_device, s), dict(budgets),
                     cpu_expert_layers(cfg, dmap, s.cpu_moe_layers, lambda d: not _offloaded(d, exec_device)))


def _offloaded(device: str, exec_device: str) -> bool:
    """Weights kept here but run elsewhere (streamed to the execution device)."""
    return device == "disk" or (device == "cpu" and exec_device != "cpu")


def usage_by_device(cfg: LlamaConfig, dmap: dict[str, str], exec_device: str, s: Sizes) -> dict[str, dict[str, int]]:
    """{device: {"weights", "kv_cache", "workspace", "staging", "reserve": bytes}} under `dmap`."""
    sizes, resident = dict(units(cfg, s.dtype_bytes)), dict(units(cfg, s.dtype_bytes, s.packed_bytes))
    kv = kv_bytes_per_layer(cfg, s)
    usage: dict[str, dict[str, int]] = {}

    def charge(dev: str, what: str, n: int):
        u = usage.setdefault(dev, {"weights": 0, "kv_cache": 0, "workspace": 0, "staging": 0, "reserve": 0})
        u[what] += n

    staging = 0
    # A tied head shares the embedding's tensor when both sit, unstreamed, on one device.
    shared = (cfg.tie_embeddings and dmap.get("output") is not None and dmap.get("output") == dmap.get("tok_embeddings")
              and not _offloaded(dmap["output"], exec_device))
    on_cpu = {f"layers.{i}" for i in cpu_expert_layers(cfg, dmap, s.cpu_moe_layers,
                                                        lambda d: not _offloaded(d, exec_device))}
    for unit, dev in dmap.items():
        held = sizes[unit] if _offloaded(dev, exec_device) else resident[unit]
        if unit in on_cpu:  # its experts in CPU memory, the rest of the layer on its device
            moved = min(held, cfg.routed_expert_params() * s.dtype_bytes)
            charge("cpu", "weights", moved)
            held -= moved
        charge(dev, "weights", 0 if unit == "output" and shared else held)
        runs_on = exec_device if _offloaded(dev, exec_device) else dev
        if _offloaded(dev, exec_device):
            staging = max(staging, sizes[unit])
        if unit.startswith("layers."):
            charge(runs_on, "kv_cache", kv)
    if staging:
        charge(exec_device, "staging", 2 * staging)  # the running unit and the prefetched one
    computing = {exec_device if _offloaded(d, exec_device) else d for d in dmap.values()}
    out = dmap.get("output")  # absent while a map is being filled
    out_dev = exec_device if out and _offloaded(out, exec_device) else out
    for dev in computing:
        charge(dev, "workspace", workspace_bytes(cfg, s, holds_output=dev == out_dev))
    for dev, u in usage.items():
        u["reserve"] = s.reserve.get(kind(dev), 0)
        u["total"] = sum(u.values())
    return usage


def _check(usage, budgets, cfg: LlamaConfig, s: Sizes, whole: bool = False) -> None:
    over = {d: u["total"] - budgets[d] for d, u in usage.items()
            if budgets.get(d) is not None and u["total"] > budgets[d]}
    if not over:
        return
    short = sum(over.values())
    where = ", ".join(f"{d} by {fmt_bytes(n)}" for d, n in over.items())
    what = "the model" if whole else "the device map"
    # In llmsplit.load's terms: the command line explains this failure with its own flags
    # (diagnose/oom.explain_infer_failure). Disk offload is suggested only when not in use already.
    fixes = "raise max_memory, or lower max_batch or max_context" + (
        "" if "disk" in budgets else ", or pass offload_dir (a folder for what fits in no budget)")
    raise PlacementError(f"{what} needs {short} bytes ({fmt_bytes(short)}) more than the memory budgets allow "
                         f"({where}; counting weights, the KV cache for {s.batch} x {s.context} tokens, workspace "
                         f"and reserve): {fixes}")


def _fill(cfg, all_units, order, budgets, exec_device, s: Sizes, scale: float = 1.0) -> dict[str, str] | None:
    """Sequential fill. The first k units go, in order, to the devices that run them (the
    accelerators, or the CPU when it computes), the rest to the offload tiers (CPU memory,
    then disk). A greedy fill alone would use up the execution device and leave no room for
    the staging buffers and KV cache that the offloaded units need there, so k is searched:
    the largest k whose map fits. None when no k fits.

    A second search keeps the final norm and the output head resident too and offloads only
    the middle layers. It wins when the head is large next to a layer: streaming it costs
    two head-sized staging buffers on the execution device and, when tied, a second copy
    of the embedding. SmolLM2-135M in 365 MiB of CPU: 1 resident layer with the head
    streamed, or 15 with it resident. The map that streams fewer bytes per token is kept."""
    resident = [d for d in order if not _offloaded(d, exec_device)]
    offload = [d for d in order if _offloaded(d, exec_device)]
    n = len(all_units)
    ends = [u for u in all_units if u[0] in ("norm", "output")]

    def attempt(k: int, keep_ends: bool) -> dict[str, str] | None:
        head, tail = (all_units[:k] + ends, all_units[k:-len(ends)]) if keep_ends else (all_units[:k], all_units[k:])
        # The offloaded part first, so that filling the resident devices already sees what
        # it costs on the execution device.
        dmap = _greedy(cfg, tail, offload, {}, budgets, exec_device, s, scale)
        dmap = None if dmap is None else _greedy(cfg, head, resident, dmap, budgets, exec_device, s, scale)
        return None if dmap is None else {u: dmap[u] for u, _ in all_units}

    def largest(keep_ends: bool, top: int) -> dict[str, str] | None:
        best = attempt(top, keep_ends)
        if best is not None or not offload:
            return best
        lo, hi = -1, top  # attempt(hi) fails; search the largest k that works
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = attempt(mid, keep_ends) if mid >= 0 else None
            if found is not None:
                lo, best = mid, found
            else:
                hi = mid
        return best if best is not None else attempt(0, keep_ends)

    best = largest(False, n)
    if not offload or not ends or (best is not None and all(not _offloaded(best[u], exec_device) for u, _ in ends)):
        return best
    # Also when nothing fits with the head streamed: SmolLM2-135M in 200 MB of CPU fits only
    # with its (tied) head resident, the two-head-sized staging buffers being too many.
    other = largest(True, n - len(ends))
    if other is not None and (best is None or _streamed(cfg, other, exec_device, s) < _streamed(cfg, best, exec_device, s)):
        return other
    return best


def _streamed(cfg, dmap: dict[str, str], exec_device: str, s: Sizes) -> int:
    """Weight bytes copied to the execution device for every token (the offloaded units)."""
    sizes = dict(units(cfg, s.dtype_bytes))
    return sum(sizes[u] for u, d in dmap.items() if _offloaded(d, exec_device))


def _greedy(cfg, todo, devices, dmap, budgets, exec_device, s: Sizes, scale: float) -> dict[str, str] | None:
    dmap, di = dict(dmap), 0
    for unit, _ in todo:
        while di < len(devices):
            dmap[unit] = devices[di]
            if _fits(cfg, dmap, exec_device, budgets, s, scale):
                break
            di += 1
        else:
            return None
    return dmap


def _fits(cfg, dmap, exec_device, budgets, s: Sizes, scale: float) -> bool:
    for dev, u in usage_by_device(cfg, dmap, exec_device, s).items():
        budget = budgets.get(dev)
        if budget is not None and u["total"] > (budget * scale if kind(dev) not in ("cpu", "disk") else budget):
            return False
    return True


def _balanced(cfg, all_units, accel, budgets, s: Sizes) -> dict[str, str] | None:
    """Cut the model into contiguous runs whose weights + KV cache are proportional to the
    accelerators' budgets (each cut at the unit boundary nearest its target); None when that
    map, or any map on the accelerators alone, does not fit."""
    kv = kv_bytes_per_layer(cfg, s)
    cost = [(u, w + (kv if u.startswith("layers.") else 0)) for u, w in all_units]
    total = sum(c for _, c in cost)
    caps = [budgets[d] if budgets[d] is not None else total for d in accel]
    targets, acc = [], 0
    for c in caps:
        acc += c
        targets.append(total * acc / sum(caps))
    dmap, done, di = {}, 0, 0
    for unit, c in cost:
        while di < len(accel) - 1 and done + c / 2 > targets[di]:
            di += 1
        dmap[unit] = accel[di]
        done += c
    return dmap if _fits(cfg, dmap, accel[0], budgets, s, 1.0) else _fill(cfg, all_units, accel, budgets, accel[0], s)


def _explicit_map(all_units, explicit: dict[str, str]) -> dict[str, str]:
    dmap = {}
    for unit, _ in all_units:
        keys = [k for k in explicit if k == "" or unit == k or unit.startswith(k + ".")]
        if not keys:
            raise ConfigError(f"the device map places no device for {unit!r}; give every module a device "
                              f"(keys are module names or prefixes such as 'layers', '' for the whole model)")
        dmap[unit] = normalize_device(explicit[max(keys, key=len)])
    return dmap


def normalize_device(dev) -> str:
    dev = str(dev)
    if dev == "cuda":
        return "cuda:0"
    if re.fullmatch(r"cpu|disk|cuda:\d+|mps", dev):
        return dev
    raise ConfigError(f"device {dev!r} is not one of: cpu, disk, cuda:N, mps")


# ---------------------------------------------------------------- sizes as users write them

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text, what: str) -> int:
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ConfigError(f"{what}={text!r} is not a size; write bytes or e.g. 512MiB, 20GiB, 1.5GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def parse_max_memory(spec, what: str = "--max-memory") -> dict[str, int]:
    """`"cuda:0=20GiB,cpu=64GiB"` or a dict {device: size} -> {device: bytes}."""
    if isinstance(spec, str):
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise ConfigError(f"{what} {spec!r} does not parse; write DEVICE=SIZE pairs such as "
                                  f"cuda:0=20GiB,cpu=64GiB")
            items.append(part.split("=", 1))
    else:
        items = list(spec.items())
    out = {}
    for dev, size in items:
        dev = normalize_device(dev.strip() if isinstance(dev, str) else dev)
        out[dev] = parse_size(size.strip() if isinstance(size, str) else size, f"{what} {dev}")
    return out


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def cpu_expert_layers(cfg: LlamaConfig, dmap: dict[str, str], n: int, resident: Callable[[str], bool]) -> list[int]:
    """The first `n` layers (all of them when n ≥ n_layers) whose experts stay in CPU memory
    (--n-cpu-moe), of those resident on their device (`resident`; an offloaded layer streams whole)."""
    if not cfg.n_experts:
        return []
    return [i for i in range(min(n, cfg.n_layers)) if f"layers.{i}" in dmap and resident(dmap[f"layers.{i}"])]
