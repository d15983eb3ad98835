"""The planner checked against every run: its prediction recorded in summary.json next to
what the run measured, and a warning when they differ by more than 25%.

Measured values are the largest over the ranks, because the planner predicts the fullest
device (with pipeline parallel, the fullest stage).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..config import Config
from ..io.run_dir import SUMMARY_FILE
from ..models.llama import LlamaConfig
from ..plan.api import predict_for_config
from ..plan.hardware import Device
from .oom import seen_bytes

TOLERANCE = 0.25


def compare(summary: dict, prediction: dict, device: Device, offload: str) -> dict:
    """The plan_check entry of summary.json."""
    host = prediction["host_bytes_per_device"]
    # Offloaded model state is still held by the rank (in host memory, which on a CPU is
    # the same memory the peak measures).
    on_host = host if offload == "cpu" else 0
    predicted_state = prediction["model_state_bytes"] + on_host
    predicted_peak = seen_bytes(prediction["memory_per_device"]["total"], device) + \
        (on_host if device.kind == "cpu" else 0)
    ranks = summary["per_rank"]
    measured_state = max(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in ranks)
    measured_peak = max(r["peak_mem_bytes"] for r in ranks)
    check = {"device": prediction["gpu"],
             "predicted_model_state_bytes": int(predicted_state), "measured_model_state_bytes": int(measured_state),
             "ratio_model_state": measured_state / predicted_state if predicted_state else None,
             "predicted_peak_bytes": int(predicted_peak), "measured_peak_bytes": int(measured_peak),
             "ratio_peak": measured_peak / predicted_peak if predicted_peak else None}
    check["warnings"] = [f"measured {what} is {ratio:.2f}× the planner's prediction "
                         f"({check['measured_' + key + '_bytes'] / 2**20:.0f} MiB vs "
                         f"{check['predicted_' + key + '_bytes'] / 2**20:.0f} MiB)"
                         for what, key, ratio in (("model state", "model_state", check["ratio_model_state"]),
                                                  ("peak memory", "peak", check["ratio_peak"]))
                         if ratio is not None and abs(ratio - 1) > TOLERANCE]
    return check


def check_run(run_dir: str | Path, cfg: Config, model_cfg: LlamaConfig, world: int, device: Device) -> dict | None:
    """Add "plan_check" to RUN_DIR/summary.json; None when the run wrote no summary."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    if summary.get("world_size", world) != world:  # an elastic job that ended on fewer or more machines
        cfg, world = copy.deepcopy(cfg), summary["world_size"]
        cfg.parallel.dp = -1  # layout_of derives it from the world the job ended on, as its workers did
    prediction = predict_for_config(cfg, model_cfg, world, device)
    summary["plan_check"] = check = compare(summary, prediction, device, cfg.memory.offload)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)  # a reader never sees half a summary
    return check
