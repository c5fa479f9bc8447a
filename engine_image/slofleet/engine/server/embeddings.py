"""POST /v1/embeddings: the model's normalised mean-pooled last hidden state (pooling.py), per input, as OpenAI's
embeddings API answers: floats, or base64 of little-endian float32 (what the openai client asks for by default)."""
from __future__ import annotations

import base64
import struct
from typing import Literal

from fastapi import Request
from pydantic import Field, field_validator

from ..engine import LLMEngine
from ..errors import InvalidRequest
from ..pooling import embed
from .fields import ShortText, Strict, refuse, text_or_ids_problem
from .http import ApiError, from_engine

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(Strict):
    model: ShortText
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: ShortText | None = None
    priority: int | None = None  # the router's bucket priority; an embedding runs between steps, ahead of all

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        items = v if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v) else [v]
        refuse(f"takes at most {MAX_INPUTS} inputs, got {len(items)}" if len(items) > MAX_INPUTS else None)
        refuse(next(filter(None, map(text_or_ids_problem, items)), None))
        return v

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]


def token_ids(engine: LLMEngine, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked against the model's context; InvalidRequest names the input."""
    out = []
    for i, item in enumerate(body.inputs()):
        ids = engine.tokenize(item)
        if not ids:
            raise InvalidRequest(f"input {i} is empty", "input")
        if len(ids) > engine.max_model_len:
            raise InvalidRequest(f"input {i} has {len(ids)} tokens; this model's context is {engine.max_model_len}",
                                 "input")
        out.append(ids)
    return out


def encode(vector: list[float], fmt: str) -> list[float] | str:
    return vector if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embeddings(request: Request) -> dict:
    state = request.app.state.slofleet
    engine = state.engine_or_503()
    from .api import body_of  # api.py registers this route: imported here, not at module level

    body = await body_of(request, EmbeddingRequest)
    if body.model not in engine.model_names:
        raise ApiError(400, f"model {body.model!r} is not served here (see /v1/models)", param="model")
    if body.dimensions is not None:
        raise ApiError(400, "unsupported parameter(s): dimensions (the model's hidden size is the only size)",
                       param="dimensions")
    try:
        ids = token_ids(engine, body)
    except InvalidRequest as e:
        raise from_engine(e) from None
    # on the engine's thread, between its steps: the model is not safe to run from two threads at once
    vectors = [await state.async_engine.call(lambda x=x: embed(engine.runner, x)) for x in ids]
    used = sum(map(len, ids))
    return {"object": "list", "model": engine.model_name, "usage": {"prompt_tokens": used, "total_tokens": used},
            "data": [{"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
                     for i, v in enumerate(vectors)]}
