"""OpenAI request bodies (pydantic), and their translation into engine SamplingParams.

Every field is checked here, strictly (no "5" for 5, no "yes" for true, no NaN), before anything reaches the
engine thread; the sampling fields with sampling_params.problem, so the words match SamplingParams' own. Unknown
fields are refused, and OpenAI parameters the engine does not implement are refused by name: a silently ignored
parameter is a wrong answer the user cannot see."""
from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ..sampling_params import INT32_MAX, SamplingParams, problem, unicode_problem

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output")


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


class SamplingFields(Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""
    model: ShortText
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list)  # a single string arrives as a list of one
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: ShortText | None = None
    # vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)  # the vocabulary bound is the engine's to check
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: Int32 | None = None

    @field_validator(*SAMPLING_FIELDS, mode="before")
    @classmethod
    def _sampling(cls, v, info: ValidationInfo):
        if info.field_name == "stop" and not isinstance(v, list):
            v = [] if v is None else [v] if isinstance(v, str) else v
        refuse(problem(info.field_name, v))
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream"):
            refuse("only applies to streaming: set stream to true or leave stream_options out")
        return v

    def unsupported(self) -> list[str]:
        """OpenAI parameters accepted by the schema but not implemented by the engine."""
        out = []
        if self.n != 1:
            out.append("n (only n=1)")
        if self.logit_bias:
            out.append("logit_bias")
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, min_tokens=self.min_tokens,
            seed=self.seed, stop=list(self.stop), stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v):
        prompts = v if isinstance(v, list) and any(isinstance(x, (str, list)) for x in v) else [v]
        refuse(next(filter(None, map(text_or_ids_problem, prompts)), None))
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        refuse(problem("logprobs", v))
        return v

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name, bad in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                                       ("suffix", bool(self.suffix))) if bad]
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            out.append("prompt as a list of several prompts (send one prompt per request)")
        return out

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p


class TextPart(Strict):
    type: Literal["text"]
    text: Text


def content_problem(content) -> str | None:
    if content is None or isinstance(content, str):
        return None if content is None else unicode_problem(content)
    if not isinstance(content, list):
        return 'must be a string or a list of {"type": "text", "text": "..."} parts'
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind != "text":
            return f"part {i} is of type {kind[:40]!a}, which is not supported: send text parts only"
        if not (isinstance(part, dict) and part.keys() == {"type", "text"} and isinstance(part["text"], str)):
            return f'part {i} must be {{"type": "text", "text": "..."}} (a string text, no other keys)'
        msg = unicode_problem(part["text"])
        if msg:
            return f"part {i} text {msg}"
    return None


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart] | None = None
    name: ShortText | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        refuse(content_problem(v))
        return v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("max_completion_tokens", mode="before")
    @classmethod
    def _max_completion_tokens(cls, v):
        refuse(problem("max_tokens", v))
        return v

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _top_logprobs(cls, v, info: ValidationInfo):
        refuse(problem("logprobs", v))
        if v is not None and info.data.get("logprobs") is not True:
            refuse("needs logprobs: true (it is the number of alternatives logprobs lists)")
        return v

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
                if getattr(self, name) is not None]
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            out.append("response_format (text only)")
        return out

    def resolved_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def resolved_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class PrefillRequest(Strict):
    """Decode engine -> prefill engine: compute this prompt and hand its KV back (KV hand-off over HTTP).
    `sampling` is SamplingParams' fields, which check themselves."""
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)

    @field_validator("prompt_token_ids", mode="before")
    @classmethod
    def _ids(cls, v):
        refuse(token_ids_problem(v) if isinstance(v, list) else None)
        return v

    @field_validator("sampling")
    @classmethod
    def _known(cls, v):
        unknown = sorted(v.keys() - {f.name for f in fields(SamplingParams)})
        refuse(f"unknown field(s): {', '.join(map(ascii, unknown[:5]))}" if unknown else None)  # ascii: keys echo
        return v
