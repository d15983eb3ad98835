"""Preference data for DPO: JSONL rows of a prompt, a chosen and a rejected reply, each reply
rendered after the prompt with the model's chat template, and only the reply's tokens scored.

A row is TRL's shape in either of its forms:
  {"prompt": "text" | [messages], "chosen": "text" | [messages], "rejected": "text" | [messages]}
  {"messages": [the prompt's messages], "chosen": ..., "rejected": ...}
  {"chosen": [whole conversation], "rejected": [whole conversation]}   (implicit prompt: the
      messages both share from the start)
A reply given as text is one assistant message. Its tokens are those of its assistant turns in
the rendered conversation (data/chat.py finds them from the template itself), so the prompt's own
earlier assistant turns, if any, are never scored.

Every pair becomes two rows of seq_len + 1 tokens, chosen then rejected, side by side in every
batch (so any even split of a batch keeps each pair together), padded after the reply. A row's
targets carry, after the seq_len token targets, the pair's index in the data: the loss reads the
pair's reference log-probs with it wherever the layout computes that loss (train/dpo.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .chat import ROLES, encode_conversation, json_row, jsonl_lines
from .loader import IGNORE, Batch, BatchSampler

NO_PAIR = -1  # the pair index of filler rows (the last batch of an evaluation), which carry no loss


@dataclass
class PreferencePairs:
    """Per pair: (tokens, loss mask) of the chosen and the rejected conversation."""

    chosen: list[tuple[np.ndarray, np.ndarray]]
    rejected: list[tuple[np.ndarray, np.ndarray]]

    def __len__(self) -> int:
        return len(self.chosen)


def read_preference_files(files: list[Path], tokenizer, key: str = "data.source") -> PreferencePairs:
    """Every row of the .jsonl files, encoded."""
    pairs = PreferencePairs([], [])
    for where, prompt, chosen, rejected in _rows(files, key):
        pairs.chosen.append(_encode(prompt, chosen, tokenizer, f"{where} (chosen)"))
        pairs.rejected.append(_encode(prompt, rejected, tokenizer, f"{where} (rejected)"))
    return pairs


def check_preference_files(files: list[Path], key: str = "data.source") -> None:
    """What a launcher checks before any worker starts: every row's shape (JSON only, cheap;
    whether the template renders each reply is known once the workers tokenize)."""
    for _ in _rows(files, key):
        pass


def _rows(files: list[Path], key: str):
    """(where, prompt, chosen, rejected) per row of the files."""
    for where, line in jsonl_lines(files, key, "preference", "\"prompt\", \"chosen\" and \"rejected\""):
        yield (where, *_pair(line, where))


def _pair(line: str, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen messages, rejected messages) of one row."""
    row = json_row(line, where, "\"prompt\", \"chosen\" and \"rejected\"")
    for name in ("chosen", "rejected"):
        if name not in row:
            raise ConfigError(f"{where} has no \"{name}\"; every row of a DPO run needs \"prompt\" (or \"messages\"), "
                              f"\"chosen\" and \"rejected\"")
    chosen, rejected = (_messages(row[name], "assistant", f"{where} \"{name}\"") for name in ("chosen", "rejected"))
    prompt = row.get("prompt", row.get("messages"))
    if prompt is None:
        shared = 0  # the implicit prompt: the messages both conversations start with
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    else:
        prompt = _messages(prompt, "user", f"{where} \"prompt\"")
    if not prompt:
        raise ConfigError(f"{where} has no prompt; give it \"prompt\" (or \"messages\"), or chosen and rejected "
                          f"conversations that start with the same messages")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in reply):
            raise ConfigError(f"{where} \"{name}\" has no assistant message to score; give the reply as text or as "
                              f"messages with role \"assistant\"")
    return prompt, chosen, rejected


