"""OpenAI request bodies (pydantic), and their translation into engine SamplingParams.

Every field is checked here, strictly (no "5" for 5, no "yes" for true, no NaN), before anything reaches the
engine thread; the sampling fields with sampling_params.problem, so the words match SamplingParams' own. Unknown
fields are refused, and OpenAI parameters the engine does not implement are refused by name: a silently ignored
parameter is a wrong answer the user cannot see."""
from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..sampling_params import SamplingParams, problem, unicode_problem
from ..structured import Constraint
from .fields import Int32, ShortText, StreamOptions, Strict, Text, refuse, text_or_ids_problem, token_ids_problem
from .params import REFUSED, refusals
from .tools import ToolPlan, constraint_of

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "include_stop_str_in_output", "n", "logit_bias", "skip_special_tokens")


# -- structured outputs and tools (their logic: engine/structured.py, server/tools.py) ------------------------
class JsonSchemaFormat(Strict):
    name: ShortText = "response"
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way: the grammar holds the output to the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: one of these constraints."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None
    json_object: bool | None = None


class GuidedFields(Strict):
    """The constraint fields (OpenAI's response_format, vLLM's structured_outputs and its older guided_*)."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    def constraint(self) -> Constraint | None:
        """The one constraint asked for (None: free text); InvalidRequest when several are, or one is malformed."""
        return constraint_of(self)


class FunctionDef(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: ShortText


class NamedTool(Strict):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(Strict):
    name: ShortText
    arguments: Text


class ToolCallIn(Strict):
    """A tool call of an earlier assistant turn, as the history sends it back."""
    id: ShortText
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolFields(Strict):
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan:
        return ToolPlan.of(self.tools or [], self.tool_choice, self.parallel_tool_calls)


class SamplingFields(GuidedFields):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""
    model: ShortText
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list)  # a single string arrives as a list of one
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    user: ShortText | None = None
    # vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)  # the vocabulary bound is the engine's to check
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int32 | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data):
        """vLLM's parameters this server does not take, refused with their reason (params.py)."""
        if isinstance(data, dict):
            refuse(refusals(data))
            data = {k: v for k, v in data.items() if k not in REFUSED}
        return data

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
        return []

    def samples(self) -> int:
        """How many samples the engine runs (best_of where it asks for more than n)."""
        return self.n

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, min_tokens=self.min_tokens,
            seed=self.seed, stop=list(self.stop), stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs, n=self.samples(),
            logit_bias=self.logit_bias, skip_special_tokens=self.skip_special_tokens)


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

    @field_validator("best_of", mode="before")
    @classmethod
    def _best_of(cls, v, info: ValidationInfo):
        if v is not None:
            refuse(problem("n", v))
            n = info.data.get("n", 1)
            refuse(f"must be >= n ({n}), got {v}" if isinstance(v, int) and v < n else None)
        return v

    def samples(self) -> int:
        return max(self.n, self.best_of or 1)

    def ranked(self) -> bool:
        """Whether the server must pick the n best of more samples (by their cumulative log-probability)."""
        return self.samples() > self.n

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # best_of ranks samples by their tokens' log-probabilities: the sampler computes them (shown only if asked)
        return super().sampling_params(max_tokens, 0 if logprobs is None and self.ranked() else logprobs)

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name, bad in (("echo with logprobs (prompt log-probabilities are not computed)",
                                        self.echo and self.logprobs is not None),
                                       ("best_of with stream (the best samples are known only at the end)",
                                        self.ranked() and self.stream),
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
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: ShortText | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: ShortText | None = None  # a tool turn: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v):
        refuse(content_problem(v))
        return v

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None

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
        out += [f"{name} (send tools and tool_choice)" for name in ("functions", "function_call")
                if getattr(self, name) is not None]
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
