"""What the router reads of a request and writes back without an upstream: the OpenAI body's routing fields,
error bodies, and raw ASGI helpers."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from slofleet.api import contract


@dataclass(slots=True, kw_only=True)
class Prompt:
    text: str  # flattened: chat messages joined, token ids as their decimal text
    ids: int | None  # the token count when the prompt is already token ids


class RoutedBody(BaseModel):
    """The fields the router reads; the rest passes through untouched for the engine to validate."""
    model_config = ConfigDict(extra="allow")
    prompt: str | list[Any] | None = None
    messages: list[dict[str, Any]] | None = None
    # Quotas are charged for them up front: a JSON integer >= 1 (a negative one would refill the key's budget).
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    # /v1/responses (input, instructions, max_output_tokens) and /v1/embeddings (input)
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, strict=True)

    def flat_prompt(self) -> Prompt:
        """The flattened prompt text, and its token count when the prompt is already token ids."""
        if self.input is not None:
            return self.flat_input()
        if self.messages is not None:
            parts = []
            for m in self.messages:
                c = m.get("content")
                if isinstance(c, list):
                    c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
                parts.append(f"{m.get('role', '')}\n{c or ''}\n")
            return Prompt(text="".join(parts), ids=None)
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list):
            return Prompt(text=",".join(map(str, p)), ids=len(p))
        return Prompt(text=p or "", ids=None)

    def flat_input(self) -> Prompt:
        """/v1/responses' messages or /v1/embeddings' inputs, as one text (token ids as a count)."""
        items = [self.input] if isinstance(self.input, str) or (
            self.input and not isinstance(self.input[0], (str, list, dict))) else self.input
        texts, ids = [self.instructions or ""], 0
        for item in items:
            if isinstance(item, dict):  # a message: content is a string or a list of text parts
                c = item.get("content")
                item = "".join(p.get("text", "") for p in c if isinstance(p, dict)) if isinstance(c, list) else c
            if isinstance(item, list):
                ids += len(item)
            else:
                texts.append(str(item or ""))
        return Prompt(text="\n".join(texts), ids=ids or None)

    def output_tokens(self) -> int | None:
        if self.max_output_tokens is not None:
            return self.max_output_tokens
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps(contract.error_body(message, kind, code=status)).encode()


def sse_error(status: int, message: str, kind: str) -> bytes:
    """The event that ends a stream cut after its first byte (the openai client raises it as an APIError)."""
    return b"data: " + error_body(status, message, kind) + b"\n\n"


async def respond(send, status: int, body: bytes, content_type: bytes = b"application/json",
                  headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def headers_of(scope) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}  # ASGI's names are lower-case


def with_field(raw: bytes, data: dict, name: str, value) -> bytes:
    """A JSON object's text (`raw`, parsed as `data`) with one more top-level field: spliced before the closing
    brace when `raw` is an ASCII-compatible object without that field (re-encoding all of it costs more), else
    re-encoded."""
    text = raw.strip()
    if data and name not in data and text[:1] == b"{" and text[-1:] == b"}":
        return b'%s,"%s":%s}' % (text[:-1], name.encode(), json.dumps(value).encode())
    return json.dumps({**data, name: value}).encode()


def internal_auth() -> dict[str, str]:
    """The header on every request to an engine: the service's internal token (contract.INTERNAL_TOKEN_ENV, from the
    operator's Secret), which engines ask of /v1/*; none where it is unset. A client's own Authorization is the
    router's to check and never reaches an engine."""
    token = os.environ.get(contract.INTERNAL_TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}
