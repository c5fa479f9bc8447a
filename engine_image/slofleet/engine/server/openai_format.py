"""Shape engine outputs as OpenAI responses and SSE chunks (completions and chat)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from slofleet.api.contract import error_body

from ..engine import LLMEngine, RequestOutput
from ..request import Request
from .protocol import ChatCompletionRequest, CompletionRequest


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(req: Request) -> dict:
    n_out = len(req.output_token_ids)
    return {"prompt_tokens": req.num_prompt_tokens, "completion_tokens": n_out,
            "total_tokens": req.num_prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": req.num_cached_tokens}}


def token_str(engine: LLMEngine, tok: int) -> str:
    return engine.tokenizer.decode([tok])


def completion_logprobs(engine: LLMEngine, outs: list[RequestOutput], offset: int) -> dict | None:
    tokens, lps, tops, offsets = [], [], [], []
    for out in outs:
        for tok, lp in zip(out.new_token_ids, out.new_logprobs):
            s = token_str(engine, tok)
            tokens.append(s)
            lps.append(lp.get(tok))
            tops.append({token_str(engine, t): v for t, v in lp.items()})
            offsets.append(offset)
            offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets} if tokens else None


def chat_logprobs(engine: LLMEngine, outs: list[RequestOutput], top_n: int) -> dict | None:
    content = []
    for out in outs:
        for tok, lp in zip(out.new_token_ids, out.new_logprobs):
            s = token_str(engine, tok)
            ranked = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": lp.get(tok), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_str(engine, t), "logprob": v,
                                              "bytes": list(token_str(engine, t).encode())} for t, v in ranked]})
    return {"content": content} if content else None


def _error_event(message: str) -> str:
    return sse(error_body(message, "server_error", code=500))


async def sse_stream(results: AsyncIterator[RequestOutput], base: dict,
                     choice: Callable[[list[RequestOutput]], dict], req: Request, include_usage: bool,
                     first: dict | None = None):
    """SSE chunks for the deltas that carry text or a finish, then usage (when asked) and [DONE]. A delta without
    text (held back for a stop string, or half a character) rides with the next chunk, so its tokens' logprobs
    still reach the client."""
    if first is not None:
        yield sse({**base, "choices": [first]})
    held: list[RequestOutput] = []
    try:
        async for out in results:
            held.append(out)
            if out.new_text or out.finished:
                yield sse({**base, "choices": [choice(held)]})
                held = []
    except Exception as e:  # headers are already sent: report in-band
        yield _error_event(str(e))
        return
    if include_usage:
        yield sse({**base, "choices": [], "usage": usage(req)})
    yield sse("[DONE]")


def completion_handlers(engine: LLMEngine, body: CompletionRequest, req: Request, rid: str,
                        results: AsyncIterator[RequestOutput]) -> tuple[Callable, Callable]:
    created, cid = int(time.time()), f"cmpl-{rid}"
    base = {"id": cid, "object": "text_completion", "created": created, "model": engine.model_name}
    want_lp = body.logprobs is not None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    offset = 0

    def choice(outs: list[RequestOutput]) -> dict:
        nonlocal offset
        lp = completion_logprobs(engine, outs, offset) if want_lp else None
        text = "".join(o.new_text for o in outs)
        offset += len(text)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": outs[-1].finish_reason}

    def chunks():
        return sse_stream(results, base, choice, req, include_usage)

    async def full() -> dict:
        outs = [out async for out in results]
        return {**base, "choices": [{"index": 0, "text": "".join(o.new_text for o in outs),
                                     "logprobs": completion_logprobs(engine, outs, 0) if want_lp else None,
                                     "finish_reason": outs[-1].finish_reason}], "usage": usage(req)}

    return chunks, full


def chat_handlers(engine: LLMEngine, body: ChatCompletionRequest, req: Request, rid: str,
                  results: AsyncIterator[RequestOutput]) -> tuple[Callable, Callable]:
    created, cid = int(time.time()), f"chatcmpl-{rid}"
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}
    top_n = body.top_logprobs or 0
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def choice(outs: list[RequestOutput]) -> dict:
        text = "".join(o.new_text for o in outs)
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": outs[-1].finish_reason,
                "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}

    def chunks():
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse_stream(results, base, choice, req, include_usage, first)

    async def full() -> dict:
        outs = [out async for out in results]
        message = {"role": "assistant", "content": "".join(o.new_text for o in outs)}
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": outs[-1].finish_reason,
                             "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}],
                "usage": usage(req)}

    return chunks, full
