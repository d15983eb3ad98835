"""The training loop, run by every worker process.

The logged loss is the mean token loss over the whole global batch: each data-parallel
rank averages over its own tokens (every sequence has the same length), the data-parallel
reduction averages the ranks, so the number is the same for every layout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from collections import deque
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import loss_parallel

from ..config import Config, config_from_toml, model_config, to_toml
from ..data.corpus import load_tokens
from ..data.loader import BatchSampler
from ..io.run_dir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, checkpoint_dir, newest_checkpoint, resolve_checkpoint
from ..io.hf import HFWeights
from ..io.tokenizer import load_tokenizer
from ..parallel.apply import build_optimizer, build_parallel_model, close_optimizer
from ..parallel.data_parallel import allreduce_gradients, autocast_dtype, no_grad_sync
from ..layout import ACTION_COSTS, bubble_fraction, schedule_bubble
from ..parallel.pipeline import build_schedule, schedule_order
from ..parallel.mesh import Mesh, ParallelDims
from .entry import default_run_dir
from .checkpoint import load_checkpoint, save_checkpoint
from .hangs import HangReporter
from .init_from import load_pretrained
from .batch_trial import confirm_micro_batch, memory_limit, moment_bytes
from .limits import MemoryLimitExceeded, check_memory_limit, from_device_oom
from .metrics import peak_memory_bytes, rank_peaks, reset_peak_memory, state_bytes
from .profile import StepProfiler, report as profile_report
from .progress import Progress, print_summary


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate for optimizer step `step` (1-based): linear warmup, then the schedule
    down to lr × min_lr_ratio. A pure function of the step, so resuming needs only the step."""
    t = cfg.train
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = t.lr * t.min_lr_ratio
    if t.lr_schedule == "linear":
        return t.lr - (t.lr - floor) * progress
    return floor + 0.5 * (t.lr - floor) * (1 + math.cos(math.pi * progress))


