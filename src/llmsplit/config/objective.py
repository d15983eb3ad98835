"""What a run trains for (`train.objective`) and the [dpo] section, with their checks
(checks.py calls `check_objective`).

"sft" is next-token loss on the data (every run before DPO); "dpo" is Direct Preference
Optimization on rows of a prompt, a chosen and a rejected reply (train/dpo.py). GRPO's name is
reserved by the product's contract but not built yet, and is refused as such.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

OBJECTIVES = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "ipo")


@dataclass
class DpoSection:
    beta: float = 0.1  # how far the policy may move from the reference (TRL's default)
    loss: str = "sigmoid"  # "sigmoid": Rafailov et al. 2023; "ipo": Azar et al. 2023, on mean token log-probs
    label_smoothing: float = 0.0  # the chance a preference label is wrong (conservative DPO); sigmoid only


def check_objective(cfg) -> None:
    """Refuse an objective this build lacks and impossible [dpo] keys; a DPO run reads chat rows,
    so an unset data.format becomes "chat"."""
    objective, dpo = cfg.train.objective, cfg.dpo
    if objective == "grpo":
        raise ConfigError("train.objective=\"grpo\" is not built yet (issue 47); use \"sft\" or \"dpo\"")
    if objective not in OBJECTIVES:
        raise ConfigError(f"train.objective={objective!r} is not one of: {', '.join(map(repr, OBJECTIVES))}")
    if dpo.loss not in DPO_LOSSES:
        raise ConfigError(f"dpo.loss={dpo.loss!r} is not one of: {', '.join(map(repr, DPO_LOSSES))}")
    if not dpo.beta > 0:
        raise ConfigError(f"dpo.beta={dpo.beta} must be greater than 0 (TRL's default is 0.1)")
    if not 0 <= dpo.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing={dpo.label_smoothing} must be at least 0 and below 0.5")
    if dpo.label_smoothing and dpo.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=\"sigmoid\" only; remove it or set "
                          f"dpo.loss=\"sigmoid\" (it is {dpo.loss!r})")
    if objective != "dpo":
        return
    if "data.format" not in cfg.explicit:
        cfg.data.format = "chat"
    if cfg.data.format != "chat":
        raise ConfigError("train.objective=\"dpo\" reads JSONL rows of \"prompt\" (or \"messages\"), \"chosen\" and "
                          "\"rejected\"; set data.format=\"chat\"")
    if cfg.data.loss_on not in (None, "assistant"):
        raise ConfigError("train.objective=\"dpo\" scores the chosen and rejected replies only; remove data.loss_on "
                          "or set it to \"assistant\"")
