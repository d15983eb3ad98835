"""What a run trains for (`train.objective`), the [dpo] and [grpo] sections, with their checks
(checks.py calls `check_objective`).

"sft" is next-token loss on the data (every run before DPO); "dpo" is Direct Preference
Optimization on rows of a prompt, a chosen and a rejected reply (train/dpo.py); "grpo" is Group
Relative Policy Optimization: completions sampled from the policy for each prompt, scored by the
user's reward functions, and trained on their advantage within the prompt's group (posttrain/).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import ConfigError

OBJECTIVES = ("sft", "dpo", "grpo")
DPO_LOSSES = ("sigmoid", "ipo")
# As TRL's loss_type: "grpo" averages each completion's token losses, then the completions (Shao
# et al. 2024); "dr_grpo" divides the token losses' sum by a constant instead, so a completion's
# length does not weigh its tokens (Liu et al. 2025, "Dr. GRPO").
GRPO_LOSSES = ("grpo", "dr_grpo")


@dataclass
class DpoSection:
    beta: float = 0.1  # how far the policy may move from the reference (TRL's default)
    loss: str = "sigmoid"  # "sigmoid": Rafailov et al. 2023; "ipo": Azar et al. 2023, on mean token log-probs
    label_smoothing: float = 0.0  # the chance a preference label is wrong (conservative DPO); sigmoid only


@dataclass
class GrpoSection:
    # "module:function" or "path/to/file.py:function", each called (prompts, completions, **columns)
    rewards: list[str] = field(default_factory=list)
    reward_weights: list[float] = field(default_factory=list)  # one per reward; empty: 1.0 each
    num_generations: int = 8  # completions sampled per prompt: the group each advantage is relative to (TRL's default)
    epsilon: float = 0.2  # the probability ratio is clipped to [1 - epsilon, 1 + epsilon]
    beta: float = 0.0  # times the KL to the reference; 0 keeps no reference (TRL's default)
    loss: str = "grpo"
    max_completion_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0


def check_objective(cfg) -> None:
    """Refuse an unknown objective and impossible [dpo] and [grpo] keys (each section's values
    whatever the objective, as a mistyped value is a mistake either way; what depends on the
    objective only under it). A DPO run reads chat rows, so an unset data.format becomes "chat"."""
    if cfg.train.objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={cfg.train.objective!r} is not one of: {', '.join(map(repr, OBJECTIVES))}")
    _check_dpo_section(cfg.dpo)
    _check_grpo_section(cfg.grpo)
    _check_distillation(cfg)
    if cfg.train.objective == "dpo":
        _check_dpo_run(cfg)
    elif cfg.train.objective == "grpo":
        _check_grpo_run(cfg)


def _check_distillation(cfg) -> None:
    t = cfg.train
    if not 0 < t.distill_weight <= 1:
        raise ConfigError(f"train.distill_weight={t.distill_weight} must be above 0 and at most 1 (the KL term's "
                          f"share of the loss; 1: KL alone)")
    if not t.distill_temperature > 0:
        raise ConfigError(f"train.distill_temperature={t.distill_temperature} must be greater than 0 (1: the logits "
                          f"as they are)")
    if not t.teacher:
        return
    if t.objective != "sft":
        raise ConfigError(f"train.teacher distils with the next-token objective, and train.objective is "
                          f"{t.objective!r}; remove train.teacher or set train.objective=\"sft\"")


def _check_dpo_section(dpo: DpoSection) -> None:
    if dpo.loss not in DPO_LOSSES:
        raise ConfigError(f"dpo.loss={dpo.loss!r} is not one of: {', '.join(map(repr, DPO_LOSSES))}")
    if not dpo.beta > 0:
        raise ConfigError(f"dpo.beta={dpo.beta} must be greater than 0 (TRL's default is 0.1)")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={dpo.label_smoothing} must be at least 0 and below 0.5")
    if dpo.label_smoothing and dpo.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=\"sigmoid\" only; remove it or set "
                          f"dpo.loss=\"sigmoid\" (it is {dpo.loss!r})")


def _check_dpo_run(cfg) -> None:
    if "data.format" not in cfg.explicit:
        cfg.data.format = "chat"
    if cfg.data.format != "chat":
        raise ConfigError("train.objective=\"dpo\" reads JSONL rows of \"prompt\" (or \"messages\"), \"chosen\" and "
                          "\"rejected\"; set data.format=\"chat\"")
    if cfg.data.loss_on not in (None, "assistant"):
        raise ConfigError("train.objective=\"dpo\" scores the chosen and rejected replies only; remove data.loss_on "
                          "or set it to \"assistant\"")


def _check_grpo_section(grpo: GrpoSection) -> None:
    if grpo.reward_weights and len(grpo.reward_weights) != len(grpo.rewards):
        raise ConfigError(f"grpo.reward_weights has {len(grpo.reward_weights)} weights for {len(grpo.rewards)} "
                          f"grpo.rewards; give one weight per reward function, or none (each 1.0)")
    if not all(math.isfinite(w) for w in grpo.reward_weights):
        raise ConfigError(f"grpo.reward_weights={grpo.reward_weights} holds a value that is not a finite number; "
                          f"give each reward function a finite weight")
    if grpo.num_generations < 2:
        # One completion is its own group mean: its advantage, hence its gradient, is always 0.
        raise ConfigError(f"grpo.num_generations={grpo.num_generations} must be at least 2 (the completions of a "
                          f"prompt are scored against each other; TRL's default is 8)")
    if not grpo.epsilon > 0:
        raise ConfigError(f"grpo.epsilon={grpo.epsilon} must be greater than 0 (the clip range; TRL's default is 0.2)")
    if not grpo.beta >= 0:
        raise ConfigError(f"grpo.beta={grpo.beta} must be at least 0 (0: no KL term and no reference model)")
    if grpo.loss not in GRPO_LOSSES:
        raise ConfigError(f"grpo.loss={grpo.loss!r} is not one of: {', '.join(map(repr, GRPO_LOSSES))}")
    if grpo.max_completion_tokens < 1:
        raise ConfigError(f"grpo.max_completion_tokens={grpo.max_completion_tokens} must be at least 1")
    if not grpo.temperature > 0:
        # Greedy rollouts would make every completion of a group the same: no advantage to learn from.
        raise ConfigError(f"grpo.temperature={grpo.temperature} must be greater than 0 (completions are sampled; "
                          f"TRL's default is 1.0)")
    if not 0 < grpo.top_p <= 1:
        raise ConfigError(f"grpo.top_p={grpo.top_p} must be above 0 and at most 1 (1: no nucleus cut)")


def _check_grpo_run(cfg) -> None:
    grpo = cfg.grpo
    if not grpo.rewards:
        raise ConfigError("train.objective=\"grpo\" needs grpo.rewards: set it to a list of reward functions, "
                          "e.g. grpo.rewards=[\"rewards.py:correct\"]")
    if cfg.train.global_batch % grpo.num_generations:
        raise ConfigError(f"train.global_batch={cfg.train.global_batch} is not divisible by grpo.num_generations="
                          f"{grpo.num_generations} (the batch counts completions, num_generations per prompt); "
                          f"set train.global_batch to a multiple of {grpo.num_generations}")
    for key in ("data.source", "data.eval_source"):
        source = getattr(cfg.data, key.split(".")[1])
        if source and not (source.endswith(".jsonl") or source.startswith("text:")):
            raise ConfigError(f"{key}={source!r} is not a .jsonl file; train.objective=\"grpo\" reads JSONL rows "
                              f"with a \"prompt\" (text or messages): point {key} at one")
