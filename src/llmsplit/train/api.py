"""The train layer's part of `llmsplit.train` (llmsplit/api.py adds the planner's parts: --auto,
the plan check, the OOM explanation): a job from a config, refused in one sentence before
any worker starts when it cannot run, then run on local workers or inside torchrun, with
what the workers return, or the figures of the one that failed, handed back as data."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config, load_config, model_config, record_model_sizes, to_toml, validate
from ..errors import ConfigError
from ..launch import LaunchError, Nodes, default_nproc, launch, under_torchrun
from ..launch.elastic import check_node_rank, hosts_rendezvous
from ..models.llama import LlamaConfig


# What a training worker imports before its first step ends: its entry, the trainer, torch._dynamo
# (torch.optim imports it, with triton, at the first step: 0.8 s and ~60 MiB of peak in every worker
# importing it alone). Imported once, in the workers' server, shared by all (launch/forkserver.py).
WORKER_MODULES = ("llmsplit.train.entry", "llmsplit.train.trainer", "torch._dynamo")

@dataclass
class Workers:
    """Where the workers run: `nproc` on this machine (default: one per GPU, 2 on a CPU) ×
    `nnodes` machines (min_nodes to nnodes: an elastic job, launch/elastic.py); torchrun's
    environment, when present, decides instead."""
    nproc: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    min_nodes: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    def holds_run_folder(self) -> bool:  # node 0 locks the run folder; in an elastic job, the one at --master-addr
        return hosts_rendezvous(self.master_addr) if self.elastic else self.node_rank == 0


@dataclass
class TrainJob:
    cfg: Config
    model_cfg: LlamaConfig
    tokenizer_vocab: int
    world: int
    per_node: int  # workers on this machine
    run_dir: Path | None
    resume: str
    resume_from: Path | None  # the checkpoint named, or (after check_job) the newest one for "auto"
    workers: Workers
    torchrun: bool
    resume_changed: bool = False  # --resume-changed: the inputs may differ from the checkpoint's
    resume_changes: dict = field(default_factory=dict)  # what differs (resume_check.resume_changes), for the summary
    overwrite: bool = False  # --overwrite: the run that --run-dir holds is moved aside and the folder started over
    # The workers' entry point and first imports: train.entry.run_worker (None), or a room above (posttrain/entry.py)
    entry: object = None
    preload: tuple[str, ...] = WORKER_MODULES


@dataclass
class TrainResult:
    """What `llmsplit.train` returns. `summary` is summary.json's content, held by the
    process that ran rank 0 (elsewhere None, and so are the fields read from it);
    `micro_batch` is the one the run trained with (--auto's trial may have changed it)."""
    run_dir: Path | None
    summary: dict | None

    # Read from the summary, so that the result and summary.json can never disagree.
    @property
    def final_loss(self) -> float | None:
        return self.summary["final_loss"] if self.summary else None

    @property
    def micro_batch(self) -> int | None:
        return self.summary["micro_batch"] if self.summary else None

    @property
    def per_rank(self) -> list[dict]:
        return self.summary["per_rank"] if self.summary else []

    @property
    def plan_check(self) -> dict | None:
        return self.summary.get("plan_check") if self.summary else None


class TrainingFailed(RuntimeError):
    """A worker failed. `hint` says what to try; `out_of_memory` holds the measured figures
    ({"rank", "peak_bytes", "limit_bytes", "source", "where"}) when the run stopped for
    memory, and `explanation` the planner's account of it (`diagnose.oom.explain_oom`)."""

    def __init__(self, message: str, hint: str | None = None, out_of_memory: dict | None = None,
                 explanation: dict | None = None):
        super().__init__(message)
        self.hint = hint
        self.out_of_memory = out_of_memory
        self.explanation = explanation


def prepare_job(config: str | Path | Config | None, overrides, run_dir: str | Path | None, resume: str,
                workers: Workers, resume_changed: bool = False, overwrite: bool = False) -> TrainJob:
    """The config loaded and the model sized; `check_job` follows once the layout is final."""
    from ..data.corpus import check_source
    from ..data.datasets import check_preference_source
    from ..io.run_dir import CONFIG_FILE, absolute_paths
    from ..io.tokenizer import load_tokenizer
    from .distill import check_teacher as _check_teacher
    from .finetune import apply_finetune_defaults, use_pretrained_sizes

    torchrun = under_torchrun()
    run_dir = Path(run_dir) if run_dir else None
    resume_from = _check_arguments(workers, run_dir, resume, torchrun, overwrite)
    overrides = list(overrides)
    if config is None and resume != "none" and run_dir is not None and (run_dir / CONFIG_FILE).is_file():
        # Continue a run with its own config; the data-parallel degree follows the new
        # world size (checkpoints load under any layout) unless an override says otherwise.
        config, overrides = run_dir / CONFIG_FILE, ["parallel.dp=-1", *overrides]
    if isinstance(config, Config):  # a copy: the caller's object stays as it was
        import tomllib

        from ..config import config_from_dict

        cfg = config_from_dict(tomllib.loads(to_toml(config)), overrides)
        cfg.explicit = config.explicit | {o.partition("=")[0].strip() for o in overrides}  # not every key copied
    else:
        cfg = load_config(config, overrides)
    absolute_paths(cfg)  # config.toml then names the same files from any directory
    if cfg.model.hf or cfg.model.gguf:
        use_pretrained_sizes(cfg)
        apply_finetune_defaults(cfg, warn=not torchrun or os.environ.get("RANK", "0") == "0")
    nproc = workers.nproc or default_nproc()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else nproc * workers.nnodes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if torchrun else nproc
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    vocab = tokenizer.vocab_size
    check_source(cfg.data.source, tokenizer)  # a token file made with another tokenizer: refused here, exit 2
    if cfg.train.objective == "dpo":
        check_preference_source(cfg.data)
    model_cfg = model_config(cfg, vocab)
    if cfg.train.teacher:  # its tokenizer and vocabulary checked, its size recorded for the planner
        cfg.train.teacher_params = _check_teacher(cfg.train.teacher, tokenizer, model_cfg.vocab_size)
    return TrainJob(cfg, model_cfg, vocab, world, per_node, run_dir, resume, resume_from, workers,
                    torchrun, resume_changed, overwrite=overwrite)


def _check_arguments(workers: Workers, run_dir: Path | None, resume: str, torchrun: bool,
                     overwrite: bool = False) -> Path | None:
    """Refuse arguments that cannot work; returns the checkpoint that `resume` names, if any."""
    from ..io.run_dir import CONFIG_FILE, PREVIOUS_DIR, finished_steps, resolve_checkpoint
    from .run_lock import check_free

    w = workers
    if w.nproc is not None and w.nproc < 1:
        raise ConfigError(f"--nproc {w.nproc} must be at least 1")
    Nodes(w.nnodes, w.node_rank, w.master_addr, w.master_port).check(resolve=not torchrun)
    if w.max_restarts < 0:
        raise ConfigError(f"--max-restarts {w.max_restarts} must be 0 or more")
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {str(run_dir)!r} is a file; pass a folder")
    # The process that will hold the folder's lock (run_job): rank 0 inside torchrun, else node 0
    # (Workers.holds_run_folder); the other nodes must not look for a free lock node 0 holds.
    if w.elastic:
        check_node_rank(w.node_rank, w.min_nodes, w.nnodes)
    rank0 = int(os.environ["RANK"]) == 0 if torchrun else w.holds_run_folder()
    if run_dir is not None and rank0:
        check_free(run_dir)  # a run in progress is named before anything else is said about its folder
    if resume == "auto" and run_dir is None:
        raise ConfigError("--resume auto needs --run-dir (the run to continue)")
    if overwrite and run_dir is None:
        raise ConfigError("--overwrite needs --run-dir (the folder to start over)")
    if overwrite and resume != "none":
        raise ConfigError(f"--overwrite starts --run-dir over from step 0 and cannot go with --resume {resume}; "
                          f"pass --resume none --overwrite, or drop --overwrite")
    # A damaged or missing checkpoint is refused here, before any worker starts.
    resume_from = resolve_checkpoint(resume)[1] if resume not in ("auto", "none") else None
    if run_dir is not None and resume == "none":
        # Whether or not config.toml is there: a new run would truncate metrics.jsonl.
        held = finished_steps(run_dir)
        if held and not overwrite:
            raise ConfigError(f"--run-dir {str(run_dir)!r} already holds a run; pass --resume auto to continue it, "
                              f"--overwrite to start it over (the old run is moved into "
                              f"{str(run_dir / PREVIOUS_DIR)!r}), or another --run-dir")
        if rank0 and not held and (run_dir / CONFIG_FILE).is_file():
            print(f"llmsplit: --run-dir {run_dir} holds a run that never finished a step; starting it again",
                  file=sys.stderr, flush=True)
    return resume_from


def check_moe_training(job: TrainJob) -> None:
    """The mixture-of-experts training keys: the load-balancing loss and the loss-free bias."""
    t = job.cfg.train
    if t.moe_aux_loss and job.cfg.parallel.pp > 1:
        raise ConfigError("train.moe_aux_loss with parallel.pp > 1 is not available yet (the pipeline's loss sees "
                          "only its last stage); set train.moe_aux_loss=0 or parallel.pp=1")
    if t.moe_bias_rate < 0:
        raise ConfigError(f"train.moe_bias_rate={t.moe_bias_rate} must be at least 0")
    if t.moe_bias_rate:
        if not job.model_cfg.n_experts:
            raise ConfigError(f"train.moe_bias_rate={t.moe_bias_rate} balances mixture-of-experts layers and this "
                              f"model has none (model.n_experts=0); set train.moe_bias_rate=0")
        job.model_cfg.router_bias = True  # the bias it moves; config.toml records it with the sizes
    lora, n = job.cfg.lora, job.model_cfg.n_experts
    mlp = [t.strip() for t in lora.targets.split(",") if t.strip() in ("gate", "up", "down")]
    if lora.rank and n and mlp:  # adapters wrap nn.Linear layers; experts are stacked 3-D weights
        raise ConfigError(f"lora.targets={lora.targets!r} adapts {', '.join(mlp)}, and this model's MLPs are "
                          f"mixtures of experts (model.n_experts={n}) without such layers; set "
                          f"lora.targets=\"q,k,v,o\"")


def check_job(job: TrainJob) -> None:
    """Everything that can be refused before a worker starts, on the final layout; fills in
    the derived values (parallel.dp, the model's sizes) that the workers read."""
    from ..io.run_dir import checkpoint_dir, usable_checkpoint

    check_moe_training(job)
    if job.workers.elastic and not job.torchrun:
        from .membership import check_every_membership

        check_every_membership(job)
    validate(job.cfg, job.world, job.model_cfg, job.tokenizer_vocab)
    if job.cfg.train.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.tensorboard=true writes events with the tensorboard package, which is not installed; "
                          "pip install 'llmsplit[tensorboard]' or remove train.tensorboard")
    record_model_sizes(job.cfg, job.model_cfg)
    if job.cfg.lora.init:
        from ..io.peft_adapter import check_init

        check_init(job.cfg.lora.init, job.cfg.lora)
    # The workers warn about the checkpoints skipped. Where the run folder is another node's (one
    # joining an elastic job under way), its rank 0 reads them: here they may be half written.
    if job.resume == "auto" and (job.torchrun or job.workers.holds_run_folder()):
        job.resume_from = usable_checkpoint(checkpoint_dir(job.cfg, job.run_dir))[0]
        _check_fresh_start(job)
    if job.resume_from is not None:
        from .checkpoint import check_fits

        check_fits(job.resume_from, job.model_cfg, job.cfg.lora.rank)
        _check_resumed_inputs(job)


