"""Structured outputs and tool calls through the real `openai` client against a real server process."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.router import RouterProc
from tests.support.server import Server, serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population: int = Field(ge=0, le=10**9)  # bounded: a small model otherwise may write digits until max_tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving("--max-model-len", "1024", log=tmp_path_factory.mktemp("structured") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    r = RouterProc("--upstream", server.url, log=tmp_path_factory.mktemp("router") / "router.log").wait_ready()
    yield r
    r.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(params=["engine", "router"])
def either(request, server):
    """The engine's own endpoint, then the router in front of it: the router passes the bodies unchanged."""
    url = (request.getfixturevalue("router") if request.param == "router" else server).url
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def post(server: Server | RouterProc, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=300)


def test_parse_with_a_pydantic_model(either):
    r = either.chat.completions.parse(model=MODEL, messages=[
        {"role": "user", "content": "Give the name, country and population of the capital of France."}],
        response_format=City, temperature=0, max_tokens=80)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", msg.content
    assert isinstance(msg.parsed, City) and msg.parsed == City.model_validate_json(msg.content)


def test_json_object(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=60)
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content)
    assert r.choices[0].message.content.lstrip().startswith(("{", "["))


@pytest.mark.parametrize("ask, extra, check", [
    # vLLM's structured-output examples: choice, regex, JSON schema, grammar (in both spellings)
    ("Classify the sentiment: 'I love this!'", {"structured_outputs": {"choice": ["positive", "negative"]}},
     lambda t: t in ("positive", "negative")),
    ("Classify the sentiment: 'I hate this!'", {"guided_choice": ["positive", "negative"]},
     lambda t: t in ("positive", "negative")),
    # vLLM's `\w+@\w+\.com\n`, bounded: a 135M model may run on inside an unbounded \w+
    ("Give an example email address.", {"structured_outputs": {"regex": r"\w{1,12}@\w{1,12}\.com\n"},
                                        "stop": ["\n"]}, lambda t: "@" in t and t.endswith(".com")),
    ("Name a month and a year.", {"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{4}"},
     lambda t: t[0].isupper() and t[-4:].isdigit()),
    ("Give the name, country and population of Paris as JSON.",
     {"structured_outputs": {"json": City.model_json_schema()}}, lambda t: City.model_validate_json(t)),
    ("Give the name, country and population of Rome as JSON.", {"guided_json": City.model_json_schema()},
     lambda t: City.model_validate_json(t)),
    ("Write an SQL query that reads one column of a table.",
     {"structured_outputs": {"grammar": 'root ::= "SELECT " col " FROM " tab\ncol ::= "name" | "age"\n'
                                        'tab ::= "users" | "orders"'}},
     lambda t: t.startswith("SELECT ") and t.split()[-1] in ("users", "orders")),
])
@pytest.mark.parametrize("via", ["server", "router"])
def test_vllm_example_set(request, via, ask, extra, check):
    body = {"messages": [{"role": "user", "content": ask}], "max_tokens": 60, **extra}
    r = post(request.getfixturevalue(via), "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert check(choice["message"]["content"]), choice


def test_completions_take_a_constraint(server):
    r = post(server, "/v1/completions", {"prompt": "The answer is", "max_tokens": 10,
                                          "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}}, ["'not'", "#/properties/a"]),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, ["uniqueItems"]),
    ({"guided_json": {"type": "nonsense"}}, ["json constraint", "nonsense"]),
    ({"guided_regex": "[a-"}, ["regex constraint"]),
    ({"guided_grammar": 'root ::= "a" |'}, ["grammar constraint"]),
    ({"guided_regex": "a", "guided_choice": ["b"]}, ["one output constraint", "guided_regex", "guided_choice"]),
    ({"structured_outputs": {"structural_tag": "x"}}, ["structural_tag"]),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, ["'nope'"]),
    ({"tool_choice": "required"}, ["needs tools"]),
])
def test_refusals_name_the_part(server, extra, words):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert all(w in msg for w in words), msg


def test_named_tool_call(either):
    r = either.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city", "unit"}


def test_required_tool_calls_streamed(either):
    client = either
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
              max_tokens=120, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert len(whole.message.tool_calls) == 1 and whole.message.tool_calls[0].function.name in ("get_weather",
                                                                                               "get_time")
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += (d.function.name or "") if d.function else ""
                got["arguments"] += (d.function.arguments or "") if d.function else ""
    assert reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]


def test_named_tool_call_streams_its_arguments(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=60, stream=True)
    pieces = [d for ch in stream for c in ch.choices for d in (c.delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert len(pieces) > 3  # the arguments arrive in several deltas, not at the end
    json.loads("".join(p.function.arguments or "" for p in pieces))


def test_tool_history_and_auto(client):
    """A conversation that called a tool and got its result goes on; auto may call again or answer."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0,
                                       max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls", "length")
    assert (choice.message.tool_calls is None) == (choice.finish_reason != "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                          temperature=0, max_tokens=20).choices[0]
    assert none.message.tool_calls is None and none.message.content


def test_auto_parses_hermes_calls():
    from slofleet.engine.server.protocol import Tool
    from slofleet.engine.server.tools import ToolPlan, held_from
    plan = ToolPlan.of([Tool.model_validate(WEATHER)], None, None)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}'
    content, calls = plan.parse(text + "\n</tool_call>")
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Rome", "unit": "celsius"}
    assert plan.parse(text)[1]  # cut before its closing tag, still a call
    assert plan.parse('{"name": "get_weather", "parameters": {"city": "X", "unit": "celsius"}}')[0] is None
    assert plan.parse("<tool_call>{not json</tool_call>") == ("<tool_call>{not json</tool_call>", [])
    assert plan.parse('{"name": "other", "arguments": {}}')[1] == []
    assert held_from("Let me check <tool") == len("Let me check ")
    assert held_from("Sunny today.") == len("Sunny today.")
    assert held_from(' {"name"') == 0


def structured_count(server: Server, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("slofleet:structured_output_requests_total{")
               and f'finished_reason="{reason}"' in line)


def test_cut_constrained_answers_count_as_schema_failures(client, server):
    """A constrained answer cut by max_tokens never closed its grammar: counted by reason, for model routing's
    quality signal; a free answer is not counted at all."""
    before_length, before_stop = structured_count(server, "length"), structured_count(server, "stop")
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       temperature=0, max_tokens=2)
    assert r.choices[0].finish_reason == "length"
    client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=2)
    assert structured_count(server, "length") == before_length + 1
    assert structured_count(server, "stop") == before_stop
