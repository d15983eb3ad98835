"""Prompts for GRPO: JSONL rows of a "prompt" and any other columns, the columns handed to the
reward functions beside each completion (as TRL passes a dataset's extra columns).

A row is TRL's shape in either of its forms:
  {"prompt": "text", ...}                        encoded as it stands (tokenizer.encode)
  {"prompt": [{"role", "content"}, ...], ...}    rendered with the model's chat template, ending
                                                 where the assistant's reply begins
Reward functions receive the prompt as the row gives it (text, or the list of messages), never
the rendered text, so a reward is written against the data and not against a template.

Which prompts a step samples is a pure function of (seed, step): epoch after epoch through a
permutation drawn from (seed, epoch), as loader.py's rows are, so a resumed run needs only its
step to continue the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ConfigError
from .chat import TRAINING_LIMITS, check_messages, json_row, jsonl_lines

# The names a reward function's own arguments take (posttrain/rewards.py calls
# fn(prompts, completions, **columns)): a column of either name would collide with them.
RESERVED_COLUMNS = ("prompts", "completions")


@dataclass
class PromptSet:
    """Per prompt: its token ids (what the engine continues), the row's "prompt" as given, and
    the row's other columns."""

    ids: list[list[int]]
    prompts: list
    columns: list[dict]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, rows: slice) -> PromptSet:
        return PromptSet(self.ids[rows], self.prompts[rows], self.columns[rows])


def read_prompt_files(files: list[Path], tokenizer, key: str = "data.source") -> PromptSet:
    """Every row of the .jsonl files, encoded."""
    out = PromptSet([], [], [])
    for where, prompt, columns in _rows(files, key):
        out.ids.append(_encode(prompt, tokenizer, where))
        out.prompts.append(prompt)
        out.columns.append(columns)
    return out


def check_prompt_files(files: list[Path], key: str = "data.source") -> None:
    """What a launcher checks before any worker starts: every row's shape (JSON only, cheap;
    whether the template renders each prompt is known once the workers tokenize)."""
    for _ in _rows(files, key):
        pass


def _rows(files: list[Path], key: str):
    """(where, prompt, other columns) per row of the files."""
    for where, line in jsonl_lines(files, key, "prompt", "a \"prompt\" (text or messages)"):
        yield _row(line, f"{key} {where}")


def _row(line: str, where: str) -> tuple[str, str | list[dict], dict]:
    row = json_row(line, where, "a \"prompt\" (text or messages)")
    if "prompt" not in row:
        raise ConfigError(f"{where}: no \"prompt\" key; every row needs \"prompt\" (text or messages)")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"{where}: the \"prompt\" is empty; give it text or messages")
    elif isinstance(prompt, list):
        check_messages(prompt, f"{where} \"prompt\"")
    else:
        raise ConfigError(f"{where}: the \"prompt\" must be text or a non-empty list of {{\"role\", \"content\"}} "
                          f"messages, not {type(prompt).__name__}")
    columns = {name: value for name, value in row.items() if name != "prompt"}
    for name in RESERVED_COLUMNS:
        if name in columns:
            raise ConfigError(f"{where}: the column \"{name}\" has the name of a reward function's own argument; "
                              f"rename the column")
    return where, prompt, columns


def _encode(prompt: str | list[dict], tokenizer, where: str) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        from ..io.chat_template import TemplateError, render_chat

        try:
            text = render_chat(prompt, tokenizer, add_generation_prompt=True, limits=TRAINING_LIMITS)
        except TemplateError as e:
            raise ConfigError(f"{where}: {e}; fix the data or the template") from None
        ids = tokenizer.encode(text)
    if not ids:
        raise ConfigError(f"{where}: the prompt encodes to no token; give it text")
    return list(ids)


class PromptSampler:
    """The prompts of each step: prompt `i` of the run (counting across steps) is `perm_e[i mod
    n]` of epoch `e = i div n`, `perm_e` drawn from (seed, e); step `s` takes prompts
    s·per_step .. s·per_step + per_step − 1. Every epoch covers every prompt once."""

    def __init__(self, prompts: PromptSet, per_step: int, seed: int):
        assert per_step >= 1 and len(prompts) >= 1
        self.prompts, self.per_step, self.seed = prompts, per_step, seed
        self._perms: dict[int, list[int]] = {}

    @property
    def n_prompts(self) -> int:
        return len(self.prompts)

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            # loader.BatchSampler's seeding, so a seed means the same kind of order for both.
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_prompts, generator=g).tolist()}  # one epoch kept
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """The prompt indices of `step` (0-based), in order."""
        n = self.n_prompts
        return [self._perm(i // n)[i % n] for i in range(step * self.per_step, (step + 1) * self.per_step)]

    def state_dict(self, next_step: int) -> dict:
        return {"seed": self.seed, "next_step": next_step, "per_step": self.per_step, "n_prompts": self.n_prompts,
                "epoch": next_step * self.per_step // self.n_prompts}


def longest_prompt(sampler, eval_sampler) -> int:
    """The most tokens a prompt of the run (training or held out) has."""
    held = eval_sampler.prompts.ids if eval_sampler is not None else []
    return max(len(ids) for ids in [*sampler.prompts.ids, *held])