def _setup_process_group(timeout_s: float) -> torch.device:
    timeout = timedelta(seconds=timeout_s)
    # The elastic agent keeps one store for the whole job (the static rendezvous reuses
    # it after a restart), so a restarted worker could read an address its dead
    # predecessor published and fail to connect. Keys are kept apart per attempt.
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(f"llmsplit/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    group = {"store": store, "rank": rank, "world_size": world, "timeout": timeout}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **group)
    threads = int(os.environ.get("LLMSPLIT_THREADS", "0")) or max(
        1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(threads)
    return device


def _agree_on_run_dir(cfg: Config, run_dir: str | None) -> Path:
    """Rank 0 picks the run folder (a timestamp differs between machines) and tells the others."""
    choice = [str(run_dir or default_run_dir(cfg.model.preset))]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def train_worker(config_text: str, run_dir: str | None, resume: str = "none") -> dict | None:
    """The work of one worker process (started through `train.entry.run_worker`)."""
    cfg = config_from_toml(config_text)
    device = _setup_process_group(cfg.train.timeout_s)
    hangs = HangReporter(cfg.train.timeout_s)
    try:
        return _train(cfg, run_dir, resume, device, hangs)
    except torch.OutOfMemoryError:
        raise from_device_oom(cfg.memory.limit_bytes, device, hangs.where) from None
    except RuntimeError as e:
        explained = hangs.explain(e)
        if explained is None:
            raise
        raise explained from None
    finally:
        dist.destroy_process_group()


def _train(cfg: Config, run_dir_arg: str | None, resume: str, device: torch.device,
           hangs: HangReporter) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rank0 = rank == 0
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_dir = _agree_on_run_dir(cfg, run_dir_arg)
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / CONFIG_FILE).write_text(to_toml(cfg))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    model_cfg = model_config(cfg, tokenizer.vocab_size)
    mesh = Mesh(ParallelDims.from_config(cfg.parallel), device.type)
    dp_rank, dp_size = mesh.rank("dp"), mesh.size("dp")

    pm = build_parallel_model(model_cfg, cfg, mesh, device)
    if cfg.model.hf:
        load_pretrained(pm.model, HFWeights(cfg.model.hf))
    model, plain = pm.module, pm.model
    optimizer = build_optimizer(plain, cfg, mesh)
    sampler = BatchSampler(load_tokens(cfg.data.source, tokenizer), cfg.data.seq_len,
                           cfg.train.global_batch, cfg.train.seed)
    ck_dir = checkpoint_dir(cfg, run_dir)

    start_step = 0
    resume_from = _resume_source(resume, run_dir, ck_dir, rank0)
    if resume_from is not None:
        hangs.where = f"loading {resume_from}"
        state = load_checkpoint(resume_from, plain, optimizer)
        start_step = state["step"]
        if rank0:
            print(f"resumed from {resume_from} at step {start_step}", file=sys.stderr, flush=True)
    if rank0:
        _trim_metrics(run_dir / METRICS_FILE, start_step)

    t = cfg.train
    per_rank = t.global_batch // dp_size
    tokens_per_step = t.global_batch * cfg.data.seq_len
    denominator = per_rank * cfg.data.seq_len  # tokens of this data-parallel rank's batch
    amp_dtype = autocast_dtype(cfg.parallel.zero, t.precision)
    # With FSDP the gradients are DTensor shards; DTensor max-reduces the scaler's
    # found-inf flag over the shards, so every rank skips an overflowing step together.
    scaler = torch.amp.GradScaler(device.type) if t.precision == "fp16" else None
    sharded_loss = cfg.parallel.tp > 1  # logits stay split over the vocabulary
    pipe = _Pipeline(pm, cfg, device, mesh, denominator, scaler) if pm.pipeline is not None else None
    # A pipeline on CPU keeps its gradient tensors between steps (zeroed in place). Freed, they
    # go back to the OS (each is one mapping above the 4 MiB mmap threshold) and the next
    # step's first backward of every stage page-faults them in again: ~90 ms per 190 MB on a
    # 2-core VM, on the pipeline's critical path while the other stages wait (gpipe m=8 on
    # the 101M model: bubble 0.160 -> 0.128, theory 0.111). The peak hardly moves (+20 MiB
    # there), since gradients exist from the first backward to the optimizer step anyway.
    # CUDA's caching allocator keeps freed memory, so there the default (free them) costs nothing.
    keep_grads = pipe is not None and device.type == "cpu"
    progress = Progress(t.steps, start_step) if rank0 else None
    metrics_file = open(run_dir / METRICS_FILE, "a") if rank0 else None
    history, held = [], None
    first_loss = None

    def forward_backward(batch: torch.Tensor, micro_batch: int) -> torch.Tensor:
        """One step's forward and backward over the rank's batch in micro-batches."""
        n_micro = per_rank // micro_batch
        loss_sum = torch.zeros((), device=device)
        for i in range(n_micro):
            mb = batch[i * micro_batch:(i + 1) * micro_batch]
            inputs, targets = mb[:, :-1], mb[:, 1:]
            # Gradients are averaged across ranks only on the last micro-batch.
            sync = no_grad_sync(model) if i < n_micro - 1 else nullcontext()
            amp = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
            with sync, _loss_context(sharded_loss):
                with amp:
                    logits = model(inputs)
                loss = token_loss(logits, targets, denominator)
                (scaler.scale(loss) if scaler else loss).backward()
            loss_sum += _plain(loss.detach())
        return loss_sum

    micro_batch = t.micro_batch
    if t.confirm_micro_batch and pipe is None and start_step == 0:
        hangs.where = "the --auto micro-batch trial"
        micro_batch = _confirm_micro_batch(cfg, device, per_rank, plain, optimizer, sampler, dp_rank, dp_size,
                                           forward_backward)
        if rank0:  # a resume, and the plan check, read the micro-batch the run really used
            (run_dir / CONFIG_FILE).write_text(to_toml(cfg))
    profiler = StepProfiler(t.profile_steps, start_step, t.steps, run_dir, rank)
    reset_peak_memory(device)
    for step in range(start_step + 1, t.steps + 1):
        hangs.where = f"step {step}"
        profiler.begin(step)
        _maybe_inject_fault(rank, step)
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.rank_batch(step - 1, dp_rank, dp_size).to(device)
        loss_sum = pipe.step(batch, amp_dtype) if pipe is not None else forward_backward(batch, micro_batch)
        if pm.manual_grad_group is not None:
            allreduce_gradients(plain.parameters(), pm.manual_grad_group)
        if scaler:
            scaler.unscale_(optimizer)
        grad_norm = clip_gradients(plain.parameters(), t.grad_clip, mesh.group("pp") if pipe else None)
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if step == t.steps:
            held = state_bytes(plain, optimizer)  # while gradients still exist
        _zero_gradients(optimizer, keep_grads)

        if pipe is not None:  # only the last stage saw the loss
            dist.all_reduce(loss_sum, group=mesh.group("pp"))
        dist.all_reduce(loss_sum, group=mesh.group("dp"))
        loss_value = loss_sum.item() / dp_size
        step_time = time.perf_counter() - t0
        profiler.end(step)
        peaks = rank_peaks(device)  # one collective serves the metric and the limit check
        check_memory_limit(cfg.memory.limit_bytes, peaks, step)
        record = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                  "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
                  "peak_mem_bytes": max(peaks)}
        history.append(record)
        first_loss = first_loss if first_loss is not None else loss_value
        if rank0 and (step % t.log_every == 0 or step == t.steps):
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
        if rank0:
            progress.update(record)
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != t.steps:
            hangs.where = f"saving the checkpoint of step {step}"
            save_checkpoint(ck_dir, step, plain, optimizer, _train_state(step, cfg, sampler), cfg.checkpoint.keep)

    hangs.where = "the end of the run (final checkpoint, summary)"
    if start_step < t.steps:
        save_checkpoint(ck_dir, t.steps, plain, optimizer, _train_state(t.steps, cfg, sampler), cfg.checkpoint.keep)
    if held is None:
        held = state_bytes(plain, optimizer)
    close_optimizer(optimizer)
    per_rank_info = {"rank": rank, "peak_mem_bytes": peak_memory_bytes(device), **held}
    if pipe is not None:
        per_rank_info["pipeline_steps"] = list(pipe.per_step)
    profile_rows = profiler.finish()
    gathered = [None] * world
    dist.all_gather_object(gathered, per_rank_info)
    if not rank0:
        return None
    progress.close()
    metrics_file.close()
    summary = _summary(cfg, world, model_cfg, history, gathered, run_dir)
    if pipe is not None:
        summary["pipeline"] = pipe.report(gathered)
        for row in summary["per_rank"]:
            row.pop("pipeline_steps", None)  # lists per step and per action: summarised in summary["pipeline"]
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    print_summary(summary, run_dir, first_loss)
    if profile_rows is not None:
        profile_report(profile_rows, summary, run_dir)
    return summary


