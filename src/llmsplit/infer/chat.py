"""Chat messages -> prompt token ids, with the model's own chat template.

Templates are Jinja, as `transformers` and llama.cpp render them: the model's template comes
from its tokenizer files or GGUF metadata; a model without one (a training run, a base
model) gets a plain "Role: text" transcript, which is also Jinja so both go one way. Templates
run in Jinja's immutable sandbox because they arrive with downloaded model files; the server
renders them off its event loop under a time limit (time_limit.py), which stops any loop, and
the sandbox here refuses the single operations no time limit can stop: `**` and `*` whose
result would be huge (`9**9**9` runs in C for hours; Jinja would even fold it while compiling).
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


MAX_OPERATION_SIZE = 10_000_000  # characters, items or bits one `*` or `**` in a template may make


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})  # also keeps Jinja from folding them while compiling

    def call_binop(self, context, operator, left, right):
        if _result_size(operator, left, right) > MAX_OPERATION_SIZE:
            raise TemplateError(f"the model's chat template asked for a value larger than {MAX_OPERATION_SIZE:,} "
                                f"characters, items or bits ({type(left).__name__} {operator} "
                                f"{type(right).__name__}); fix chat_template in its tokenizer files")
        return super().call_binop(context, operator, left, right)


def _result_size(operator: str, left, right) -> int:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**":
        return right * left.bit_length() if ints and abs(left) > 1 else 0
    if ints:
        return left.bit_length() + right.bit_length()
    if isinstance(right, int) and hasattr(left, "__len__"):
        return len(left) * right
    if isinstance(left, int) and hasattr(right, "__len__"):
        return len(right) * left
    return 0


@lru_cache(maxsize=4)
def compile_template(source: str):
    def raise_exception(message):
        raise TemplateError(message)

    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except JinjaError as e:
        raise ConfigError(f"the model's chat template does not compile ({e}); fix chat_template in its "
                          f"tokenizer files") from None


def chat_prompt(messages: list[dict], tokenizer) -> tuple[list[int], list[str]]:
    """Token ids of the conversation followed by the assistant's turn, and the stop strings
    the template implies."""
    text = render_chat(messages, tokenizer)
    return tokenizer.encode(text), ([] if tokenizer.chat_template else list(DEFAULT_STOP))


def render_chat(messages: list[dict], tokenizer) -> str:
    """The conversation as the model's template writes it, ending where the assistant's turn
    begins (what `generate --chat --show-prompt` prints)."""
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
    return text
