"""Log-probabilities in OpenAI's two shapes: completions' parallel lists (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) and chat's list of per-token objects
(`content`: token, logprob, bytes, top_logprobs). The engine records them per token
(sequence.logprobs, sequence.prompt_logprobs: (log-probability, [(id, log-probability)])).

A token is shown as `decode([id])`, as vLLM shows it: a piece of a multi-byte character comes out
as U+FFFD, and `bytes` then holds what that text encodes to, not the raw token bytes.
"""

from __future__ import annotations


class TokenTexts:
    """decode([id]) of each token id, computed once per id."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token])
        return self.cache[token]


def completion_logprobs(text_of: TokenTexts, ids: list[int], entries: list, offset: int = 0) -> dict:
    """Completions' shape for tokens `ids` with their entries (None: no log-probability, as the
    prompt's first token); `offset`: where the first token's text starts in the choice's text.
    Each position's top_logprobs holds the likeliest tokens and the chosen one, as vLLM's do."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(ids, entries):
        text = text_of(token)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, top = entry
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append({**{text_of(t): v for t, v in top}, text: logprob})
    return out


def chat_logprobs(text_of: TokenTexts, ids: list[int], entries: list) -> dict:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    def item(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top]}
                        for token, (logprob, top) in zip(ids, entries)]}
