"""One GRPO step's rows: the step's prompts, `num_generations` completions of each from the
engine holding the current policy, their rewards, the group-relative advantages, and the rows
training reads.

Every rank generates a contiguous share of the step's completions (whatever its place in the
training layout: tensor-parallel and data-parallel ranks alike), scores them, and all ranks then
exchange what they made; each takes its data-parallel rows. A completion's sampling seed is a
function of (train.seed, step, prompt, sample), so the rows of a step are the same whichever
rank made them, and a resumed run regenerates the rows an uninterrupted one would have.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from ..data.loader import IGNORE, Batch
from ..infer.engine import SamplingParams
from ..train.grpo import group_advantages
from .rewards import score


def share(n: int, rank: int, world: int) -> range:
    """Rank `rank`'s contiguous share of `n` items, sizes differing by at most one."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def completion_seed(seed: int, step: int, prompt: int) -> int:
    """The sampling seed of a prompt's group at a step (sample g draws from it + g)."""
    return (seed * 1_000_003 + step) * 2_654_435_761 + prompt * 97_531 & (2**62 - 1)


def generate_share(policy, prompts, rows: range, group: int, prompt_ids: list[int], params: dict,
                   seed: int, step: int) -> list:
    """This rank's completions of `rows` (row r: sample r % group of prompt r // group, whose
    set index is prompt_ids[r // group]); the first of a prompt's samples computes the prompt
    and the others share its cache blocks."""
    engine = policy.loaded.engine
    seqs, firsts = [], {}
    for r in rows:
        p = prompt_ids[r // group]
        sampling = SamplingParams(params["max_new_tokens"], params["temperature"], None, params["top_p"],
                                  completion_seed(seed, step, p))
        seq = engine.new_sequence(prompts.ids[p], sampling, policy.adapter, seed_offset=r % group)
        if r // group in firsts:
            seq.parent = firsts[r // group]
        firsts.setdefault(r // group, seq)
        seqs.append(seq)
    engine.generate(seqs)
    return seqs


def reference_logps(policy, prompt: list[int], completion: list[int]) -> list[float]:
    """The reference's log-prob of each completion token, after the prompt."""
    full = torch.tensor([prompt + completion])
    logits = policy.reference_logits(full[:, :-1])[0, len(prompt) - 1:].float()
    return torch.log_softmax(logits, -1).gather(-1, full[0, len(prompt):, None].to(logits.device))[:, 0].tolist()


def make_rows(made: list[dict], prompts, prompt_ids: list[int], group: int, rows: range,
              width: tuple[int | None, int], pad_id: int) -> tuple[Batch, torch.Tensor | None]:
    """(this rank's rows `rows`, every row's reference log-probs [n, width] or None): each row
    is prompt + completion, targets IGNORE over the prompt, the row's index after them. `width`:
    (multiple, seq_len): rows cut to the longest rounded up to the multiple, or, where it is None
    (pipeline stages, whose schedule keeps the first step's shapes), seq_len wide."""
    multiple, seq_len = width
    lengths = [len(prompts.ids[prompt_ids[m["row"] // group]]) + len(m["tokens"]) - 1 for m in made]
    width = seq_len if multiple is None else math.ceil(max(lengths) / multiple) * multiple
    inputs = np.full((len(rows), width), pad_id, dtype=np.int64)
    targets = np.full((len(rows), width + 1), IGNORE, dtype=np.int64)
    for i, r in enumerate(rows):
        prompt, completion = prompts.ids[prompt_ids[r // group]], made[r]["tokens"]
        full = prompt + completion
        inputs[i, :len(full) - 1] = full[:-1]
        targets[i, len(prompt) - 1:len(full) - 1] = completion
        targets[i, -1] = r
    ref = None
    if made[0]["ref"] is not None:
        ref = torch.zeros(len(made), width)
        for m in made:
            start = len(prompts.ids[prompt_ids[m["row"] // group]]) - 1
            ref[m["row"], start:start + len(m["ref"])] = torch.tensor(m["ref"])
    return Batch(torch.from_numpy(inputs), torch.from_numpy(targets)), ref


def rollout_figures(made: list[dict], names: list[str], group: int, seconds: float) -> dict:
    """What a step logs of its completions and rewards, under TRL's names."""
    totals = torch.tensor([m["reward"] for m in made]).view(-1, group)
    lengths = [len(m["tokens"]) for m in made]
    out = {"reward": float(totals.mean()), "reward_std": float(totals.std(1).mean()),
           "frac_reward_zero_std": float((totals.std(1) == 0).float().mean()),
           "completions/mean_length": sum(lengths) / len(lengths),
           "completions/clipped_ratio": sum(not m["stopped"] for m in made) / len(made),
           "rollout_tokens_per_s": sum(lengths) / max(seconds, 1e-9), "rollout_s": seconds}
    for k, name in enumerate(names):
        values = torch.tensor([m["rewards"][k] for m in made], dtype=torch.float64)
        out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = float(values.nanmean()), float(_nanstd(values))
    return out


def _nanstd(values: torch.Tensor) -> float:
    kept = values[~values.isnan()]
    return float(kept.std()) if len(kept) > 1 else 0.0


class Rollouts:
    """The rows of each GRPO step, made by every rank's engine (a collective per step)."""

    def __init__(self, policy, prompts, sampler, rewards, grpo, seed: int, width: tuple[int | None, int],
                 pad_id: int):
        """`width`: (multiple, seq_len) of the rows (`make_rows`)."""
        self.policy, self.prompts, self.sampler, self.rewards = policy, prompts, sampler, rewards
        self.group, self.grpo, self.seed = grpo.num_generations, grpo, seed
        self.width, self.pad_id = width, pad_id
        self.params = {"max_new_tokens": grpo.max_completion_tokens, "temperature": grpo.temperature,
                       "top_p": grpo.top_p if grpo.top_p < 1 else None}
        self.reference = grpo.beta > 0

    def make(self, step: int, dp_rank: int, dp_size: int) -> tuple[Batch, torch.Tensor, torch.Tensor | None, dict]:
        """(this data-parallel rank's rows, every row's advantage, reference log-probs or None,
        the step's figures) of optimizer step `step` (1-based)."""
        started = time.perf_counter()
        prompt_ids = self.sampler.indices(step - 1)
        n = len(prompt_ids) * self.group
        mine = self._made_here(share(n, dist.get_rank(), dist.get_world_size()), prompt_ids, step)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        made = sorted((m for part in gathered for m in part), key=lambda m: m["row"])
        seconds = time.perf_counter() - started
        rewards = torch.tensor([m["reward"] for m in made], dtype=torch.float32)
        per_rank = n // dp_size
        rows = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        batch, ref = make_rows(made, self.prompts, prompt_ids, self.group, rows, self.width, self.pad_id)
        figures = rollout_figures(made, [r.name for r in self.rewards], self.group, seconds)
        return batch, group_advantages(rewards, self.group), ref, figures

    def _made_here(self, rows: range, prompt_ids: list[int], step: int) -> list[dict]:
        """This rank's completions of `rows`, scored (and the reference's log-probs of them)."""
        if not rows:
            return []
        seqs = generate_share(self.policy, self.prompts, rows, self.group, prompt_ids, self.params, self.seed, step)
        sets = [prompt_ids[r // self.group] for r in rows]
        columns = [self.prompts.columns[p] for p in sets]
        totals, per_function = score(self.rewards, [self.prompts.prompts[p] for p in sets],
                                     [s.text for s in seqs], columns)
        made = []
        for i, (r, seq) in enumerate(zip(rows, seqs)):
            tokens = seq.tokens + ([seq.stop_token] if seq.stop_token is not None else [])
            ref = reference_logps(self.policy, self.prompts.ids[sets[i]], tokens) if self.reference else None
            made.append({"row": r, "tokens": tokens, "stopped": seq.finish_reason == "stop", "reward": totals[i],
                         "rewards": [per_function[f.name][i] for f in self.rewards], "ref": ref})
        return made
