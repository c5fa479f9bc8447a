"""Constraints and tool calls on the OpenAI surface: which constraint a body asks for, how tools reach the prompt,
and how the model's output turns back into `tool_calls`.

Tool calls use the Hermes format, which most open chat models are tuned on: the tools are listed in the system
prompt and a call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A model whose own chat template
renders tools gets them through its template; one whose template ignores them (the embedded SmolLM2's) gets them
in a system message written here. With tool_choice `auto` the output is parsed for such calls (a reply that is a
bare `{"name": ..., "arguments": ...}` object naming a tool counts too). With `required` the grammar holds the
output to a JSON array of calls of the given functions (one call without parallel_tool_calls), and with a named
function to that function's arguments, as vLLM does."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from jinja2 import TemplateError

from ..errors import InvalidRequest
from ..sampling_params import SamplingParams
from ..structured import Constraint, Grammars, schema_problem

if TYPE_CHECKING:
    from ..engine import LLMEngine
    from .protocol import ChatCompletionRequest, ChatMessage, GuidedFields, NamedTool, Tool

Mode = Literal["none", "auto", "required", "named"]
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
OBJECT = {"type": "object"}  # the parameters of a function that declares none
TOOLS_PROMPT = (
    "You are a function calling AI model. You may call one or more functions to assist with the user query. "
    "Here are the available functions, as JSON schemas, one per line:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, answer with a JSON object holding the function's name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
    "</tool_call>")


def _schema(text: dict | str, what: str) -> str:
    """A JSON schema as JSON text, checked for what the grammar would not enforce."""
    try:
        schema = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{what} is not valid JSON: {e}", what.split()[0]) from None
    msg = schema_problem(schema)
    if msg:
        raise InvalidRequest(f"{what}: {msg}", what.split()[0])
    return json.dumps(schema)


def _asked(body: GuidedFields) -> list[tuple[str, Constraint]]:
    """Every constraint the body names, with the field that names it."""
    asked: list[tuple[str, Constraint]] = []
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type == "json_object":
        asked.append(("response_format", Constraint(kind="json_object")))
    if rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise InvalidRequest("response_format of type json_schema needs json_schema: {name, schema}",
                                 "response_format")
        spec = _schema(rf.json_schema.schema_ or OBJECT, "response_format.json_schema.schema")
        asked.append(("response_format", Constraint(kind="json", spec=spec)))
    fields = [("json", body.guided_json, "guided_json"), ("regex", body.guided_regex, "guided_regex"),
              ("choice", body.guided_choice, "guided_choice"), ("grammar", body.guided_grammar, "guided_grammar")]
    if so is not None:
        fields += [("json", so.json_, "structured_outputs.json"), ("regex", so.regex, "structured_outputs.regex"),
                   ("choice", so.choice, "structured_outputs.choice"),
                   ("grammar", so.grammar, "structured_outputs.grammar")]
        if so.json_object:
            asked.append(("structured_outputs.json_object", Constraint(kind="json_object")))
    for kind, value, name in fields:
        if value is not None:
            spec = _schema(value, name) if kind == "json" else json.dumps(value) if kind == "choice" else value
            asked.append((name, Constraint(kind=kind, spec=spec)))
    return asked


def constraint_of(body: GuidedFields) -> Constraint | None:
    """The one constraint that response_format, structured_outputs or the guided_* fields ask for."""
    asked = _asked(body)
    if len(asked) > 1:
        raise InvalidRequest(f"ask for one output constraint, got {len(asked)}: "
                             f"{', '.join(name for name, _ in asked)}", asked[1][0].split(".")[0])
    return asked[0][1] if asked else None


def chat_constraint(body: GuidedFields, plan: ToolPlan) -> Constraint | None:
    """The grammar a chat request runs under: its tool choice's or the one it asks for, never both."""
    calls, asked = plan.constraint(), constraint_of(body)
    if calls is not None and asked is not None:
        raise InvalidRequest(f"tool_choice {plan.named or plan.mode!r} constrains the output to tool calls: leave "
                             "out response_format, structured_outputs and guided_*", "tool_choice")
    return calls or asked


