"""A request body, counted and then parsed: at most `--max-request-items` messages (or input
items), content parts (all messages together) and tools per request, checked before any item
is built.

The byte cap (`--max-request-size`) alone does not bound the work: 64 MiB hold 2 million short
messages, and parsing them as the routes do (pydantic models) took 28 s and 5 GiB before the
request was refused. A length rule in the model does not help, as pydantic builds every item
before checking any length (10^6 messages: 3.1 s and 814 MiB to refuse with `max_length`;
`json.loads` alone 0.5 s and 250 MiB; msgspec's own `max_length` too checks a list once it is
built: 16 bytes an item). So msgspec decodes the body against a shape whose items are empty
objects, their fields skipped unread, and each item counts itself as it is decoded
(`__post_init__`): the decode stops at the first item over the cap, having built at most
`--max-request-items` of them whatever the body holds. The body is parsed for real only when
the counts are within the cap.
"""

from __future__ import annotations

import json
import re
import threading
from typing import ClassVar

import msgspec
from pydantic import ValidationError

from .protocol import APIError


class _TooMany(Exception):
    """Raised from inside the decode by the first item over the cap (not a ValueError, which
    msgspec would turn into a ValidationError of the shape)."""

    def __init__(self, what: str, param: str):
        super().__init__(what)
        self.what, self.param = what, param


_tally = threading.local()  # this thread's decode: items counted by kind, and the cap


def _count(what: str, param: str) -> None:
    n = _tally.counts[what] = _tally.counts.get(what, 0) + 1
    if n > _tally.most:
        raise _TooMany(what, param)


class _Part(msgspec.Struct, gc=False):
    """A content part, its fields unread."""

    def __post_init__(self):
        _count("content parts", _tally.parent)


class _Tool(msgspec.Struct, gc=False):
    def __post_init__(self):
        _count("tools", "tools")


class _Message(msgspec.Struct, gc=False):
    """A message, its content kept unread (any JSON value) but for the parts of a list."""
    content: msgspec.Raw = msgspec.Raw(b"null")  # `Raw | None` would mean null only
    what: ClassVar[str] = "messages"
    param: ClassVar[str] = "messages"

    def __post_init__(self):
        _count(self.what, self.param)
        _tally.parent = self.param  # its parts are named by it
        if memoryview(self.content)[:1] == b"[":  # a raw value starts at its first byte
            try:
                _parts.decode(self.content)
            except msgspec.ValidationError:
                pass  # not a list of parts: the parse refuses it by name


class _InputItem(_Message, gc=False):
    """An item of the Responses API's `input`: a message by another name."""
    what: ClassVar[str] = "input items"
    param: ClassVar[str] = "input"


class _Shape(msgspec.Struct):
    messages: list[_Message] | None = None
    input: str | list[_InputItem] | None = None
    tools: list[_Tool] | None = None


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_body = msgspec.json.Decoder(_Shape)
_parts = msgspec.json.Decoder(list[_Part])


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
    """A 400 when the body holds more than `most` messages (or input items), content parts or
    tools. A body of another shape, or not JSON, passes: the parse that follows names what is
    wrong with it."""
    _tally.counts, _tally.most = {}, most
    try:
        _body.decode(body)
    except _TooMany as e:
        raise APIError(400, f"the request holds more than {most:,} {e.what}; this server takes at most {most:,} "
                            f"per request (--max-request-items)", e.param, code="request_too_large") from None
    except msgspec.ValidationError:  # JSON, not a chat request's shape (a DecodeError too: caught first)
        return
    except msgspec.DecodeError as e:
        if _SURROGATE_ESCAPE.search(body):
            return  # msgspec refuses lone UTF-16 surrogates; the parse finds them and names the field
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    finally:
        _tally.counts = {}
