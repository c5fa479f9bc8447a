"""POST /v1/responses: OpenAI's Responses API over the chat path, without server-side state.

`input` (a string or a list of messages) and `instructions` become a chat conversation rendered by the model's
template; the answer is one `message` output item. Nothing is stored, so `store: true` and `previous_response_id`
are refused by name rather than silently forgotten. Streaming sends the Responses events (`event:` + `data:`),
each with its sequence number, ending with `response.completed` (or `response.incomplete`)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from ..engine import LLMEngine, RequestOutput
from ..errors import InvalidRequest
from ..request import FinishReason
from ..request import Request as EngineRequest
from ..sampling_params import SamplingParams, problem
from .fields import ShortText, Strict, Text, refuse
from .protocol import content_problem

TEXT_PARTS = ("input_text", "output_text", "text")


class InputPart(Strict):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None  # an earlier answer's output_text, sent back in the history


class InputMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputPart]
    id: ShortText | None = None
    status: ShortText | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        if isinstance(v, list):  # the text parts of the Responses API, checked as chat's after renaming their type
            kinds = [p.get("type") if isinstance(p, dict) else None for p in v]
            bad = next((k for k in kinds if k not in TEXT_PARTS), None)
            refuse(f"part of type {str(bad)[:40]!a} is not supported: send input_text parts" if bad else None)
            refuse(content_problem([{"type": "text", "text": p.get("text")} for p in v]))
        return v

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(Strict):
    model: ShortText
    input: Text | list[InputMessage] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stream: bool = False
    store: bool = False
    previous_response_id: ShortText | None = None
    metadata: dict[str, ShortText] | None = None
    user: ShortText | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    priority: int | None = None  # vLLM's extra, as on chat

    @field_validator("max_output_tokens", "temperature", "top_p", mode="before")
    @classmethod
    def _sampling(cls, v, info):
        refuse(problem("max_tokens" if info.field_name == "max_output_tokens" else info.field_name, v))
        return v

    def unsupported(self) -> list[str]:
        out = [name for name, bad in (
            ("store (this server keeps no responses: send store false)", self.store),
            ("previous_response_id (this server keeps no responses: send the history in input)",
             self.previous_response_id is not None),
            ("tools (use /v1/chat/completions)", bool(self.tools)),
            ("tool_choice (use /v1/chat/completions)", self.tool_choice not in (None, "none", "auto")),
            ("text.format (text only)", (self.text or {}).get("format", {"type": "text"}) != {"type": "text"}))
            if bad]
        return out

    def messages(self) -> list[dict[str, str]]:
        turns = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.input]
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + turns

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_output_tokens)


def prompt_of(engine: LLMEngine, body: ResponsesRequest) -> list[int]:
    try:
        return engine.tokenizer.apply_chat_template(body.messages(), add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    except Exception as e:  # the model's template refuses this conversation
        raise InvalidRequest(f"input: {e}", "input") from None


class Shaper:
    """The response object and its stream events for one request."""

    def __init__(self, engine: LLMEngine, body: ResponsesRequest, req: EngineRequest, rid: str):
        self.engine, self.body, self.req = engine, body, req
        self.id, self.item_id, self.created = f"resp_{rid}", f"msg_{rid}", int(time.time())
        self.seq = 0

    def response(self, status: str, text: str | None) -> dict:
        b, out = self.body, len(self.req.output_token_ids)
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.engine.model_name, "output": [] if text is None else [self.item(status, text)],
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "temperature": b.temperature,
                "top_p": b.top_p, "metadata": b.metadata or {}, "user": b.user, "store": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "parallel_tool_calls": bool(b.parallel_tool_calls), "tool_choice": "auto", "tools": [],
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "previous_response_id": None,
                "usage": None if text is None else {
                    "input_tokens": self.req.num_prompt_tokens, "output_tokens": out,
                    "total_tokens": self.req.num_prompt_tokens + out,
                    "input_tokens_details": {"cached_tokens": self.req.num_cached_tokens},
                    "output_tokens_details": {"reasoning_tokens": 0}}}

    def item(self, status: str, text: str | None) -> dict:
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status,
                "content": [] if text is None else [self.part(text)]}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    @staticmethod
    def status(outs: list[RequestOutput]) -> str:
        return "incomplete" if outs[-1].finish_reason is FinishReason.LENGTH else "completed"

    async def full(self, results: AsyncIterator[RequestOutput]) -> dict:
        outs = [out async for out in results]
        return self.response(self.status(outs), "".join(o.new_text for o in outs))

    async def events(self, results: AsyncIterator[RequestOutput]):
        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=self.response("in_progress", None))
        yield self.event("response.in_progress", response=self.response("in_progress", None))
        yield self.event("response.output_item.added", output_index=0, item=self.item("in_progress", None))
        yield self.event("response.content_part.added", **at, part=self.part(""))
        texts, status = [], "completed"
        try:
            async for out in results:
                if out.new_text:
                    texts.append(out.new_text)
                    yield self.event("response.output_text.delta", **at, delta=out.new_text, logprobs=[])
                status = self.status([out])
        except Exception as e:  # headers are sent: the error is the stream's last event
            yield self.event("error", code="server_error", message=str(e), param=None)
            return
        text = "".join(texts)
        yield self.event("response.output_text.done", **at, text=text, logprobs=[])
        yield self.event("response.content_part.done", **at, part=self.part(text))
        yield self.event("response.output_item.done", output_index=0, item=self.item(status, text))
        yield self.event(f"response.{status}", response=self.response(status, text))


async def responses(request: Request) -> Response:
    from .api import body_of, respond, start  # api.py registers this route: imported here, not at module level

    body: ResponsesRequest = await body_of(request, ResponsesRequest)
    engine, req, outs = await start(request, body, lambda e: prompt_of(e, body), body.sampling_params)
    shaper = Shaper(engine, body, req, request.state.request_id)
    return await respond(request, body.stream, lambda: shaper.events(outs), lambda: shaper.full(outs))
