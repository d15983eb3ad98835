"""Chat and instruction data: JSONL rows with "messages" (roles system, user, assistant, tool)
or "prompt"/"completion", rendered with the model's own chat template, and the mask of the
tokens that carry loss.

The mask comes from the template's own output, never from guessing role markers:
  - a template with `{% generation %}` markers says itself which text trains: those spans;
  - without markers, the text of assistant turn i is what rendering messages[:i+1] adds to
    rendering messages[:i] with the generation prompt (the assistant's header belongs to the
    prompt, the reply and its end-of-turn to the assistant).
Either way the characters are turned into tokens by tokenizing prefixes of the rendered text:
a prefix's tokens must be the first tokens of the whole (else a token straddles the boundary),
and each incremental render must be a prefix of the full one (else the template writes earlier
turns differently once later ones follow). Where either fails no correct mask exists, and the
data is refused in one sentence instead of silently trained on all or none of its tokens (the
failure TRL and Megatron users report most).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..io.template_process import TemplateLimits

# The default limits of one render, fixed for training data: a template that needs more than
# 10 s or 1 GiB for one conversation is broken, and the message says to fix it.
TRAINING_LIMITS = TemplateLimits(seconds_name=None, bytes_name=None)
ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("assistant", "all")


@dataclass
class Documents:
    """Token documents one after another: `tokens`, the loss `mask` (1 = the token is a
    target that carries loss; None = every token does) and `offsets` (document i is
    tokens[offsets[i]:offsets[i+1]])."""

    tokens: np.ndarray
    mask: np.ndarray | None
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def loss_fraction(self) -> float:
        if self.mask is None:
            return 1.0
        return float(np.asarray(self.mask).mean()) if len(self.mask) else 0.0


def read_conversations(path: Path) -> list[list[dict]]:
    """One conversation (a list of messages) per non-empty line of a .jsonl file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {str(path)!r} as UTF-8 text ({e}); check the path") from None
    out = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            out.append(_conversation(line, f"{str(path)!r} line {n}"))
    return out


def jsonl_lines(files: list[Path], key: str, what: str, wanted: str):
    """(where, line) of each non-blank line of `key`'s .jsonl files; a missing or unreadable file,
    or none holding a row, is refused (`what` names the rows, `wanted` what a row holds)."""
    found = False
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{key}={str(path)!r} does not exist; pass a .jsonl file of {what} rows")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {str(path)!r} as UTF-8 text ({e}); check {key}") from None
        for n, line in enumerate(lines, 1):
            if line.strip():
                found = True
                yield f"{str(path)!r} line {n}", line
    if not found:
        raise ConfigError(f"{key} holds no {what} row; add JSONL rows with {wanted}")


def json_row(line: str, where: str, keys: str) -> dict:
    """One JSONL line as an object; `keys` says what it should hold, for the message."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise ConfigError(f"{where} is not valid JSON; each line must be an object with {keys}") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is not a JSON object; give it {keys}")
    return row


def _conversation(line: str, where: str) -> list[dict]:
    row = json_row(line, where, "\"messages\" or \"prompt\" and \"completion\"")
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        # TRL's two shapes: plain strings, or lists of messages ("conversational").
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
        messages = prompt + completion if isinstance(prompt, list) and isinstance(completion, list) else None
    else:
        raise ConfigError(f"{where} has neither \"messages\" nor \"prompt\" and \"completion\"; data.format=\"chat\" "
                          f"reads those (use data.format=\"text\" for rows with \"text\")")
    return check_messages(messages, where)


def check_messages(messages, where: str) -> list[dict]:
    """`messages` if it is a non-empty list of messages with known roles, else refused."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: the messages must be a non-empty list of {{\"role\", \"content\"}} objects")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ConfigError(f"{where}: every message needs a \"role\" among {', '.join(ROLES)}, got "
                              f"{m.get('role') if isinstance(m, dict) else m!r}")
    return messages


def encode_conversation(messages: list[dict], tokenizer, loss_on: str, where: str = "a conversation"):
    """(token ids, loss mask per token) of one conversation in the model's template."""
    from ..io.chat_template import TemplateError, render_chat

    try:
        text, marked = render_chat(messages, tokenizer, add_generation_prompt=False, spans=True,
                                   limits=TRAINING_LIMITS)
        spans = marked if marked is not None else _assistant_spans(messages, tokenizer, text, where)
    except TemplateError as e:
        raise ConfigError(f"{where}: {e}; fix the data or the template") from None
    ids = tokenizer.encode(text)
    mask = np.zeros(len(ids), dtype=np.uint8)
    if loss_on == "all":
        mask[:] = 1
        return ids, mask
    if marked is not None and not marked and any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: the chat template's generation markers mark none of the assistant's text, "
                          f"so no token would carry loss; fix the template or set data.loss_on=\"all\"")
    for start, end in spans:
        a, b = _token_index(text, start, ids, tokenizer, where), _token_index(text, end, ids, tokenizer, where)
        mask[a:b] = 1
    return ids, mask


def _assistant_spans(messages, tokenizer, text: str, where: str) -> list[tuple[int, int]]:
    """Character spans of each assistant turn, by rendering prefixes of the conversation."""
    from ..io.chat_template import render_chat

    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(messages[:i], tokenizer, add_generation_prompt=True, limits=TRAINING_LIMITS)
        through = render_chat(messages[:i + 1], tokenizer, add_generation_prompt=False, limits=TRAINING_LIMITS)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(f"{where}: the chat template writes the turns before assistant message {i} differently "
                              f"once later messages follow, so no correct assistant mask can be derived from it; "
                              f"use a template with {{% generation %}} markers or set data.loss_on=\"all\"")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return spans


def _token_index(text: str, char: int, ids: list[int], tokenizer, where: str) -> int:
    """How many of `ids` (the tokens of `text`) come before character `char`."""
    if char >= len(text):
        return len(ids)
    head = tokenizer.encode(text[:char])
    if ids[:len(head)] != head:
        raise ConfigError(f"{where}: a token of the rendered chat straddles the start or end of an assistant "
                          f"turn (at character {char}), so no correct assistant mask exists for this tokenizer and "
                          f"template; set data.loss_on=\"all\"")
    return len(head)


def encode_chat_files(files: list[Path], tokenizer, loss_on: str) -> Documents:
    """Every conversation of the files as one document, and its loss mask."""
    tokens, masks, offsets = [], [], [0]
    for path in files:
        for n, messages in enumerate(read_conversations(path), 1):
            ids, mask = encode_conversation(messages, tokenizer, loss_on, f"{str(path)!r} conversation {n}")
            tokens.append(np.asarray(ids, dtype=np.int64))
            masks.append(mask)
            offsets.append(offsets[-1] + len(ids))
    if len(offsets) == 1:
        raise ConfigError("the chat files hold no conversation; pass .jsonl files with \"messages\" rows")
    docs = Documents(np.concatenate(tokens), np.concatenate(masks), np.asarray(offsets, dtype=np.int64))
    if not docs.mask.any():
        raise ConfigError("no token of the chat data carries loss (no assistant turn has text); add assistant "
                          "replies or set data.loss_on=\"all\"")
    return docs
