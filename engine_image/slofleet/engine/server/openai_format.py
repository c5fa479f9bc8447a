"""Shape engine outputs as OpenAI responses and SSE chunks (completions and chat)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from slofleet.api.contract import error_body

from ..engine import LLMEngine, RequestOutput
from ..request import Request
from .protocol import ChatCompletionRequest, CompletionRequest
from .tools import CALL_OPEN, ToolPlan, held_from


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def usage(req: Request) -> dict:
    n_out = sum(len(r.output_token_ids) for r in req.samples())
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
    for index in range(len(req.samples()) if first is not None else 0):
        yield sse({**base, "choices": [{**first, "index": index}]})
    held: dict[int, list[RequestOutput]] = {}  # per sample (n > 1 streams its choices interleaved, by index)
    try:
        async for out in results:
            outs = held.setdefault(out.request.sample_index, [])
            outs.append(out)
            if out.new_text or out.finished:
                yield sse({**base, "choices": [choice(outs)]})
                outs.clear()
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
    echo = echo_text(engine, body, req)
    offsets: dict[int, int] = {}  # per sample: characters sent so far (echo included)

    def choice(outs: list[RequestOutput]) -> dict:
        index = outs[-1].request.sample_index
        start = index not in offsets
        offset = offsets.setdefault(index, len(echo))
        lp = completion_logprobs(engine, outs, offset) if want_lp or body.ranked() else None
        text = "".join(o.new_text for o in outs)
        offsets[index] += len(text)
        return {"index": index, "text": echo + text if start else text, "logprobs": lp,
                "finish_reason": outs[-1].finish_reason}

    def chunks():
        return sse_stream(results, base, choice, req, include_usage)

    async def full() -> dict:
        choices = [choice(outs) for outs in by_sample([out async for out in results])]
        if body.ranked():
            choices = best(choices, body.n, want_lp)
        return {**base, "choices": choices, "usage": usage(req)}

    return chunks, full


def echo_text(engine: LLMEngine, body: CompletionRequest, req: Request) -> str:
    """The prompt as text, which echo puts before each choice's own."""
    if not body.echo:
        return ""
    prompt = body.single_prompt()
    return prompt if isinstance(prompt, str) else engine.tokenizer.decode(req.prompt_token_ids)


def by_sample(outs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """A request's outputs grouped by sample, in index order."""
    groups: dict[int, list[RequestOutput]] = {}
    for out in outs:
        groups.setdefault(out.request.sample_index, []).append(out)
    return [groups[i] for i in sorted(groups)]


def best(choices: list[dict], n: int, show_logprobs: bool) -> list[dict]:
    """best_of: the n choices of highest cumulative log-probability, indexed 0..n-1 in that order."""
    ranked = sorted(choices, key=lambda c: -sum(c["logprobs"]["token_logprobs"] if c["logprobs"] else []))[:n]
    return [{**c, "index": i, "logprobs": c["logprobs"] if show_logprobs else None} for i, c in enumerate(ranked)]


def chat_handlers(engine: LLMEngine, body: ChatCompletionRequest, req: Request, rid: str,
                  results: AsyncIterator[RequestOutput]) -> tuple[Callable, Callable]:
    created, cid = int(time.time()), f"chatcmpl-{rid}"
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}
    top_n = body.top_logprobs or 0
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def choice(outs: list[RequestOutput]) -> dict:
        text = "".join(o.new_text for o in outs)
        return {"index": outs[-1].request.sample_index, "delta": {"content": text} if text else {},
                "finish_reason": outs[-1].finish_reason,
                "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}

    def chunks():
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse_stream(results, base, choice, req, include_usage, first)

    def message(outs: list[RequestOutput]) -> dict:
        return {"index": outs[-1].request.sample_index, "finish_reason": outs[-1].finish_reason,
                "message": {"role": "assistant", "content": "".join(o.new_text for o in outs)},
                "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}

    async def full() -> dict:
        choices = [message(outs) for outs in by_sample([out async for out in results])]
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage(req)}

    return chunks, full


def tool_finish(reason, calls: list) -> str | None:
    """OpenAI's finish_reason: tool_calls when the reply ended by itself with calls."""
    return "tool_calls" if calls and str(reason) == "stop" else reason


def tool_chat_handlers(engine: LLMEngine, body: ChatCompletionRequest, req: Request, rid: str,
                       results: AsyncIterator[RequestOutput], plan: ToolPlan) -> tuple[Callable, Callable]:
    """Chat replies that may carry tool calls (tools.py parses them). Streamed, a named function's arguments
    go out as they are generated; otherwise content streams until it may be a call, and the calls go out whole
    in the last chunk."""
    created, cid = int(time.time()), f"chatcmpl-{rid}"
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": engine.model_name}
    top_n = body.top_logprobs or 0
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    text, sent = "", 0
    named = plan.parse("")[1][0] if plan.mode == "named" else None

    def choice(outs: list[RequestOutput]) -> dict:
        nonlocal text, sent
        text += "".join(o.new_text for o in outs)
        reason = outs[-1].finish_reason
        if named is not None:
            piece, sent = text[sent:], len(text)
            delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
            reason = reason and tool_finish(reason, [named])
        elif reason is None:  # auto streams what cannot be a call yet; required holds it all
            cut = max(sent, held_from(text)) if plan.mode == "auto" else sent
            delta, sent = ({"content": text[sent:cut]} if cut > sent else {}), cut
        else:
            content, calls = plan.parse(text)
            rest = text[sent:text.find(CALL_OPEN)] if calls and CALL_OPEN in text else "" if calls else text[sent:]
            delta = {"content": rest} if rest.strip() or (rest and not calls) else {}
            if calls:
                delta["tool_calls"] = [c.wire(i) for i, c in enumerate(calls)]
            reason = tool_finish(reason, calls)
        return {"index": 0, "delta": delta, "finish_reason": reason if reason is None else str(reason),
                "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}

    def chunks():
        first = {"role": "assistant", "content": None if named else ""}
        if named is not None:
            first["tool_calls"] = [{**named.wire(0), "function": {"name": named.name, "arguments": ""}}]
        return sse_stream(results, base, choice, req, include_usage,
                          {"index": 0, "delta": first, "logprobs": None, "finish_reason": None})

    async def full() -> dict:
        outs = [out async for out in results]
        content, calls = plan.parse("".join(o.new_text for o in outs))
        message = {"role": "assistant", "content": content,
                   **({"tool_calls": [c.wire() for c in calls]} if calls else {})}
        reason = tool_finish(outs[-1].finish_reason, calls)
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": reason,
                             "logprobs": chat_logprobs(engine, outs, top_n) if body.logprobs else None}],
                "usage": usage(req)}

    return chunks, full
