"""The training loop, run by every worker process, in torchtitan's shape: a `Trainer` built
once per worker, whose `forward_backward` runs one step's forward and backward passes,
`train_step` one optimizer step and `train` the loop. What the loop asks of the layout
(no-sync while accumulating, gradient sync, autocast and loss scaling, clipping, the
pipeline step) are methods of the `ParallelModel` that `build_parallel_model` returns.

The logged loss is the mean token loss over the tokens of the whole global batch that carry
loss: each data-parallel rank sums its own and divides by (tokens with loss in the global
batch) / dp, a number every rank reads from the data; the data-parallel reduction averages the
ranks, so the number is the same for every layout, whatever share of the tokens a mask keeps.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from ..adapters.lora import parameter_counts
from ..config import Config, config_from_toml, layout_of, model_config, resolve_world, to_toml, workload_of
from ..data.datasets import build_samplers
from ..data.loader import Batch
from ..io.weights import pretrained_weights
from ..io.run_dir import CONFIG_FILE, checkpoint_dir, write_run_config
from ..io.tokenizer import load_tokenizer
from ..launch import join_job
from ..layout import microbatches, sequence_multiple
from ..parallel.apply import build_optimizer, build_parallel_model, close_optimizer
from ..parallel.context_parallel import shard_rows
from ..parallel.mesh import Mesh, ParallelDims
from ..threads import ThreadTuner
from .batch_trial import confirm_micro_batch, memory_limit, moment_bytes
from .bubble import PipelineTimes, bubble_report
from .checkpoint import load_checkpoint, save_checkpoint
from .evaluate import data_summary, evaluate
from .grad_dump import dump_gradients, loss_divisor, planted_loss
from .hangs import HangReporter
from .init_from import load_adapters, load_pretrained
from .limits import MemoryLimitExceeded, check_memory_limit, from_device_oom
from .membership import check_same_config, record_membership
from .metrics import peak_memory_bytes, rank_peaks, reset_peak_memory, state_bytes
from .moe_stats import ExpertStats
from .objectives import build_objective
from .profile import StepProfiler
from .progress import parameter_line
from .profile import report as profile_report
from .resume_check import run_inputs
from .run_files import (
    MetricsLog,
    agree_on_run_dir,
    resume_source,
    run_summary,
    write_summary,
)
from .saves import Saves


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


def train_worker(config_text: str, run_dir: str | None, resume: str = "none", trainer_class=None) -> dict | None:
    """The work of one worker process (started through `train.entry.run_worker`): rank 0
    returns the run's summary (what summary.json holds), the other ranks None."""
    cfg = config_from_toml(config_text)
    device = join_job(cfg.train.timeout_s)
    check_same_config(config_text)  # machines started with other --set flags: refused on every one
    if cfg.parallel.dp <= 0:  # an elastic job's: the world that met decides (train/membership.py)
        resolve_world(cfg, dist.get_world_size())
    hangs = HangReporter(cfg.train.timeout_s)
    try:
        return (trainer_class or Trainer)(cfg, run_dir, resume, device, hangs).train()
    except torch.OutOfMemoryError:
        raise from_device_oom(cfg.memory.limit_bytes, device, hangs.where) from None
    except RuntimeError as e:
        explained = hangs.explain(e)
        if explained is None:
            raise
        raise explained from None
    finally:
        dist.destroy_process_group()


