"""vLLM's `POST /tokenize` and `POST /detokenize`, shaped as vLLM answers them: a completion prompt or chat messages
in, {count, max_model_len, tokens, token_strs} out; token ids in, {prompt} out. Benchmark clients (`vllm bench
serve`) count prompt tokens with them."""
from __future__ import annotations

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from pydantic import Field, model_validator

from ..engine import LLMEngine
from ..errors import InvalidRequest
from .fields import ShortText, Strict, Text, token_ids_problem
from .http import ApiError, from_engine, parse, read_body
from .protocol import ChatMessage


class TokenizeRequest(Strict):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: exactly one of prompt and messages."""
    model: ShortText | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) and messages (a chat)")
        if self.add_generation_prompt and self.continue_final_message and self.messages is not None:
            raise ValueError("continue_final_message cannot be used with add_generation_prompt: set it false")
        return self


class DetokenizeRequest(Strict):
    model: ShortText | None = None
    tokens: list[int]


def served(engine: LLMEngine, model: str | None) -> None:
    if model is not None and model not in engine.model_names:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves "
                            f"{', '.join(map(repr, engine.model_names))} (see /v1/models)", "not_found_error", "model")


def token_ids(engine: LLMEngine, body: TokenizeRequest) -> list[int]:
    """The ids the model would see: the prompt as the completions endpoint encodes it, or the chat template's."""
    if body.prompt is not None:
        return engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
    try:
        ids = engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=True, return_dict=False,
            continue_final_message=body.continue_final_message)
    except (ValueError, TemplateError) as e:  # the model's template refuses this conversation
        raise ApiError(400, f"messages: {e}", param="messages") from None
    if body.add_special_tokens and engine.tokenizer.bos_token_id is not None:
        ids = [engine.tokenizer.bos_token_id, *ids]
    return list(ids)


async def read(request: Request, model: type[Strict]):
    """The body as `model`, and the engine (503 while it loads)."""
    state = request.app.state.slofleet
    s = state.settings
    return parse(await read_body(request, s.max_request_bytes, s.request_read_timeout), model), state.engine_or_503()


async def tokenize(request: Request) -> dict:
    body, engine = await read(request, TokenizeRequest)
    served(engine, body.model)
    ids = token_ids(engine, body)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


async def detokenize(request: Request) -> dict:
    body, engine = await read(request, DetokenizeRequest)
    served(engine, body.model)
    if problem := token_ids_problem(body.tokens):
        raise ApiError(400, f"tokens: {problem}", param="tokens")
    try:
        engine.check_token_ids(body.tokens, "tokens")
    except InvalidRequest as e:
        raise from_engine(e) from None
    return {"prompt": engine.tokenizer.decode(body.tokens)}


def add_tokenize_routes(app: FastAPI) -> None:
    for path, handler in (("/tokenize", tokenize), ("/detokenize", detokenize)):
        app.add_api_route(path, handler, methods=["POST"])
