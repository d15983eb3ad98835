"""GRPO's worker entry point and what the launcher checks before starting it.

Kept apart from posttrain/grpo.py for the reason train/entry.py is kept apart from the trainer:
the launching process imports the entry point only, not the trainer and the engine.
"""

from __future__ import annotations

from ..launch import worker_entry


@worker_entry
def run_grpo_worker(config_text: str, run_dir: str | None, resume: str = "none") -> dict | None:
    """Entry point of one GRPO worker process (started by llmsplit's launcher or torchrun)."""
    from ..train.entry import run_trainer
    from .grpo import GRPOTrainer

    return run_trainer(GRPOTrainer, config_text, run_dir, resume)


def prepare_grpo(job) -> None:
    """Before any worker starts: the prompts' shape and the reward functions (each must import
    and be callable: exit 2 otherwise); the job's workers then run GRPO's trainer."""
    from ..data.datasets import check_prompt_source
    from .rewards import check_rewards

    check_prompt_source(job.cfg.data)
    check_rewards(job.cfg.grpo)
    job.entry, job.preload = run_grpo_worker, ("llmsplit.posttrain.grpo",)
