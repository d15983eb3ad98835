"""GRPO's worker entry point and what the launcher checks before starting it.

Kept apart from posttrain/grpo.py for the reason train/entry.py is kept apart from the trainer:
the launching process imports the entry point only, not the trainer and the engine.
"""

from __future__ import annotations

from ..errors import ConfigError
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
    _check_lengths(job.cfg)
    job.entry, job.preload = run_grpo_worker, ("llmsplit.posttrain.grpo",)


def _check_lengths(cfg) -> None:
    """Every prompt with its longest completion within data.seq_len (a row's width in training)."""
    from ..data.datasets import build_prompt_samplers
    from ..io.tokenizer import load_tokenizer
    from ..data.prompts import longest_prompt

    g = cfg.grpo
    samplers = build_prompt_samplers(cfg.data, cfg.train.global_batch // g.num_generations, cfg.train.seed,
                                     load_tokenizer(cfg.data.tokenizer))
    longest = longest_prompt(*samplers)
    if longest + g.max_completion_tokens > cfg.data.seq_len:
        raise ConfigError(f"the longest prompt has {longest} tokens and grpo.max_completion_tokens is "
                          f"{g.max_completion_tokens}: more than data.seq_len={cfg.data.seq_len}; raise data.seq_len "
                          f"or lower grpo.max_completion_tokens")