def _check_fresh_start(job: TrainJob) -> None:
    """`--resume auto` without a checkpoint starts at step 0, which would truncate the
    metrics.jsonl and replace the summary.json of a run that got somewhere: refused, so
    that a lost checkpoints/ folder never costs the run's record too."""
    from ..io.run_dir import PREVIOUS_DIR, checkpoint_dir, holds_record

    # A worker restarted by torchrun after a crash runs this again: the same run goes on.
    if job.resume_from is not None or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if holds_record(job.run_dir):
        raise ConfigError(f"--resume auto: --run-dir {str(job.run_dir)!r} holds a run but no checkpoint in "
                          f"{str(checkpoint_dir(job.cfg, job.run_dir))!r} to continue it from; pass another "
                          f"--run-dir for a new run, or --resume none --overwrite to start this one over (the old run "
                          f"is moved into {str(job.run_dir / PREVIOUS_DIR)!r})")


def _check_resumed_inputs(job: TrainJob) -> None:
    """Refuse a resume whose tokenizer, data, sequence length, global batch or seed differ
    from the checkpoint's, unless `resume_changed`; then say what changed and keep it for
    the summary."""
    import json

    from ..io.run_dir import STATE_FILE
    from .resume_check import RESUME_CHANGED_FLAG, describe, resume_changes

    changes = resume_changes(json.loads((job.resume_from / STATE_FILE).read_text()), job.cfg)
    if changes and not job.resume_changed:
        raise ConfigError(f"checkpoint {str(job.resume_from)!r} was trained on other inputs: {describe(changes)}; "
                          f"resume with the values it had, or pass {RESUME_CHANGED_FLAG} to continue with the new "
                          f"ones (summary.json records the change)")
    if changes and int(os.environ.get("RANK", "0")) == 0:
        print(f"llmsplit: warning: {RESUME_CHANGED_FLAG}: continuing {job.resume_from} with {describe(changes)}",
              file=sys.stderr, flush=True)
    job.resume_changes = changes