def _confirm_micro_batch(cfg: Config, device: torch.device, per_rank: int, plain, optimizer, sampler, dp_rank: int,
                         dp_size: int, forward_backward) -> int:
    """`--auto`'s trial (train/batch_trial.py) on the first step's batch; the run then trains
    with the micro-batch found, and the summary's config says which."""
    limit = memory_limit(cfg.memory.limit_bytes, device)
    if limit is None:
        return cfg.train.micro_batch
    batch = sampler.rank_batch(0, dp_rank, dp_size).to(device)
    moments = 0 if cfg.memory.offload != "none" else moment_bytes(plain.parameters())
    chosen = confirm_micro_batch(cfg.train.micro_batch, per_rank, limit, device, moments,
                                 lambda mb: forward_backward(batch, mb),
                                 lambda: optimizer.zero_grad(set_to_none=True))
    if chosen is None:
        raise MemoryLimitExceeded(dist.get_rank(), peak_memory_bytes(device), limit,
                                  "memory.limit_bytes" if cfg.memory.limit_bytes is not None else "device memory",
                                  "the --auto micro-batch trial (micro_batch=1)")
    cfg.train.micro_batch = chosen
    return chosen


def _resume_source(resume: str, run_dir: Path, ck_dir: Path, rank0: bool) -> Path | None:
    """The checkpoint to start from, chosen by rank 0 so that every rank loads the same one."""
    # A worker restarted by the elastic launcher after a crash resumes where it can.
    if resume == "none" and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"
    if resume == "none":
        return None
    choice = [None]
    if rank0 and resume == "auto":
        newest, skipped = newest_checkpoint(ck_dir)
        for path, why in skipped:
            print(f"llmsplit: warning: skipping checkpoint {path}: {why}", file=sys.stderr, flush=True)
        if newest is None:
            print(f"llmsplit: no checkpoint to resume from in {ck_dir}; starting at step 0", file=sys.stderr, flush=True)
        choice = [newest and str(newest)]
    elif rank0:
        choice = [str(resolve_checkpoint(resume)[1])]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def _trim_metrics(path: Path, last_step: int) -> None:
    """On resume, drop logged steps after the checkpoint so the file reads as one run."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    shutil.move(tmp, path)


def _train_state(step: int, cfg: Config, sampler: BatchSampler) -> dict:
    return {"step": step, "lr": lr_at(step, cfg), "data": sampler.state_dict(next_step=step),
            "layout": {"world_size": dist.get_world_size(), "dp": cfg.parallel.dp, "zero": cfg.parallel.zero,
                       "tp": cfg.parallel.tp, "pp": cfg.parallel.pp}}


def _summary(cfg: Config, world: int, model_cfg, history: list[dict], per_rank: list[dict], run_dir: Path) -> dict:
    par, mem = cfg.parallel, cfg.memory
    timed = history[1:] or history  # the first step pays for warm-up
    total_time = sum(r["step_time_s"] for r in timed)
    tokens = len(timed) * cfg.train.global_batch * cfg.data.seq_len
    final_loss = history[-1]["loss"] if history else _last_logged_loss(run_dir)
    return {
        "world_size": world,
        "layout": {"dp": par.dp, "dp_replicate": par.dp_replicate, "zero": par.zero, "tp": par.tp, "pp": par.pp,
                   "pp_schedule": par.pp_schedule, "activation_checkpoint": mem.activation_checkpoint,
                   "offload": mem.offload},
        "steps": cfg.train.steps,
        "final_loss": final_loss,
        "tokens_per_s": tokens / total_time if total_time > 0 else 0.0,
        "params": model_cfg.num_params(),
        "precision": cfg.train.precision,
        "per_rank": sorted(per_rank, key=lambda r: r["rank"]),
    }


def _last_logged_loss(run_dir: Path) -> float | None:
    path = run_dir / METRICS_FILE
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return json.loads(lines[-1])["loss"] if lines else None


def _maybe_inject_fault(rank: int, step: int) -> None:
    """`LLMSPLIT_FAULT=RANK:STEP[:kill|hang]` makes that rank raise (die by SIGKILL, or
    stop answering) at that step of the first attempt: how the tests check failure
    reports, crash restarts and hang reports without waiting for a real failure."""
    spec = os.environ.get("LLMSPLIT_FAULT", "")
    parts = spec.split(":")
    if len(parts) < 2 or parts[:2] != [str(rank), str(step)]:
        return
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    if parts[2:] == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if parts[2:] == ["hang"]:
        time.sleep(24 * 3600)  # until the launcher stops this worker after the others time out
    raise RuntimeError(f"fault injected by LLMSPLIT_FAULT={spec}")


def token_loss(logits: torch.Tensor, targets: torch.Tensor, denominator: int) -> torch.Tensor:
    """Cross-entropy summed over the tokens, divided by the tokens of the rank's whole
    batch: micro-batch gradients then add up to the batch mean, and the data-parallel
    average of those is the global mean. fp32 over the vocabulary whatever the compute dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1), reduction="sum") / denominator


