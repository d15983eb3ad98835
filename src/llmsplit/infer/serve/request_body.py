"""A request body, counted and then parsed: at most `--max-request-items` messages, content
parts (all messages together) and tools per request, checked before any item is built.

The byte cap (`--max-request-size`) alone does not bound the work: 64 MiB hold 2 million short
messages, and parsing them as the routes do (pydantic models) took 28 s and 5 GiB before the
request was refused. A length rule in the model does not help, as pydantic builds every item
before checking any length (10^6 messages: 3.1 s and 814 MiB to refuse with `max_length`;
`json.loads` alone 0.5 s and 250 MiB). msgspec decodes the body against a shape whose items are
empty 16-byte objects, their fields skipped unread: 10^6 messages in a 32 MiB body are counted in
0.11 s with a 23 MiB peak, and the body is parsed for real only when the counts are within the cap.
"""

from __future__ import annotations

import json
import re

import msgspec
from pydantic import ValidationError

from .protocol import APIError


class _Bare(msgspec.Struct, gc=False):
    """Any JSON object, its fields skipped unread: 16 bytes for each item counted."""


class _Shape(msgspec.Struct):
    messages: list[_Bare] | None = None
    tools: list[_Bare] | None = None


class _Message(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw(b"null")  # any JSON value, kept unread (`Raw | None` would mean null only)


class _Messages(msgspec.Struct):
    messages: list[_Message]


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_body = msgspec.json.Decoder(_Shape)
_messages = msgspec.json.Decoder(_Messages)
_parts = msgspec.json.Decoder(list[_Bare])


def parse_body(raw: bytes, kind, most: int):
    """The body as `kind` (a protocol request model), once its structure is within `most`; a
    400 naming the field for anything it does not accept."""
    check_shape(raw, most)
    try:  # json.loads, not pydantic's parser: it keeps lone surrogates, which are then named by field
        body = kind.model_validate(json.loads(raw))
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except ValidationError as e:
        raise validation_error(e) from None
    body.refuse_unsupported()
    return body


def validation_error(e) -> APIError:
    """The 400 for pydantic's (or FastAPI's) first complaint about a body."""
    first = e.errors()[0]
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON ({first.get('msg')})")
    if not where:
        return APIError(400, f"the request body must be a JSON object ({first.get('msg')})")
    param = ".".join(where)
    return APIError(400, f"{param}: {first.get('msg')}", param)


def check_shape(body: bytes, most: int) -> None:
    """A 400 when the body holds more than `most` messages, content parts or tools. A body of
    another shape, or not JSON, passes: the parse that follows names what is wrong with it."""
    try:
        shape = _body.decode(body)
    except msgspec.ValidationError:  # JSON, not a chat request's shape (a DecodeError too: caught first)
        return
    except msgspec.DecodeError as e:
        if _SURROGATE_ESCAPE.search(body):
            return  # msgspec refuses lone UTF-16 surrogates; the parse finds them and names the field
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    messages = shape.messages or []
    for what, count in (("messages", len(messages)), ("tools", len(shape.tools or []))):
        _check(what, count, most)
    if not messages:
        return
    parts = 0  # counted once the messages are few: a second pass that reads each content's start
    for message in _messages.decode(body).messages:
        if memoryview(message.content)[:1] == b"[":  # a raw value starts at its first byte
            try:
                parts += len(_parts.decode(message.content))
            except msgspec.ValidationError:
                continue  # not a list of parts: the parse refuses it by name
    _check("content parts", parts, most, "messages")


def _check(what: str, count: int, most: int, param: str | None = None) -> None:
    if count > most:
        raise APIError(400, f"the request holds {count:,} {what}; this server takes at most {most:,} per request "
                            f"(--max-request-items)", param or what, code="request_too_large")
