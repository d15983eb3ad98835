"""Chat messages -> prompt token ids, with the model's own chat template.

Templates are Jinja, as `transformers` and llama.cpp render them: the model's template comes
from its tokenizer files or GGUF metadata; a model without one (a training run, a base
model) gets a plain "Role: text" transcript, which is also Jinja so both go one way. Templates
run in Jinja's immutable sandbox because they arrive with downloaded model files.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError as JinjaError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..config import ConfigError

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")
# A plain transcript has no end-of-turn token, so the model's next "User:" turn ends the reply.
DEFAULT_STOP = ["\nUser:"]


class TemplateError(ValueError):
    """The messages do not fit the model's template (e.g. roles that must alternate)."""


@lru_cache(maxsize=4)
def compile_template(source: str):
    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except JinjaError as e:
        raise ConfigError(f"the model's chat template does not compile ({e}); fix chat_template in its "
                          f"tokenizer files") from None


def chat_prompt(messages: list[dict], tokenizer) -> tuple[list[int], list[str]]:
    """Token ids of the conversation followed by the assistant's turn, and the stop strings
    the template implies."""
    source = tokenizer.chat_template or DEFAULT_TEMPLATE
    try:
        text = compile_template(source).render(messages=messages, add_generation_prompt=True,
                                       bos_token=tokenizer.token_text(tokenizer.bos_id),
                                       eos_token=tokenizer.token_text(tokenizer.eos_id))
    except TemplateError:
        raise
    except Exception as e:  # a template may fail on any message shape it does not expect
        raise TemplateError(f"the model's chat template failed on these messages ({e})") from None
    bos = tokenizer.token_text(tokenizer.bos_id)
    if getattr(tokenizer, "add_bos", False) and bos and text.startswith(bos):
        text = text[len(bos):]  # encode() adds the BOS itself; two would confuse the model
    return tokenizer.encode(text), ([] if tokenizer.chat_template else list(DEFAULT_STOP))