def _messages(value, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where} must be text or a non-empty list of {{\"role\", \"content\"}} messages")
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConfigError(f"{where}: every message needs a \"role\" among {', '.join(ROLES)}")
    return value


def _encode(prompt: list[dict], reply: list[dict], tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of prompt + reply, and the mask of the reply's assistant turns alone (the last of
    the conversation's assistant spans: as many as the reply has assistant messages)."""
    ids, mask = encode_conversation(prompt + reply, tokenizer, "assistant", where)
    mask = np.asarray(mask, dtype=np.uint8)
    starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
    turns = sum(m["role"] == "assistant" for m in reply)
    if len(starts) < turns:
        raise ConfigError(f"{where}: the reply renders no tokens; give it text")
    mask[:starts[len(starts) - turns]] = 0
    return np.asarray(ids, dtype=np.int64), mask


class PreferenceSampler(BatchSampler):
    """Pairs in the order `BatchSampler` draws rows (the same for every layout and resumable by
    step); a batch of n pairs is 2n rows, chosen and rejected alternating."""

    def __init__(self, pairs: PreferencePairs, seq_len: int, global_batch: int, seed: int, pad_id: int = 0,
                 width_multiple: int | None = None):
        self.pairs, self.pad_id = pairs, pad_id
        # Rows are cut to the longest of their batch, rounded up to this multiple (TRL pads to the
        # longest too; pairs are often far shorter than data.seq_len). None: data.seq_len wide, for
        # the pipeline, whose schedule keeps the first step's shapes.
        self.width_multiple = width_multiple
        row = seq_len + 1
        self.truncated = 0
        for where, n, (ids, mask) in _sequences(pairs):
            if len(ids) > row:
                self.truncated += 1
                if not mask[1:row].any():
                    raise ConfigError(f"pair {n} ({where}) has no reply token within data.seq_len={seq_len} tokens; "
                                      f"raise data.seq_len or shorten its prompt")
        super().__init__(np.zeros(0, dtype=np.int64), seq_len, global_batch, seed)

    def _count_rows(self) -> int:
        return len(self.pairs)

    def _row(self, ids: np.ndarray, mask: np.ndarray, pair: int) -> tuple[np.ndarray, np.ndarray]:
        size = self.seq_len + 1
        tokens = np.full(size, self.pad_id, dtype=np.int64)
        scored = np.zeros(size, dtype=bool)
        n = min(len(ids), size)
        tokens[:n], scored[:n] = ids[:n], mask[:n] != 0
        targets = np.append(np.where(scored[1:], tokens[1:], IGNORE), pair)
        return tokens[:-1], targets

    def rows(self, ids: list[int]) -> Batch:
        """The pairs `ids` (NO_PAIR: a filler pair without loss) as 2 × len(ids) rows."""
        parts = []
        empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8))
        for p in ids:
            for side in (self.pairs.chosen, self.pairs.rejected):
                ids_mask = side[p] if p != NO_PAIR else empty
                parts.append(self._row(*ids_mask, p))
        inputs, targets = (torch.from_numpy(np.stack([part[i] for part in parts])) for i in range(2))
        if self.width_multiple:
            # A row of n tokens has n - 1 inputs that matter; filler rows none.
            longest = max([min(len(side[p][0]), self.seq_len + 1) - 1 for p in ids if p != NO_PAIR
                           for side in (self.pairs.chosen, self.pairs.rejected)], default=1)
            width = min(self.seq_len, -(-longest // self.width_multiple) * self.width_multiple)
            inputs, targets = inputs[:, :width], torch.cat([targets[:, :width], targets[:, -1:]], 1)
        return Batch(inputs, targets)

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        raise AssertionError("preference rows are Batches: use batch()")

    def loss_tokens(self, step: int) -> int:
        """The DPO loss is a mean over pairs: the global batch's pairs are its denominator."""
        return self.global_batch

    def eval_batches(self, dp_rank: int, dp_size: int):
        """Every pair once, in order, in global batches (the last one filled with NO_PAIR):
        (this rank's Batch, pairs in the global batch)."""
        per = self.global_batch // dp_size
        for first in range(0, self.n_windows, self.global_batch):
            ids = list(range(first, min(first + self.global_batch, self.n_windows)))
            ids += [NO_PAIR] * (self.global_batch - len(ids))
            yield self.rows(ids[dp_rank * per:(dp_rank + 1) * per]), sum(i != NO_PAIR for i in ids)

    def loss_fraction(self) -> float:
        scored = sum(int(mask[1:self.seq_len + 1].sum()) for _, _, (_, mask) in _sequences(self.pairs))
        return scored / (2 * self.n_windows * self.seq_len)

    def padding_fraction(self) -> float:
        used = sum(min(len(ids), self.seq_len + 1) for _, _, (ids, _) in _sequences(self.pairs))
        return 1.0 - used / (2 * self.n_windows * (self.seq_len + 1))


def _sequences(pairs: PreferencePairs):
    for n in range(len(pairs)):
        yield "chosen", n, pairs.chosen[n]
        yield "rejected", n, pairs.rejected[n]
