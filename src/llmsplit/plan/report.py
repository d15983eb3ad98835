"""`llmsplit plan`'s text output: one block per layout, memory term by term."""

from __future__ import annotations

GiB = 1024 ** 3
TERMS = ("params", "grads", "optimizer", "activations", "comm_buffers", "overhead", "total")
SHORT = ("params", "grads", "optim", "acts", "comm", "overhead", "total")
# Each column's name explained once, under the table, by what the planner counts (plan/memory.py).
LEGEND = {
    "train": (
        ("params", "weights on the device: its tp/pp share, split over dp by zero 2/3; fp32 (a LoRA base as stored)"),
        ("grads", "gradients of the trained weights, fp32 (with LoRA the adapters' only)"),
        ("optim", "optimizer states: AdamW's two fp32 moments per trained weight, split over dp by zero 1-3"),
        ("acts", "activations: those saved for backward at the peak, with the loss's logits (GRPO: and the "
                 "rollout engine, resident: the whole model in fp32, a reference copy with grpo.beta > 0 "
                 "without LoRA, the KV pool of the rank's completions)"),
        ("comm", "communication buffers: DDP's gradient buckets; zero 2/3's gathered weights and unsharded "
                 "gradients (fp32, the whole stage's while a step has micro-batches to go); tp/pp/ep messages"),
        ("model state", "params + grads + optim"),
    ),
    "infer": (
        ("params", "weights on the device, in the compute dtype or packed by --quantize (model state)"),
        ("grads", "none when generating; optim likewise"),
        ("acts", "activations: the KV cache of every sequence, and the prefill's workspace"),
        ("comm", "communication buffers: the tp/pp messages"),
    ),
}
LEGEND_END = (
    ("overhead", "the CUDA context and NCCL (1 GiB) and 5% allocator slack (on cpu: a worker's baseline and heap, "
                 "and with train.compile what compiling adds to it)"),
    ("total", "their sum, within the memory of one device"),
)
HOST = {"train": "the machine's memory: offload=cpu moves params, grads and optim there (their columns read 0); "
                 "per node = per device × devices on the node",
        "infer": "the machine's memory: inference keeps everything on the devices",
        "cpu": "the machine's memory, which the workers share: a worker's total, and every worker's per node"}


def _gib(n) -> str:
    return f"{n / GiB:7.2f}"


def layout_text(layout: dict) -> str:
    keys = ["dp", "zero", "tp", "pp", "micro_batch", "activation_checkpoint"]
    if layout["dp_replicate"] > 1:
        keys.insert(1, "dp_replicate")
    if layout["pp"] > 1:
        keys.insert(keys.index("pp") + 1, "pp_schedule")
    if layout["offload"] != "none":
        keys.append("offload")
    if layout.get("ep", 1) > 1:
        keys.insert(keys.index("pp") + 1, "ep")
    if layout.get("cp", 1) > 1:
        keys[keys.index("tp"):keys.index("tp")] = ["cp", "cp_mode"]
    return ",".join(f"{k}={layout[k]}" for k in keys)


def host_text(lay: dict, hw: dict) -> str:
    """The layout's share of the host's RAM, per device and per node."""
    node = f"{lay['host_bytes_per_node'] / GiB:.1f} of {hw['host_memory_bytes'] / GiB:.0f} GiB per node"
    if hw["kind"] == "cpu":  # the workers' memory is the host's
        return f"host RAM {lay['memory_per_device']['total'] / GiB:.1f} GiB per worker, {node}"
    if not lay["host_bytes_per_device"]:
        return "host RAM: nothing offloaded, 0 GiB per device and per node"
    return f"host RAM {lay['host_bytes_per_device'] / GiB:.1f} GiB per device, {node}"


def _closing_lines(report: dict) -> list[str]:
    """Under the table: the legend, why the best layouts left out do not fit, the advice, and
    what to run next."""
    hw, mode = report["hardware"], report["workload"]["mode"]
    legend = (*LEGEND[mode], *LEGEND_END, ("host RAM", HOST["cpu" if hw["kind"] == "cpu" else mode]))
    lines = ["", "legend:"] + [f"  {name:<11} {text}" for name, text in legend]
    excluded = report["closest_excluded"]
    if excluded:
        faster = excluded[0]["tokens_per_s"] > report["layouts"][0]["tokens_per_s"]
        lines += ["", "faster layouts left out, closest to fitting first:" if faster else "closest layouts left out:"]
        lines += [f"  {layout_text(lay['layout'])} ({lay['tokens_per_s']:.0f} tok/s): {lay['why_not']}"
                  for lay in excluded]
    if report["advice"]:
        lines += ["", report["advice"]]
    if report["next_step"]:
        steps = report["next_step"]["steps"]
        width = max(len(s["command"]) for s in steps)
        lines += ["", f"next: {report['next_step']['why']}:"]
        lines += [f"  {s['command']:<{width}}  # {s['what']}" for s in steps]
    return lines


def format_report(report: dict) -> str:
    m, hw, w = report["model"], report["hardware"], report["workload"]
    active = f" ({m['active_params'] / 1e9:.2f} B active per token)" if m.get("n_experts") else ""
    lines = [f"model {m['name']}: {m['params'] / 1e9:.2f} B parameters{active}, {m['n_layers']} layers, dim {m['dim']}",
             f"hardware {hw['count']} × {hw['gpu']} ({hw['nodes']} node(s) of {hw['gpus_per_node']}), "
             f"{hw['memory_bytes'] / GiB:.1f} GiB each",
             f"workload {w['mode']}: seq {w['seq_len']}, {'global batch' if w['mode'] == 'train' else 'sequences'} "
             f"{w['global_batch']}, {w['precision']}"
             + (f", weights packed {w['quantize']}" if w.get("quantize", "none") != "none" else "")
             + (f", LoRA rank {w['lora_rank']} on {w['lora_targets']}"
                + (f" over a {w['lora_base']} base" if w.get("lora_base", "none") != "none" else "")
                + " (gradients and optimizer state: the adapters; step time still full training's)"
                if w.get("lora_rank") else ""),
             f"{report['considered']} layout(s) considered, {report['fitting']} fit", ""]
    header = "   # " + " ".join(f"{t:>8}" for t in SHORT) + "   step s    tok/s    MFU"
    lines.append("memory per device in GiB")
    lines.append(header)
    for i, lay in enumerate(report["layouts"], 1):
        mem = lay["memory_per_device"]
        cells = " ".join(f"{_gib(mem[t]):>8}" for t in TERMS)
        lines.append(f"{i:>4} {cells} {lay['step_time_s']:8.3f} {lay['tokens_per_s']:8.0f} {lay['mfu'] * 100:5.1f}%")
        lines.append(f"     {layout_text(lay['layout'])}  ({host_text(lay, hw)})")
        if lay.get("experts") and lay["layout"].get("ep", 1) > 1:
            e = lay["experts"]
            lines.append(f"     experts per rank {e['expert_params_per_rank'] / 1e6:.1f} M parameters, all-to-all "
                         f"{e['all_to_all_bytes_per_step'] / GiB:.2f} GiB a step, dispatch buffers "
                         f"{e['dispatch_buffer_bytes'] / GiB:.2f} GiB")
        lines.append("     fits" if lay["fits"] else f"     does not fit: {lay['why_not']}")
    lines += _closing_lines(report)
    if not report["fitting"]:  # the last line says so, whatever came before (the command exits 1)
        lines += ["", f"no layout of the {report['considered']} considered fits {hw['count']} × {hw['gpu']}"]
    return "\n".join(lines)
