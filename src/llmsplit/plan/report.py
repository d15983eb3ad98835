"""`llmsplit plan`'s text output: one block per layout, memory term by term."""

from __future__ import annotations

GiB = 1024 ** 3
TERMS = ("params", "grads", "optimizer", "activations", "comm_buffers", "overhead", "total")
SHORT = ("params", "grads", "optim", "acts", "comm", "overhead", "total")


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
    return ",".join(f"{k}={layout[k]}" for k in keys)


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
        lines.append(f"     {layout_text(lay['layout'])}"
                     + (f"  (host {lay['host_bytes_per_device'] / GiB:.1f} GiB)" if lay["host_bytes_per_device"] else ""))
        if lay.get("experts") and lay["layout"].get("ep", 1) > 1:
            e = lay["experts"]
            lines.append(f"     experts per rank {e['expert_params_per_rank'] / 1e6:.1f} M parameters, all-to-all "
                         f"{e['all_to_all_bytes_per_step'] / GiB:.2f} GiB a step, dispatch buffers "
                         f"{e['dispatch_buffer_bytes'] / GiB:.2f} GiB")
        lines.append("     fits" if lay["fits"] else f"     does not fit: {lay['why_not']}")
    if report["advice"]:
        lines += ["", report["advice"]]
    if not report["fitting"]:  # the last line says so, whatever came before (the command exits 1)
        lines += ["", f"no layout of the {report['considered']} considered fits {hw['count']} × {hw['gpu']}"]
    return "\n".join(lines)
