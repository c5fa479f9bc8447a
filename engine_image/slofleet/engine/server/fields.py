"""The field types every OpenAI request body shares: strict models, checked text, token ids."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from ..sampling_params import INT32_MAX, unicode_problem


def refuse(msg: str | None) -> None:
    """A field's problem as a pydantic error, so the 400 names the field (its loc) and says what is wrong."""
    if msg:
        raise PydanticCustomError("invalid_value", msg)


def _valid_unicode(v):
    refuse(unicode_problem(v) if isinstance(v, str) else None)
    return v


def _text_type(max_length: int | None = None):
    return Annotated[str, Field(max_length=max_length), BeforeValidator(_valid_unicode)]


Text, ShortText = _text_type(), _text_type(256)
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]


def token_ids_problem(ids: list) -> str | None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return "token ids must be integers"
    bad = [t for t in ids if not 0 <= t <= INT32_MAX]
    return f"token ids must be >= 0, got {bad[:5]}" if bad else None


def text_or_ids_problem(p) -> str | None:
    if isinstance(p, str):
        return unicode_problem(p)
    if isinstance(p, list) and not any(isinstance(x, (str, list)) for x in p):
        return token_ids_problem(p)
    return "must be a string, a list of token ids, or a one-element list holding either"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False