def run_job(job: TrainJob) -> TrainResult:
    """Run the checked job: inside torchrun this process is one of the workers; otherwise
    it starts this machine's workers and waits for them. The run folder is locked for the
    whole job by the process that launches it (rank 0 inside torchrun, node 0 otherwise).
    Raises TrainingFailed."""
    from .entry import default_run_dir
    from .run_files import amend_summary
    from .run_lock import holding

    cfg, w = job.cfg, job.workers
    if job.torchrun:
        # Every rank proposes a run folder and rank 0's is taken, so rank 0 knows where it is.
        run_dir = job.run_dir or default_run_dir(cfg.model.preset)
        locks = int(os.environ["RANK"]) == 0
    else:
        run_dir = job.run_dir or (default_run_dir(cfg.model.preset) if w.nnodes == 1 else None)
        locks = run_dir is not None and w.holds_run_folder()
    with holding(run_dir) if locks else contextlib.nullcontext():
        if job.overwrite and locks:
            _start_over(run_dir)
        result = _run_in_torchrun(job, run_dir) if job.torchrun else _run_local(job, run_dir)
    if job.resume_changes and result.summary is not None and result.run_dir is not None:
        result.summary["resumed_with_changes"] = job.resume_changes
        amend_summary(result.run_dir, resumed_with_changes=job.resume_changes)
    return result


