"""OpenAI request bodies (pydantic), and their translation into engine SamplingParams.

Unknown fields are refused, and OpenAI parameters the engine does not implement are refused by name:
a silently ignored parameter is a wrong answer the user cannot see."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras)."""
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    priority: int | None = None

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
            seed=self.seed, stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [name for name, bad in (("echo", self.echo), ("best_of", self.best_of not in (None, 1)),
                                       ("suffix", bool(self.suffix))) if bad]
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) and len(self.prompt) != 1:
            out.append("prompt as a list of several prompts (send one prompt per request)")
        return out

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        return p[0] if isinstance(p, list) and p and isinstance(p[0], (str, list)) else p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)


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


class PrefillRequest(BaseModel):
    """Decode engine -> prefill engine: compute this prompt and hand its KV back (KV hand-off over HTTP)."""
    model_config = ConfigDict(extra="forbid")
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
