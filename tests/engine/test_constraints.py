"""Constraints without a model: which one a body asks for, what a schema may use, and the sampler's mask."""
from __future__ import annotations

import json

import pytest
import torch

from slofleet.engine.errors import InvalidRequest
from slofleet.engine.request import Request
from slofleet.engine.sampler import Sampler
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.server.protocol import ChatCompletionRequest
from slofleet.engine.server.tools import chat_constraint
from slofleet.engine.structured import Constraint, Grammars, schema_problem

pytest.importorskip("xgrammar", reason="make install (the engine extra)")
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({**BASE, **kw})


def test_schema_problem_names_keyword_and_place():
    assert schema_problem({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}) == (
        "#/properties/a uses 'multipleOf', which constrained decoding does not support")
    assert "#/anyOf/1" in schema_problem({"anyOf": [{"type": "string"}, {"not": {}}]})
    assert "#/items" in schema_problem({"type": "array", "items": {"if": {}}})
    assert schema_problem({"type": "array", "items": {"enum": [1, 2]}, "minItems": 1, "$defs": {"x": True}}) is None


def test_one_constraint_per_request():
    assert body().constraint() is None
    assert body(response_format={"type": "text"}).constraint() is None
    assert body(response_format={"type": "json_object"}).constraint() == Constraint(kind="json_object")
    c = body(structured_outputs={"choice": ["a", "b"]}).constraint()
    assert c.kind == "choice" and json.loads(c.spec) == ["a", "b"]
    assert body(guided_json='{"type": "integer"}').constraint().kind == "json"
    with pytest.raises(InvalidRequest, match="got 2: guided_regex, structured_outputs.grammar"):
        body(guided_regex="a", structured_outputs={"grammar": "root ::= \"a\""}).constraint()
    with pytest.raises(InvalidRequest, match="needs json_schema"):
        body(response_format={"type": "json_schema"}).constraint()
    with pytest.raises(InvalidRequest, match="guided_json is not valid JSON"):
        body(guided_json="{nope").constraint()


def test_tool_plans():
    assert body(tools=[WEATHER]).tool_plan().mode == "auto"
    assert body(tools=[WEATHER], tool_choice="none").tool_plan().constraint() is None
    named = body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_plan()
    assert json.loads(named.constraint().spec) == WEATHER["function"]["parameters"]
    one = json.loads(body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False).tool_plan()
                     .constraint().spec)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_weather"}
    both = body(tools=[WEATHER], tool_choice="required", guided_regex="a")
    with pytest.raises(InvalidRequest, match="leave out response_format"):
        chat_constraint(both, both.tool_plan())
    auto = body(tools=[WEATHER], guided_regex="a")
    assert chat_constraint(auto, auto.tool_plan()).kind == "regex"
    with pytest.raises(InvalidRequest, match="distinct"):
        body(tools=[WEATHER, WEATHER]).tool_plan()


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 49152, {tokenizer.eos_token_id})


def test_compile_refuses_by_name(grammars):
    with pytest.raises(InvalidRequest, match="regex constraint does not compile: .*"):
        grammars.compile(Constraint(kind="regex", spec="(a"))
    with pytest.raises(InvalidRequest, match="'contains'"):
        grammars.compile(Constraint(kind="json", spec='{"type": "array", "contains": {"type": "integer"}}'))


def test_mask_constrains_its_rows_only(grammars, tokenizer):
    """Two rows, one under a choice: it can only start a choice; the free row keeps its argmax."""
    sampler = Sampler({tokenizer.eos_token_id}, grammars=grammars)
    cons = SamplingParams(temperature=0, structured=Constraint(kind="choice", spec='["yes", "no"]'))
    reqs = [Request(request_id=f"r{i}", prompt_token_ids=[1], params=p, max_tokens=4)
            for i, p in enumerate([cons, SamplingParams(temperature=0)])]
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0))
    free_best = int(logits[1].argmax())
    toks, _ = sampler.sample(logits.clone(), reqs)
    assert toks[1] == free_best
    assert tokenizer.decode([toks[0]]) in ("y", "ye", "yes", "n", "no")
    reqs[0].output_token_ids.append(toks[0])
    while not grammars.matchers["r0"].is_terminated():
        tok = sampler.sample(torch.randn(2, 49152), reqs)[0][0]
        reqs[0].output_token_ids.append(tok)
    assert tokenizer.decode(reqs[0].output_token_ids[:-1]) in ("yes", "no")
    assert reqs[0].output_token_ids[-1] == tokenizer.eos_token_id
    sampler.forget("r0")
    assert "r0" not in grammars.matchers