def _loss_context(sharded: bool):
    # With tensor parallel the logits are split over the vocabulary; loss_parallel computes
    # the cross-entropy on the shards (forward and backward must both run inside it).
    return loss_parallel() if sharded else nullcontext()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_gradients(params, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip by the global gradient norm. Under pipeline parallel each rank holds only its
    stages' gradients, so the squared norms are summed over the pipeline group first."""
    params = [p for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    total = _plain(total)
    if pp_group is not None:
        total = total.pow(2)
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _zero_gradients(optimizer, keep: bool) -> None:
    """Free the gradients, or with `keep` zero the plain-tensor ones in place (DTensor
    gradients, e.g. the Partial ones of sequence-parallel norms, are freed all the same:
    their sharding cannot be zeroed in place)."""
    if not keep:
        optimizer.zero_grad(set_to_none=True)
        return
    plain = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if type(p.grad) is torch.Tensor:
                plain.append(p.grad)
            else:
                p.grad = None
    if plain:
        torch._foreach_zero_(plain)


class _Pipeline:
    """One optimizer step of a pipeline schedule over this rank's batch, with the time
    each local stage is busy (forward and backward compute) recorded for the bubble."""

    def __init__(self, pm, cfg: Config, device: torch.device, mesh: Mesh, denominator: int, scaler):
        par, t = cfg.parallel, cfg.train
        self.parts = pm.pipeline
        self.model = pm.model
        self.cfg = cfg
        self.device = device
        self.scaler = scaler
        self.sharded_loss = par.tp > 1
        self.n_micro = par.pp_microbatches or t.global_batch // (mesh.size("dp") * t.micro_batch)
        scale = scaler.scale if scaler else (lambda x: x)
        loss_fn = lambda out, target: scale(token_loss(out, target, denominator))  # noqa: E731
        self.schedule = build_schedule(self.parts, par.pp_schedule, self.n_micro, loss_fn, device, mesh.group("pp"))
        # Each step after the first (which pays for shape inference and warm-up): (step
        # seconds, {(stage, kind, micro-batch): seconds of that compute action}); the rank's
        # busy time is their sum. The latest ones only; they feed the bubble's medians.
        self.per_step: deque[tuple[float, dict]] = deque(maxlen=200)
        self.steps = 0
        self._step_actions: dict[tuple[int, str, int], float] = {}
        for stage in _schedule_stages(self.schedule):
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(name, stage.stage_index, getattr(stage, name)))

    def _timed(self, name: str, stage: int, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                kind = ("F" if name == "forward_one_chunk" else "W" if name == "backward_weight_one_chunk"
                        else "B" if kwargs.get("full_backward", True) else "I")
                # torch passes the micro-batch (chunk) index first, positionally or by name
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", -1))
                self._step_actions[(stage, kind, mb)] = elapsed
        return wrapper

    def step(self, batch: torch.Tensor, amp_dtype) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.parts.has_last_stage else {}
        args = (inputs,) if self.parts.has_first_stage else ()
        amp = torch.autocast(self.device.type, dtype=amp_dtype) if amp_dtype else nullcontext()
        self._step_actions = {}
        t0 = time.perf_counter()
        with _loss_context(self.sharded_loss), amp:
            self.schedule.step(*args, return_outputs=False, **kwargs)
        elapsed = time.perf_counter() - t0
        self.steps += 1
        if self.steps > 1:
            self.per_step.append((elapsed, self._step_actions))
        loss_sum = torch.zeros((), device=self.device)
        for loss in losses:
            loss_sum += _plain(loss.detach())
        if self.scaler is not None:
            loss_sum /= self.scaler.get_scale()
        return loss_sum

    def report(self, per_rank: list[dict]) -> dict:
        """The bubble of each step: every rank's busy time against the longest rank's step
        time, then the median over the steps. A rank's own schedule.step() returns as soon
        as its last chunk is done, before the others' (the first stage runs the last
        backward); its wait for them happens in the next collective, outside its timer, and
        is idle time all the same. Measured on its own timer, gpipe at m=2 showed a bubble of
        0.25 against the 1/3 that the time line of its chunks gives. The median, not the
        total, because one stall of a shared machine on one rank (seen: a 1 s forward among
        0.22 s ones) idles every other rank for that step and is not the schedule's doing.

        The theory is the schedule's own time line (`schedule_bubble`): the order of compute
        actions the schedule runs, with no communication, each action taking the time it took
        in that step; its median over the steps, like the measurement. What the measurement
        adds over it is the pipeline runtime's own cost: sends and receives, the Python
        between actions, stalls between them. Replaying each step's own durations, and not
        one typical duration per action, matters where the theory is small: an action that
        runs long on one rank idles the ranks waiting for it, and that idle time is the
        schedule's (its dependencies), not the runtime's. On the 101M benchmark model, zbv at
        m=8 gave 0.030 this way against 0.028 from median durations (BENCHMARKS.md).

        `median_cost_bubble` is the same time line with each action's median duration over
        the run (`action_seconds`). The schedule's bubble depends on what its actions cost:
        the zero-bubble schedules hide weight-gradient (W) passes in it, so how long those
        take against a forward decides what is left (the ZB paper computes its bubbles from
        profiled T_F, T_B, T_W too), and the first stage's input-gradient pass is empty (its
        input is token ids), which moves all its backward work into W. The textbook formula
        (p−1)/(v·m+p−1), which assumes equal stages and costs, and the order's figure with
        unit costs (F = I = W = 1, B = 2) sit next to it."""
        par = self.cfg.parallel
        order = schedule_order(self.schedule)
        unit = schedule_bubble(*order)
        rows = [r["pipeline_steps"] for r in per_rank if r.get("pipeline_steps")]
        per_rank_busy, measured, theory = [], [], []
        times: dict[tuple[int, str], list[float]] = {}
        for steps in zip(*rows):  # one (step seconds, action seconds) per rank
            longest = max(step for step, _ in steps)
            if longest <= 0:
                continue
            per_rank_busy.append([sum(rank_actions.values()) / longest for _, rank_actions in steps])
            measured.append(1.0 - sum(per_rank_busy[-1]) / len(steps))
            # With data parallel, each pipeline replica ran the same actions: their mean.
            replicas: dict[tuple[int, str, int], list[float]] = {}
            for _, rank_actions in steps:
                for key, seconds in rank_actions.items():
                    replicas.setdefault(key, []).append(seconds)
            actions = {key: statistics.fmean(v) for key, v in replicas.items()}
            theory.append(schedule_bubble(*order, costs={**ACTION_COSTS, **actions}))
            for (stage, kind, _), seconds in actions.items():
                times.setdefault((stage, kind), []).append(seconds)
        costs = {key: statistics.median(v) for key, v in times.items()}
        typical = schedule_bubble(*order, costs={**ACTION_COSTS, **costs}) if costs else unit
        return {"schedule": par.pp_schedule, "stages": self.parts.n_stages, "microbatches": self.n_micro,
                "theoretical_bubble": statistics.median(theory) if theory else typical,
                "theoretical_bubble_per_step": theory, "median_cost_bubble": typical,
                "unit_cost_bubble": unit,
                "formula_bubble": bubble_fraction(par.pp_schedule, par.pp, self.n_micro, par.pp_virtual_stages),
                "action_seconds": {f"{stage}:{kind}": v for (stage, kind), v in sorted(costs.items())},
                "measured_bubble": statistics.median(measured) if measured else None,
                "measured_bubble_per_step": measured,
                "busy_fraction_per_rank": [statistics.median(col) for col in zip(*per_rank_busy)]}


def _schedule_stages(schedule) -> list:
    return list(getattr(schedule, "_stages", None) or [schedule._stage])
