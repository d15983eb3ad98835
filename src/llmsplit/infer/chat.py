"""Chat messages -> prompt token ids, with the model's own chat template (rendered by
io/chat_template.py, the one place templates run)."""

from __future__ import annotations

from ..io.chat_template import (
    DEFAULT_TEMPLATE,
    TemplateError,
    TemplateLimitError,
    TemplateLimits,
    compile_template,
    render_chat,
)

__all__ = ["DEFAULT_STOP", "DEFAULT_TEMPLATE", "TemplateError", "TemplateLimitError", "TemplateLimits", "chat_prompt",
           "compile_template", "render_chat"]

# A plain transcript has no end-of-turn token, so the model's next "User:" turn ends the reply.
DEFAULT_STOP = ["\nUser:"]


def chat_prompt(messages: list[dict], tokenizer, tools: list[dict] | None = None,
                limits: TemplateLimits | None = None) -> tuple[list[int], list[str]]:
    """Token ids of the conversation followed by the assistant's turn, and the stop strings
    the template implies; `tools` (OpenAI's tool objects) go to templates that render them."""
    text = render_chat(messages, tokenizer, tools=tools, limits=limits)
    return tokenizer.encode(text), ([] if tokenizer.chat_template else list(DEFAULT_STOP))