@dataclass(slots=True, kw_only=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def wire(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(slots=True, kw_only=True)
class ToolPlan:
    """What the tools of a request ask of the prompt, the grammar and the reply."""
    tools: list[Tool]
    mode: Mode
    named: str | None = None
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Tool], choice: str | NamedTool | None, parallel: bool | None) -> ToolPlan:
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools: function names must be distinct", "tools")
        if choice is not None and not isinstance(choice, str):
            if choice.function.name not in names:
                raise InvalidRequest(f"tool_choice names function {choice.function.name!r}, which is not among "
                                     "tools", "tool_choice")
            return cls(tools=tools, mode="named", named=choice.function.name, parallel=parallel is not False)
        if choice in ("required",) and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", "tool_choice")
        mode = "none" if not tools else (choice or "auto")
        return cls(tools=tools, mode=mode, parallel=parallel is not False)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def parameters(self, name: str) -> dict:
        fn = next(t.function for t in self.tools if t.function.name == name)
        json.loads(_schema(fn.parameters or OBJECT, f"tools function {name!r} parameters"))  # checked
        return fn.parameters or OBJECT

    def constraint(self) -> Constraint | None:
        """The grammar that required/named enforce; None for auto and none."""
        if self.mode == "named":
            return Constraint(kind="json", spec=json.dumps(self.parameters(self.named)))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": self.parameters(t.function.name)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in self.tools]
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return Constraint(kind="json", spec=json.dumps(array if self.parallel else {**array, "maxItems": 1}))

    def system_prompt(self) -> str:
        return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in self.tools))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and its tool calls; text that holds no well-formed call stays content."""
        if self.mode == "named":
            return None, [ToolCall(name=self.named, arguments=text)]
        if self.mode == "required":
            items = _loads(text)
            calls = [_call(x, self.tools) for x in items] if isinstance(items, list) else []
            return (None, calls) if calls and all(calls) else (text, [])
        return parse_auto(text, self.tools)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj, tools: list[Tool]) -> ToolCall | None:
    """A call from {"name": ..., "arguments"|"parameters": {...}} naming one of tools; None if it is not one."""
    if not isinstance(obj, dict) or obj.get("name") not in {t.function.name for t in tools}:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    return ToolCall(name=obj["name"], arguments=json.dumps(args)) if isinstance(args, dict) else None


def parse_auto(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """Hermes <tool_call> blocks (or a bare call object) in free output."""
    at = text.find(CALL_OPEN)
    if at >= 0:
        calls = [_call(_loads(m), tools) for m in CALL_RE.findall(text[at:])]
        if calls and all(calls):
            return text[:at].strip() or None, calls
    bare = _call(_loads(text.strip()), tools) if text.strip().startswith("{") else None
    return (None, [bare]) if bare else (text, [])


def held_from(text: str) -> int:
    """Where the part of auto-mode output that may still turn into a tool call starts (len(text): none): from a
    <tool_call> tag or a partial one at the end, or all of it while it could be a bare call object."""
    if text.lstrip().startswith("{") or CALL_OPEN.startswith(text.lstrip()):
        return 0
    at = text.find(CALL_OPEN)
    if at >= 0:
        return at
    for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(CALL_OPEN[:k]):
            return len(text) - k
    return len(text)


def render_messages(messages: list[ChatMessage], plan: ToolPlan, template_tools: bool) -> list[dict]:
    """The conversation for the chat template. Without a template that renders tools, tool calls and results
    become the Hermes text the system prompt describes."""
    out = []
    for m in messages:
        role, text = ("system" if m.role == "developer" else m.role), m.text()
        if template_tools:
            msg = {"role": role, "content": text}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _loads(c.function.arguments) or {}}} for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
            continue
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [
                f'{CALL_OPEN}\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}\n'
                f"{CALL_CLOSE}" for c in m.tool_calls])
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if plan.active and plan.tools and not template_tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{plan.system_prompt()}"}
        else:
            out.insert(0, {"role": "system", "content": plan.system_prompt()})
    return out


def chat_prompt(engine: LLMEngine, body: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    template_tools = "tools" in (engine.tokenizer.chat_template or "")  # else tools go into a system message
    messages = render_messages(body.messages, plan, template_tools)
    extra = {"tools": [t.model_dump(exclude_none=True) for t in plan.tools]} if template_tools and plan.active else {}
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False, **extra)
    except (ValueError, TemplateError, TypeError) as e:  # the model's template refuses this conversation
        raise InvalidRequest(f"messages: {e}", "messages") from None


async def constrained(grammars: Grammars, params: Callable[[], SamplingParams],
                      constraint: Callable[[], Constraint | None]) -> Callable[[], SamplingParams]:
    """The request's sampling with its output constraint, compiled here in a worker thread (the compiler caches
    it for the engine's sampler): one that cannot compile is an InvalidRequest before the request is queued."""
    c = constraint()
    if c is None:
        return params
    await asyncio.to_thread(grammars.compile, c)
    return lambda: dataclasses.replace(params(), structured=c)