def _start_over(run_dir: Path) -> None:
    """--overwrite, by the process that holds the folder's lock and before any worker writes
    there: the run the folder held is moved aside whole (io.run_dir.set_aside)."""
    from ..io.run_dir import set_aside

    # torchrun runs this again in a worker it restarted after a crash: that is the new run.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    moved = set_aside(run_dir)
    if moved is not None:
        print(f"llmsplit: --overwrite: moved the run that {run_dir} held into {moved}; starting it over",
              file=sys.stderr, flush=True)


def _worker_args(job: TrainJob, run_dir: Path | None) -> tuple:
    # A checkpoint named by --resume was resolved (a run folder to its newest checkpoint) and
    # checked before the workers start: they load that one.
    resume = job.resume if job.resume in ("auto", "none") else str(job.resume_from)
    if job.workers.elastic and not job.torchrun:
        from .membership import elastic_config

        return elastic_config(job.cfg), str(run_dir) if run_dir else None, resume
    return to_toml(job.cfg), str(run_dir) if run_dir else None, resume


def _run_in_torchrun(job: TrainJob, run_dir: Path) -> TrainResult:
    from .entry import run_worker
    from .limits import MemoryLimitExceeded

    try:
        summary = (job.entry or run_worker)(*_worker_args(job, run_dir))
    except MemoryLimitExceeded as e:
        raise TrainingFailed(str(e), out_of_memory=e.details) from None
    return TrainResult(run_dir if summary is not None else job.run_dir, summary)


def _run_local(job: TrainJob, run_dir: Path | None) -> TrainResult:
    import tempfile

    from ..io.disk_full import NoSpaceLeft, disk_full
    from .entry import run_worker
    from .limits import MemoryLimitExceeded

    w = job.workers
    nproc = w.nproc or default_nproc()
    print(f"llmsplit: training on {job.world} worker(s) ({nproc} on this machine); run dir "
          f"{run_dir or '(chosen by node 0)'}", file=sys.stderr, flush=True)
    try:
        returned = launch(job.entry or run_worker, _worker_args(job, run_dir), nproc=nproc, nnodes=w.nnodes,
                          node_rank=w.node_rank, master_addr=w.master_addr, master_port=w.master_port,
                          max_restarts=w.max_restarts, timeout_s=job.cfg.train.timeout_s, preload=job.preload,
                          min_nodes=w.min_nodes)
    except Exception as e:
        resume = f"`--resume auto --run-dir {run_dir}` continues from the newest checkpoint"
        # torch records each worker's error in a file under the temporary folder: on a full
        # disk the error is lost ("exit code 1") or torch fails reading it back (EOFError).
        tmp = tempfile.gettempdir()
        lost = f"no space left on device at {tmp}, where torch records the workers' errors"
        if not isinstance(e, LaunchError):
            if not disk_full(e, tmp):
                raise
            raise TrainingFailed(f"the workers failed and {lost}", f"free space there (or set TMPDIR to a disk "
                                 f"with room); then {resume}") from None
        if e.error_type == MemoryLimitExceeded.__name__:
            raise TrainingFailed(str(e), out_of_memory=e.details) from None
        if e.error_type == "RewardFailed":  # GRPO's reward function (posttrain/rewards.py): the user's code
            raise TrainingFailed(str(e), f"fix the function; the checkpoints written stay valid: {resume}") from None
        if e.error_type == "ConfigMismatch":  # machines started with other configs: the message says the fix
            raise TrainingFailed(str(e)) from None
        if e.error_type == NoSpaceLeft.__name__:
            raise TrainingFailed(str(e), f"once the disk of {e.details['path']} has room again, {resume}") from None
        if disk_full(e, tmp):
            raise TrainingFailed(f"{e}; {lost}", f"free space there (or set TMPDIR to a disk with room); "
                                 f"then {resume}") from None
        raise TrainingFailed(str(e), e.hint or f"the worker's traceback is printed above; {resume}") from None
    return TrainResult(run_dir, returned.get(0))  # global rank 0's summary, on node 0
