"""Progress for people: a bar on a terminal, plain log lines otherwise, a summary table."""

from __future__ import annotations

import sys
from pathlib import Path


class Progress:
    def __init__(self, total: int, start: int):
        self.tty = sys.stderr.isatty()
        self.total = total
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def update(self, rec: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)
        else:
            print(f"step {rec['step']}/{self.total}  loss {rec['loss']:.4f}" + _preference_text(rec) +
                  f"  lr {rec['lr']:.2e}  tokens/s {rec['tokens_per_s']:.0f}  step {rec['step_time_s']:.2f}s  "
                  f"peak {rec['peak_mem_bytes'] / 2**20:.0f} MiB" + _eval_text(rec), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def parameter_line(counts: dict, base: str = "none") -> str:
    """The run's parameters as its start says them (PEFT's print_trainable_parameters' figures)."""
    params, trainable = counts["params"], counts["trainable_params"]
    if trainable == params:
        return f"model {params / 1e6:.2f}M parameters, all trainable"
    line = (f"model {params / 1e6:.2f}M parameters, frozen; trainable {trainable / 1e6:.2f}M in LoRA adapters "
            f"({trainable / params:.2%} of the model's)")
    if "frozen_base_bytes" in counts:
        line += f"; the frozen base stored as {base} in {counts['frozen_base_bytes'] / 2**20:.1f} MiB"
    return line


def print_summary(summary: dict, run_dir: Path, first_loss: float | None) -> None:
    lay = summary["layout"]
    rows = [
        ("run dir", str(run_dir)),
        ("layout", f"world {summary['world_size']}: dp={lay['dp']} zero={lay['zero']} tp={lay['tp']} pp={lay['pp']}"
                    + (f" ep={lay['ep']}" if lay.get("ep", 1) > 1 else "")
                    + (f" cp={lay['cp']} ({lay['cp_mode']})" if lay.get("cp", 1) > 1 else "")),
        ("model", f"{summary['params'] / 1e6:.2f}M parameters, {summary['precision']}"),
        ("steps", str(summary["steps"])),
        ("loss", (f"{first_loss:.4f} -> " if first_loss is not None else "") + f"{summary['final_loss']:.4f}"),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
    ]
    if "padding_fraction" in summary:  # packed chat data
        rows.append(("data", f"{summary['loss_token_fraction']:.1%} of target tokens carry loss, "
                             f"{summary['padding_fraction']:.1%} padding, {summary['truncated_documents']} "
                             f"documents cut to data.seq_len + 1"))
    if "eval_loss" in summary or "eval_reward" in summary:
        rows.append(("eval", _eval_text(summary).strip().removeprefix("eval ")))
    for r in summary["per_rank"]:
        rows.append((f"rank {r['rank']}", f"peak {r['peak_mem_bytes'] / 2**20:.0f} MiB  params "
                     f"{r['param_bytes'] / 2**20:.1f} MiB  grads {r['grad_bytes'] / 2**20:.1f} MiB  "
                     f"optimizer {r['optim_bytes'] / 2**20:.1f} MiB"))
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


def _eval_text(rec: dict) -> str:
    if "eval_reward" in rec:  # GRPO
        return f"  eval reward {rec['eval_reward']:.4f}"
    if "eval_loss" not in rec:
        return ""
    if "eval_ppl" in rec:
        return f"  eval loss {rec['eval_loss']:.4f}  perplexity {rec['eval_ppl']:.2f}"
    return (f"  eval loss {rec['eval_loss']:.4f}  accuracy {rec['eval_rewards/accuracies']:.2f}  "
            f"margin {rec['eval_rewards/margins']:.3f}")  # DPO


def _preference_text(rec: dict) -> str:
    """A DPO step's share of pairs the policy prefers as the data does, and by how much; a
    GRPO step's mean reward and completion length."""
    if "reward" in rec:
        return f"  reward {rec['reward']:.4f}  length {rec['completions/mean_length']:.1f}"
    if "rewards/accuracies" not in rec:
        return ""
    return f"  accuracy {rec['rewards/accuracies']:.2f}  margin {rec['rewards/margins']:.3f}"