class Trainer:
    """One worker's run: the model split as the config says, its optimizer, data and run
    folder, from step 0 or a checkpoint."""

    def __init__(self, cfg: Config, run_dir: str | None, resume: str, device: torch.device, hangs: HangReporter):
        self.cfg, self.device, self.hangs = cfg, device, hangs
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rank0 = self.rank == 0
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.run_dir = agree_on_run_dir(cfg, run_dir)
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_run_config(self.run_dir, cfg)  # config.toml and the run's copy of its tokenizer files
        self.tokenizer = tokenizer = load_tokenizer(cfg.data.tokenizer)
        self.model_cfg = model_config(cfg, tokenizer.vocab_size)
        self.counts = None  # the whole model's parameters, counted by rank 0 (summary.json's params, trainable_params)
        if self.rank0:
            self.counts = parameter_counts(self.model_cfg, cfg.lora.rank, cfg.lora.targets, cfg.lora.base)
            print(f"llmsplit: {parameter_line(self.counts, cfg.lora.base)}", file=sys.stderr, flush=True)
        self.mesh = Mesh(ParallelDims.from_config(cfg.parallel), device.type)
        self.dp_rank, self.dp_size = self.mesh.rank("dp"), self.mesh.size("dp")
        weights = pretrained_weights(cfg)
        pretrained = (lambda model, only=None: load_pretrained(model, weights, only)) if weights else None
        self.pm = build_parallel_model(self.model_cfg, cfg, self.mesh, device, load_weights=pretrained)
        if cfg.lora.init:
            load_adapters(self.pm.model, cfg.lora.init, cfg.lora, self.model_cfg)
        self.optimizer = build_optimizer(self.pm.model, cfg, self.mesh)
        self.sampler, self.eval_sampler = self.data_samplers(tokenizer)
        self.objective = build_objective(cfg, device)
        self.ck_dir = checkpoint_dir(cfg, self.run_dir)
        self.saves = Saves(cfg.checkpoint, device, hangs)
        self.inputs = run_inputs(cfg) if self.rank0 else {}  # what a resume must continue with (resume_check.py)
        self.start_step = self._resume(resume)
        record_membership(self.run_dir, self.start_step, self.rank0)  # who left or joined since the last attempt

        t = cfg.train
        self.per_rank = t.global_batch // self.dp_size
        self.denominator = float(self.per_rank * cfg.data.seq_len)  # set per step: this rank's share of the loss tokens
        self.micro_batch = t.micro_batch
        self.pipeline_times = None
        if self.pm.pipeline is not None:
            self.pm.build_schedule(microbatches(layout_of(cfg, self.world), workload_of(cfg)), self.loss)
            self.pipeline_times = PipelineTimes(self.pm.schedule)
        self.log = MetricsLog(self.run_dir, self.start_step, t.steps, t.log_every, t.tensorboard) if self.rank0 else None
        self.held = None  # this rank's parameter, gradient and optimizer bytes, taken at the last step
        self.experts = ExpertStats(self.pm.model, self.model_cfg.n_layers, self.model_cfg.n_experts, device,
                                   cfg.train.moe_bias_rate)
        # On the CPU, a thread count llmsplit chose drops to one while other processes want the
        # cores, where libgomp's spinning barriers would collapse the step (threads.py).
        self.threads = ThreadTuner(uniform=True, allowed=device.type == "cpu")

    def data_samplers(self, tokenizer):
        """(training sampler, evaluation sampler or None) of the run's data."""
        cfg = self.cfg
        return build_samplers(cfg.data, cfg.train.global_batch, cfg.train.seed, tokenizer, cfg.train.objective,
                              self.row_width_multiple())

    def row_width_multiple(self) -> int | None:
        """What the width of rows cut to their batch's longest must divide by: 8 (kernels like
        round shapes) and the layout's sequence rule (`sequence_multiple`); None under pipeline
        parallel, whose schedule keeps the first step's shapes."""
        if self.cfg.parallel.pp > 1:
            return None
        return math.lcm(8, sequence_multiple(layout_of(self.cfg, self.world)))

    def _resume(self, resume: str) -> int:
        """The step to start after: that of the checkpoint loaded, else 0."""
        source = resume_source(resume, self.run_dir, self.ck_dir, self.rank0)
        self.resumed_state = None
        if source is None:
            return 0
        self.hangs.where = f"loading {source}"
        self.resumed_state = load_checkpoint(source, self.pm.model, self.optimizer)
        step = self.resumed_state["step"]
        if self.rank0:
            print(f"resumed from {source} at step {step}", file=sys.stderr, flush=True)
        return step

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return planted_loss(self.objective.loss(logits, targets, self.denominator), self.rank)  # grad_dump.py

    def use_denominator(self, loss_tokens: int) -> None:
        """Divide the losses that follow by this rank's share of `loss_tokens`, the tokens with
        loss in the global batch (a batch without any gives loss 0, not 0/0): one of dp × cp,
        whose gradients and losses the data-parallel reduction averages."""
        self.denominator = max(loss_tokens, 1) / loss_divisor(self.mesh)  # dp × cp: see grad_dump.py

    def local_rows(self, batch: Batch) -> Batch:
        """What this rank computes of its data-parallel rows: all of them, or under context
        parallel its share of each sequence; with what the objective's loss reads beside the
        targets (distillation: the teacher's inputs)."""
        batch = self.objective.carry(batch)
        if self.pm.cp_group is None:
            return batch
        return Batch(*shard_rows(batch.inputs, batch.targets, batch.positions, self.pm.cp_group))

    def forward(self, batch: Batch) -> torch.Tensor:
        """The logits of a (micro-)batch; packed rows restart positions at each document."""
        if batch.positions is None:
            return self.pm.module(batch.inputs)
        return self.pm.module(batch.inputs, positions=batch.positions, doc_ids=batch.doc_ids)

    def pipeline_step(self, batch: Batch, forward_only: bool = False) -> torch.Tensor:
        """`batch` through the pipeline schedule; the sum of the losses this rank saw."""
        with self.objective.pipeline_calls(self.pm.n_microbatches):
            return self.pm.pipeline_step(batch.inputs, batch.targets, batch.positions, forward_only, batch.doc_ids)

    def forward_backward(self, batch: Batch, micro_batch: int | None = None) -> torch.Tensor:
        """One step's forward and backward over this rank's batch, in micro-batches of
        `micro_batch` sequences (default: the run's) or through the pipeline schedule.
        Returns the sum of the losses this rank saw."""
        pm, batch = self.pm, self.local_rows(batch)
        if pm.pipeline is not None:
            with self.pipeline_times.step():
                return self.pipeline_step(batch)
        micro_batch = micro_batch or self.micro_batch
        n_micro = self.per_rank // micro_batch
        rows = len(batch) // n_micro  # a sample is one row, a DPO pair two
        loss_sum = torch.zeros((), device=self.device)
        for i in range(n_micro):
            mb = batch[i * rows:(i + 1) * rows]
            # Gradients are averaged across ranks only on the last micro-batch.
            with pm.micro_batch_context(last=i == n_micro - 1):
                with pm.forward_context():
                    logits = self.forward(mb)
                loss, aux, coef = self.loss(logits, mb.targets), self.experts.take_aux(), self.cfg.train.moe_aux_loss
                if aux is None or not coef:
                    loss_sum += pm.backward(loss)
                    continue
                # The mean over the rank's micro-batches, which data parallel then averages like the
                # loss; logged apart, so "loss" stays the cross-entropy every layout logs alike.
                loss_sum += pm.backward(loss, coef * aux / n_micro)
                self.experts.aux_sum += aux.detach() / n_micro
        return loss_sum

    def next_batch(self, step: int) -> Batch:
        """This rank's rows of optimizer step `step` (1-based), the loss denominator set for
        the step: from the data (GRPO's trainer generates them: posttrain/grpo.py)."""
        self.use_denominator(self.sampler.loss_tokens(step - 1))
        return self.sampler.batch(step - 1, self.dp_rank, self.dp_size).to(self.device)

    def evaluate(self) -> dict:
        """The evaluation record after a step (a collective): train/evaluate.py."""
        return evaluate(self)

    def train_step(self, step: int) -> dict:
        """Optimizer step `step` (1-based) over the global batch; its metrics record."""
        cfg, pm, optimizer = self.cfg, self.pm, self.optimizer
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = self.next_batch(step)
        loss_sum = self.forward_backward(batch)
        pm.sync_gradients()
        dump_gradients(pm.model, step, self.rank)  # LLMSPLIT_DUMP_GRADS (tests only): grad_dump.py
        grad_norm = pm.clip_gradients(optimizer, cfg.train.grad_clip)
        pm.optimizer_step(optimizer)
        if step == cfg.train.steps:
            self.held = state_bytes(pm.model, optimizer)  # while gradients still exist
        pm.zero_gradients(optimizer)
        loss = pm.global_loss(loss_sum)
        figures = self.objective.step_record(pm)
        step_time = time.perf_counter() - t0
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
                "tokens_per_s": batch.inputs.numel() * self.dp_size / step_time, "step_time_s": step_time,
                **figures, **self.experts.step_record(self.mesh.size("dp_cp"), cfg.parallel.tp)}

    def train(self) -> dict | None:
        """The run from its first step to the last; rank 0 returns the summary."""
        cfg, t = self.cfg, self.cfg.train
        self.objective.prepare(self, self.resumed_state)
        if t.confirm_micro_batch and self.pm.pipeline is None and self.start_step == 0:
            self.hangs.where = "the --auto micro-batch trial"
            self.micro_batch = self._confirm_micro_batch()
        profiler = StepProfiler(t.profile_steps, self.start_step, t.steps, self.run_dir, self.rank)
        reset_peak_memory(self.device)
        history = []
        for step in range(self.start_step + 1, t.steps + 1):
            self.hangs.where = f"step {step}"
            profiler.begin(step)
            _maybe_inject_fault(self.rank, step)
            threads = torch.get_num_threads()
            record = self.train_step(step)
            profiler.end(step)
            self.threads.record(record["step_time_s"])
            if self.threads.enabled:
                record["threads"] = threads
            peaks = rank_peaks(self.device)  # one collective serves the metric and the limit check
            check_memory_limit(cfg.memory.limit_bytes, peaks, step)
            record["peak_mem_bytes"] = max(peaks)
            if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                self.hangs.where = f"evaluating after step {step}"
                record.update(self.evaluate())
            history.append(record)
            if self.log is not None:
                self.log.add(record)
            self.saves.complete_if_written()
            if self.saves.due(step, t.steps):
                self.hangs.where = f"saving the checkpoint of step {step}"
                self._save(step)
        return self._finish(history, profiler)

    def _save(self, step: int, wait: bool = False) -> None:
        c = self.cfg.parallel
        state = {"step": step, "lr": lr_at(step, self.cfg), "data": self.sampler.state_dict(next_step=step),
                 "layout": {"world_size": self.world, "dp": c.dp, "zero": c.zero, "tp": c.tp, "pp": c.pp,
                            "cp": c.cp},
                 "inputs": self.inputs, **self.objective.checkpoint_state()}
        self.saves.save(lambda group: save_checkpoint(self.ck_dir, step, self.pm.model, self.optimizer, state,
                                                      self.cfg.checkpoint.keep, group), wait)

    def _finish(self, history: list[dict], profiler: StepProfiler) -> dict | None:
        """Final checkpoint, every rank's figures gathered; rank 0 writes the summary."""
        self.hangs.where = "the end of the run (final checkpoint, summary)"
        steps = self.cfg.train.steps
        self.saves.complete()
        if self.start_step < steps:
            self._save(steps, wait=True)
        held = self.held or state_bytes(self.pm.model, self.optimizer)
        close_optimizer(self.optimizer)
        mine = {"rank": self.rank, "peak_mem_bytes": peak_memory_bytes(self.device), **held}
        if self.pipeline_times is not None:
            mine["pipeline_steps"] = list(self.pipeline_times.per_step)
        profile_rows = profiler.finish()
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if not self.rank0:
            return None
        self.log.close()
        summary = run_summary(self.cfg, self.world, self.counts, history, gathered, self.run_dir, self.micro_batch)
        summary.update(data_summary(self, history))
        summary["checkpoints"] = self.saves.record()
        if self.pipeline_times is not None:
            summary["pipeline"] = bubble_report(self.pm.schedule, gathered, self.cfg.parallel,
                                                self.pm.pipeline.n_stages, self.pm.n_microbatches)
            for row in summary["per_rank"]:
                row.pop("pipeline_steps", None)  # lists per step and per action: summarised in summary["pipeline"]
        write_summary(summary, self.run_dir, history[0]["loss"] if history else None)
        if profile_rows is not None:
            profile_report(profile_rows, summary, self.run_dir)
        return summary

    def _confirm_micro_batch(self) -> int:
        """`--auto`'s trial (train/batch_trial.py) on the first step's batch; the run then
        trains with the micro-batch found, and its config.toml says which (a resume reads it)."""
        cfg, device = self.cfg, self.device
        limit = memory_limit(cfg.memory.limit_bytes, device)
        if limit is None:
            return cfg.train.micro_batch
        batch = self.sampler.batch(0, self.dp_rank, self.dp_size).to(device)
        self.use_denominator(self.sampler.loss_tokens(0))
        moments = 0 if cfg.memory.offload != "none" else moment_bytes(self.pm.model.parameters())
        chosen = confirm_micro_batch(cfg.train.micro_batch, self.per_rank, limit, device, moments,
                                     lambda mb: self.forward_backward(batch, mb),
                                     lambda: self.optimizer.zero_grad(set_to_none=True))
        if chosen is None:
            raise MemoryLimitExceeded(self.rank, peak_memory_bytes(device), limit,
                                      "memory.limit_bytes" if cfg.memory.limit_bytes is not None else "device memory",
                                      "the --auto micro-batch trial (micro_batch=1)")
        cfg.train.micro_batch = chosen
        if self.rank0:
            (self.run_dir / CONFIG_FILE).write_text(to_toml(cfg))
        return chosen


def _maybe_inject_fault(rank: int, step: int) -> None:
    """`LLMSPLIT_FAULT=RANK:STEP[:kill|hang|pause[:ATTEMPT]]` makes that rank (`*`: every
    worker of the node whose launcher has it) raise (die by SIGKILL, stop answering, stop for
    10 s) at that step of the first attempt (of restart ATTEMPT: torch's count, which a
    machine joining does not raise): how the tests check failure reports, crash restarts,
    hang reports and lost or joining machines without waiting for a real failure."""
    spec = os.environ.get("LLMSPLIT_FAULT", "")
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] not in (str(rank), "*") or parts[1] != str(step):
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != (parts[3] if len(parts) > 3 else "0"):
        return
    if parts[2:3] == ["kill"]:
        os.kill(os.getpid(), signal.SIGKILL)
    if parts[2:3] == ["pause"]:
        time.sleep(10)
        return
    if parts[2:3] == ["hang"]:
        time.sleep(24 * 3600)  # until the launcher stops this worker after the others time out
    raise RuntimeError(f"fault injected by LLMSPLIT_FAULT={spec}")
