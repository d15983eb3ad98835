"""The model's own chat template, rendered as `transformers` and llama.cpp render it: the one
place where Jinja templates run, for prompts (infer/chat.py) and for training data
(data/chat.py).

The template comes from the tokenizer files or GGUF metadata; a model without one (a training
run, a base model) gets a plain "Role: text" transcript, which is also Jinja so both go one way.
Templates arrive with downloaded model files, so they run in Jinja's immutable sandbox, in a
child process that a time limit and a memory limit stop (io/template_process.py); the sandbox
here also refuses `**` and `*` whose result would be huge before they run (`9**9**9` runs in C for
hours; Jinja would even fold it while compiling, which happens in the parent at a server's start).

`{% generation %}...{% endgeneration %}` (transformers' marker for the text an assistant turn
trains on) is understood: `render_chat(..., spans=True)` returns the character spans it marked.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache

from ..errors import ConfigError
from .template_process import TemplateError, TemplateLimitError, TemplateLimits, render

__all__ = ["DEFAULT_TEMPLATE", "TemplateError", "TemplateLimitError", "TemplateLimits", "compile_template",
           "render_chat", "render_request"]

DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")

MAX_OPERATION_SIZE = 10_000_000  # characters, items or bits one `*` or `**` in a template may make
# Private-use characters that the generation marker writes around what it marks, found and
# removed after rendering: the positions of text a template wrote are known only then.
GEN_OPEN, GEN_CLOSE = "\ue000", "\ue001"


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
    from jinja2 import TemplateError as JinjaError
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})  # also keeps Jinja from folding them while compiling

        def call_binop(self, context, operator, left, right):
            if _result_size(operator, left, right) > MAX_OPERATION_SIZE:
                raise TemplateError(f"the model's chat template asked for a value larger than "
                                    f"{MAX_OPERATION_SIZE:,} characters, items or bits ({type(left).__name__} "
                                    f"{operator} {type(right).__name__}); fix chat_template in its tokenizer files")
            return super().call_binop(context, operator, left, right)

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return GEN_OPEN + caller() + GEN_CLOSE

    def raise_exception(message):
        raise TemplateError(message)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except JinjaError as e:
        raise ConfigError(f"the model's chat template does not compile ({e}); fix chat_template in its "
                          f"tokenizer files") from None


def render_chat(messages: list[dict], tokenizer, add_generation_prompt: bool = True, spans: bool = False,
                tools: list[dict] | None = None, limits: TemplateLimits | None = None):
    """The conversation as the model's template writes it; with `add_generation_prompt`,
    ending where the assistant's turn begins (what `generate --chat --show-prompt` prints).
    With `spans`, (text, [(start, end) of each non-empty span a generation marker wrote], or
    None when the template has no markers). Rendered in a child process within `limits`
    (default: 10 s and 1 GiB, raised by --template-timeout and --template-max-bytes)."""
    request = {"source": tokenizer.chat_template or DEFAULT_TEMPLATE, "messages": messages,
               "add_generation_prompt": add_generation_prompt, "tools": tools,
               "bos_token": tokenizer.token_text(tokenizer.bos_id), "eos_token": tokenizer.token_text(tokenizer.eos_id)}
    text = render(request, limits or TemplateLimits())
    bos = request["bos_token"]
    if getattr(tokenizer, "add_bos", False) and bos and text.startswith(bos):
        text = text[len(bos):]  # encode() adds the BOS itself; two would confuse the model
    text, marked = _strip_markers(text)
    return (text, marked) if spans else text


def render_request(request: dict) -> str:
    """What render_chat's request renders to, markers and all: run in the template process."""
    extra = {"tools": request["tools"]} if request["tools"] else {}  # templates test `tools is defined` too
    try:
        template = compile_template(request["source"])
    except ConfigError as e:
        raise TemplateError(str(e)) from None
    try:
        return template.render(
            messages=request["messages"], add_generation_prompt=request["add_generation_prompt"],
            bos_token=request["bos_token"], eos_token=request["eos_token"], **extra)
    except (TemplateError, MemoryError):
        raise  # MemoryError: the process's memory limit, which the parent names
    except Exception as e:  # a template may fail on any message shape it does not expect
        raise TemplateError(f"the model's chat template failed on these messages ({e})") from None


def _strip_markers(text: str) -> tuple[str, list[tuple[int, int]] | None]:
    if GEN_OPEN not in text:
        return text, None
    out, marked, start, depth = [], [], 0, 0
    length = 0
    for ch in text:
        if ch == GEN_OPEN:
            depth += 1
            start = length if depth == 1 else start
        elif ch == GEN_CLOSE:
            depth -= 1
            if depth == 0 and length > start:
                marked.append((start, length))
        else:
            out.append(ch)
            length += 1
    return "".join(out), marked
