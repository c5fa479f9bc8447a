"""Bucket rules in the router: re-read from its buckets file (the operator's ConfigMap, mounted) when it changes, so a
bucket edit applies without a restart, requests admitted before keep their claim, and a broken file leaves the rules
in force; and the queued-tokens admission limit."""
from __future__ import annotations

import json
import os

import pytest

from slofleet.api.contract import DEFAULT_BUCKET
from slofleet.router.buckets import DEFAULT_BUCKETS, Admission, Classifier, load_buckets, parse_buckets


def write(path, buckets: list[dict], stamp: float) -> None:
    path.write_text(json.dumps({"buckets": buckets}))
    os.utime(path, (stamp, stamp))  # a new mtime, as the kubelet's swap of the ConfigMap's files gives


def test_a_changed_file_applies_and_a_broken_one_is_ignored(tmp_path):
    f = tmp_path / "policy.json"
    write(f, [{"name": "chat", "priority": 0, "match": {"maxPromptTokens": 100},
               "admission": {"maxWaitingRequests": 1}}, {"name": "doc", "priority": 5}], 1000)
    c = Classifier(load_buckets(f), source=str(f))
    chat = c.classify(10, None, {}, "/v1/completions")
    held = c.admit(chat, 10, 0, 100)
    assert chat.name == "chat"

    write(f, [{"name": "short", "priority": 2, "match": {"maxPromptTokens": 20}},
              {"name": "doc", "priority": 5, "admission": {"maxWaitingRequests": 0}}], 2000)
    c.reload()
    assert [b.name for b in c.buckets] == ["short", "doc"] and c.classify(10, None, {}, "/").name == "short"
    doc = c.classify(50, None, {}, "/")
    assert doc.admission.max_waiting_requests == 0  # the new limit holds at once
    c.release(held)  # a request of a bucket the reload dropped still gives its claim back
    assert held.state.waiting == 0

    write(f, [{"name": "Bad Name"}], 3000)
    c.reload()
    assert [b.name for b in c.buckets] == ["short", "doc"]  # logged; the rules loaded before stay
    f.unlink()
    c.reload()
    assert [b.name for b in c.buckets] == ["short", "doc"]


def test_the_queued_tokens_limit():
    (doc,) = parse_buckets([{"name": "doc", "admission": {"maxQueuedTokens": 1000}}])
    c = Classifier([doc])
    first = c.admit(doc, 800, 0, 100)  # the first waiting request is admitted whatever its size
    with pytest.raises(Admission, match="800 prompt tokens queued, its limit is 1000"):
        c.admit(doc, 300, 1, 100)
    c.admit(doc, 200, 1, 100)
    c.release(first)
    c.admit(doc, 700, 1, 100)
    (free,) = parse_buckets([{"name": "free"}])
    c = Classifier([free])
    for _ in range(3):  # at the default (no limit), the same load is admitted
        c.admit(free, 800, 0, 100)


def test_the_catch_all_bucket_has_the_contracts_default_name():
    """The router's default bucket is the name the engine labels unbucketed requests with and the autoscaler
    reads as the one bucket of an unlabelled engine."""
    assert [b.name for b in DEFAULT_BUCKETS] == [DEFAULT_BUCKET]
    named = parse_buckets([{"name": "chat", "match": {"maxPromptTokens": 100}}])
    assert [b.name for b in named] == ["chat", DEFAULT_BUCKET]
    assert parse_buckets([{"name": "all"}])[-1].name == "all"  # a catch-all of its own: none added


@pytest.mark.parametrize("body, bucket", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "agent"),
    ({"tools": []}, "chat"),  # an empty list sends no tools
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "json"),
    ({"response_format": {"type": "json_object"}}, "json"),
    ({"response_format": {"type": "text"}}, "chat"),
    ({"guided_regex": "[a-z]+"}, "json"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "json"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
     "agent"),  # the first bucket that matches wins
    ({}, "chat"),
])
def test_buckets_select_on_tools_and_structured_outputs(body, bucket):
    from slofleet.router.buckets import asks_of
    c = Classifier(parse_buckets([{"name": "agent", "match": {"tools": True}},
                                  {"name": "json", "match": {"structured": True}},
                                  {"name": "chat", "match": {"tools": False, "structured": False}},
                                  {"name": "other"}]))
    assert c.classify(20, 50, {}, "/v1/chat/completions", asks_of(body)).name == bucket


def test_the_crd_validates_the_new_match_fields():
    from pydantic import ValidationError

    from slofleet.api.v1alpha1 import Match
    assert Match.model_validate({"tools": True, "structured": False}).tools is True
    with pytest.raises(ValidationError, match="tools"):
        Match.model_validate({"tools": "maybe"})
