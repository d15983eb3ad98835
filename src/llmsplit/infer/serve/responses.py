"""OpenAI's Responses API on the same server (`llmsplit serve`): POST /v1/responses, the subset
vLLM serves. Stateless: no response is stored (`store` is accepted and changes nothing), so
`previous_response_id` is a 400; tools are not offered here yet (use /v1/chat/completions).

The route is mixed into the server (`ResponsesRoutes`), as Ollama's are: its body parsed
(request_body.py) into responses_protocol.py's model, its messages through the model's chat
template under the same limits, `text.format` through the same grammars, its sequence to the
same engine thread. Only the shapes differ: the reply object, and the stream's typed
server-sent events (`Answer`), each with its sequence_number.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..chat import chat_prompt
from .channel import Channel
from .engine_thread import Request as Work
from .protocol import check_fits
from .responses_protocol import ResponsesRequest


class Answer:
    """One request's Responses-shaped objects: the response, and its stream's events."""

    def __init__(self, model: str, body: ResponsesRequest, prompt_tokens: int):
        self.model, self.body, self.prompt_tokens = model, body, prompt_tokens
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0
        self.text = ""

    def response(self, seq=None, status: str = "in_progress") -> dict:
        """The response object: in progress (no output yet), or with the finished `seq`."""
        b = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": [], "instructions": b.instructions,
               "max_output_tokens": b.max_output_tokens, "temperature": b.temperature, "top_p": b.top_p,
               "text": {"format": b.text.format.model_dump(by_alias=True, exclude_none=True)
                        if b.text and b.text.format else {"type": "text"}},
               "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "previous_response_id": None,
               "store": False, "metadata": b.metadata or {}, "truncation": "disabled", "background": False,
               "error": None, "incomplete_details": None, "usage": None}
        if seq is None:
            return out
        cut = seq.finish_reason == "length"
        output = len(seq.tokens)
        out.update(status="incomplete" if cut else "completed", output=[self.item(seq.text, "incomplete" if cut else "completed")],
                   incomplete_details={"reason": "max_output_tokens"} if cut else None,
                   usage={"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": self.prompt_tokens + output})
        return out

    def item(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> str:
        """One server-sent event, numbered in the order sent."""
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        where = {"item_id": self.message_id, "output_index": 0}
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response()),
                self.event("response.output_item.added", output_index=0, item=self.item(None, "in_progress")),
                self.event("response.content_part.added", **where, content_index=0, part=self.part(""))]

    def delta(self, text: str) -> str:
        self.text += text
        return self.event("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                          delta=text, logprobs=[])

    def closing(self, seq) -> list[str]:
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        done = self.response(seq)
        return [self.event("response.output_text.done", **where, text=seq.text, logprobs=[]),
                self.event("response.content_part.done", **where, part=self.part(seq.text)),
                self.event("response.output_item.done", output_index=0, item=done["output"][0]),
                self.event(f"response.{done['status']}", response=done)]


class ResponsesRoutes:
    """The Responses route, mixed into the server: it uses its parsing, templates, grammars and
    engine thread (self._parse, self._off_loop, self._grammar, self.scheduler ...)."""

    def add_responses_routes(self, app) -> None:
        app.post("/v1/responses")(self.responses)

    async def responses(self, request: Request):
        body = await self._parse(request, ResponsesRequest)
        adapter = self._adapter(body.model)
        ids, stops = await self._off_loop("input", "rendering the chat template", chat_prompt, body.messages(),
                                          self.tokenizer, None, self.template_limits)
        max_tokens = body.max_output_tokens or max(1, self.scheduler.max_context - len(ids))
        check_fits([len(ids)], max_tokens, self.scheduler.max_context, self._most_sequences(), "input")
        params = body.sampling(max_tokens, stops, self.model.config.vocab_size)
        params.grammar = await self._grammar(body.response_format())
        channel = Channel(asyncio.get_running_loop())
        work = self.scheduler.submit([ids], params, channel.put, stream=body.stream, adapter=adapter)
        answer = Answer(self.models[adapter], body, len(ids))
        if body.stream:
            return StreamingResponse(self._response_events(work, channel, answer), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        done = await channel.finished(request.receive, 1, lambda: self.scheduler.abort(work))
        return None if done is None else answer.response(done[0])  # None: the client left

    async def _response_events(self, work: Work, channel: Channel, answer: Answer):
        pending = True
        try:
            for line in answer.opening():
                yield line
            while pending:
                event = await channel.queue.get()
                if event[0] == "text":
                    if event[2]:
                        yield answer.delta(event[2])
                    continue
                pending = False
                if event[0] == "finish":
                    for line in answer.closing(event[2]):
                        yield line
                else:
                    yield answer.event("error", code="server_error", message=event[1], param=None)
        finally:
            if pending:  # the client went away mid-stream (this generator was cancelled)
                self.scheduler.abort(work)
