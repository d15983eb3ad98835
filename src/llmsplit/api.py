"""The Python entry points `llmsplit.train(...)` and `llmsplit.plan(...)` (the packages
`llmsplit.train` and `llmsplit.plan` are callable and call these; llmsplit/__init__.py).

They sit above the layers because they join the trainer (train/api.py, which never imports
the planner) with the planner and the diagnoses: `auto=True` runs the planner's layout, a
finished run records the plan check, and a run stopped for memory comes back as a
TrainingFailed that carries the planner's explanation; `plan` measures this machine's CPU
(diagnose.probe) for the pure planner.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .config import Config, load_config
from .launch.elastic import node_range
from .train.api import TrainJob, TrainResult, TrainingFailed, Workers, check_job, prepare_job, run_job

__all__ = ["TrainResult", "TrainingFailed", "plan", "train"]

OOM_HINT = "apply one of the changes above with --set (or raise memory.limit_bytes)"


def train(config: str | Path | Config | None = None, nproc: int | None = None, run_dir: str | Path | None = None,
          resume: str = "none", *, overrides=(), auto: bool = False, nnodes: int | str = 1, node_rank: int = 0,
          master_addr: str = "127.0.0.1", master_port: int | None = None, max_restarts: int = 0,
          resume_changed: bool = False, overwrite: bool = False) -> TrainResult:
    """Train as `config` says (a .toml path, a `Config`, or None: the tiny model on the
    built-in corpus) on `nproc` local worker processes, or as one rank inside torchrun.

    overrides: ["train.steps=10", ...] on top of the config (like --set); auto: the planner's
    layout; nnodes, node_rank, master_addr, master_port, max_restarts: as the command line's
    (nnodes "MIN:MAX": an elastic job, as `--nnodes MIN:MAX`).
    `resume`: "none", "auto" (the newest checkpoint in `run_dir`) or a run folder or
    checkpoint; a resume whose tokenizer, data, sequence length, global batch or seed differ
    from the checkpoint's is refused unless `resume_changed` (summary.json then records the
    change). `overwrite` (with `resume="none"`) starts `run_dir` over when it holds a run,
    which is refused otherwise: the old run is moved into `run_dir`/previous/<UTC time>/,
    never truncated. Returns a `TrainResult`: run_dir, summary (summary.json's content),
    final_loss, micro_batch (the one the run trained with), plan_check, per_rank. Raises
    `ConfigError` before any worker starts when the run cannot work (a damaged checkpoint, a
    run folder in use by another run, or holding a run that a fresh start would overwrite),
    `TrainingFailed` (with `hint`, and the measured `out_of_memory` figures and the
    planner's `explanation` when it ran out) when a worker fails.
    """
    min_nodes, nnodes = node_range(nnodes, "nnodes=")
    workers = Workers(nproc, nnodes, node_rank, master_addr, master_port, max_restarts, min_nodes)
    job = prepare_job(config, overrides, run_dir, resume, workers, resume_changed, overwrite)
    if auto:
        _apply_auto(job)
    check_job(job)
    if job.cfg.train.objective == "grpo":
        from .posttrain.entry import prepare_grpo

        prepare_grpo(job)  # its reward functions import, its prompts fit, and its workers run posttrain's trainer
    try:
        result = run_job(job)
    except TrainingFailed as e:
        # Inside torchrun every rank stops; rank 0 explains for all of them.
        if e.out_of_memory is None or (job.torchrun and int(os.environ["RANK"]) != 0):
            raise
        report = _explain_oom(job, e.out_of_memory)
        raise TrainingFailed(report["text"], OOM_HINT, e.out_of_memory, report) from None
    if result.summary is not None and result.run_dir is not None:
        _plan_check(job, result)
    return result


def plan(model, gpus: int, gpu: str = "H100-80GB", emit_config=None, **options) -> dict:
    """Predict memory per device and step time for the layouts of `model` on `gpus` devices.

    `model`: a preset name, a Hugging Face folder or a training config (.toml). Options:
    nodes, seq_len, global_batch, mode ("train"/"infer"), layout ("zero=3,tp=2"), top,
    precision. `emit_config="OUT.toml"` also writes the best layout `llmsplit train` runs.
    Returns the JSON document `llmsplit plan --json` prints.
    """
    from .plan.api import emit_config as _emit, plan_report

    source = load_config(model) if str(model).endswith(".toml") else None
    if source is not None and "tokenizer_vocab" not in options:
        # The embedding grows to cover the config's tokenizer, as in training.
        from .io.tokenizer import load_tokenizer

        options["tokenizer_vocab"] = load_tokenizer(source.data.tokenizer).vocab_size
    if source is not None and source.train.teacher and "train.teacher_params" not in source.explicit:
        # A distillation's teacher, counted by its size as training counts it (train/distill.py).
        from .io.weights import open_weights
        from .models.weight_shapes import model_params

        teacher = model_params(open_weights(source.train.teacher, what="train.teacher").config)
        options["sets"] = (*options.get("sets", ()), f"train.teacher_params={teacher}")
    if isinstance(gpu, str) and gpu.lower() == "cpu" and "cpu_measured" not in options:
        # The planner is pure; this machine's CPU is measured here (once, then cached), with
        # what compiling adds to a worker where the config compiles (train.compile).
        from .diagnose.probe import measure_cpu

        options["cpu_measured"] = measure_cpu(compile=source is not None and source.train.compile)
    if emit_config:
        return _emit(model, gpus, gpu, emit_config, **options)[1]
    return plan_report(model, gpus, gpu, **options)


def _local_device(job: TrainJob):
    from .diagnose.probe import local_device

    return local_device(job.per_node, compile=job.cfg.train.compile)


def _apply_auto(job: TrainJob) -> None:
    """`auto`: the planner's fastest runnable layout for these devices replaces the config's."""
    from .plan.api import auto_config

    device = _local_device(job)
    cfg, best = auto_config(job.cfg, job.model_cfg, job.world, device)
    # On a GPU (or under memory.limit_bytes) the workers confirm the micro-batch by trial.
    cfg.train.confirm_micro_batch = device.kind != "cpu" or cfg.memory.limit_bytes is not None
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"llmsplit: --auto chose {' '.join(best.layout.settings())} for {job.world} × {device.name} "
              f"(predicted {best.memory.total / 2**20:.0f} MiB per device, {best.cost.tokens_per_s:.0f} tokens/s)",
              file=sys.stderr, flush=True)
    job.cfg = cfg


def _explain_oom(job: TrainJob, failure: dict) -> dict:
    """The planner's breakdown of the layout against what the run measured, and the
    changes that fit (`diagnose.oom.explain_oom`)."""
    from .diagnose.oom import explain_oom

    return explain_oom(job.cfg, job.model_cfg, job.world, _local_device(job), failure)


def _plan_check(job: TrainJob, result: TrainResult) -> None:
    """The planner's prediction next to what the run measured, added to summary.json and
    to the result's summary (`result.plan_check` reads it)."""
    from .diagnose.plan_check import check_run

    job.cfg.train.micro_batch = result.micro_batch  # what ran: --auto's trial may have changed it
    check = check_run(result.run_dir, job.cfg, job.model_cfg, job.world, _local_device(job))
    if check is not None:
        result.summary["plan_check"] = check
