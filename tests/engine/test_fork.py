"""n > 1 without a model: the samples' blocks under Scheduler.fork, and the request models' take-or-refuse table."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from slofleet.api.base import error_text
from slofleet.engine.request import fan_out
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.server.params import REFUSED, TAKEN
from slofleet.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.engine.builders import make_request, make_scheduler


def prefill(sched, req) -> None:
    """Schedule req's whole prompt, as the engine's step would compute it."""
    out = sched.schedule()
    assert [r for r, _ in out.scheduled] == [req]
    req.num_computed_tokens += out.scheduled[0][1]


@pytest.mark.parametrize("prompt_len, shared, copied", [(40, 2, 1), (32, 2, 0)])
def test_fork_shares_full_blocks_and_copies_the_partial_one(prompt_len, shared, copied):
    sched = make_scheduler(num_blocks=16, block_size=16)
    req = make_request(prompt_len, max_tokens=4)
    req.params = SamplingParams(n=3, temperature=1.0, max_tokens=4)
    fan_out(req)
    sched.add(req)
    prefill(sched, req)
    children = list(req.forks)
    started, copies = sched.fork(req)
    assert started == children and req.forks == []
    parent_table = sched.kv.tables[req.request_id]
    for child in children:
        table = sched.kv.tables[child.request_id]
        assert table[:shared] == parent_table[:shared]  # the same blocks, not copies
        assert len(table) == shared + copied and child.num_computed_tokens == prompt_len
    assert all(b.ref_count == 3 for b in parent_table[:shared])
    assert len(copies) == 2 * copied and all(src == parent_table[-1].block_id for src, _ in copies)
    assert sched.kv.pool.num_free == 16 - shared - 3 * copied
    for r in [req, *children]:
        sched.remove(r)
    assert sched.kv.pool.num_free == 16


def test_fork_without_blocks_queues_the_sample_to_recompute():
    sched = make_scheduler(num_blocks=3, block_size=16)
    req = make_request(40, max_tokens=4)  # 3 blocks: the pool is full
    req.params = SamplingParams(n=2, max_tokens=4)
    fan_out(req)
    sched.add(req)
    prefill(sched, req)
    child = req.forks[0]
    started, copies = sched.fork(req)
    assert started == [] and copies == [] and sched.waiting == [child]


def test_seeded_samples_draw_different_seeds():
    req = make_request(8)
    req.params = SamplingParams(n=3, seed=7)
    fan_out(req)
    assert [r.params.seed for r in req.samples()] == [7, 8, 9]
    assert [r.sample_index for r in req.samples()] == [0, 1, 2]


BASE = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize("name, value", [
    ("n", 3), ("best_of", 4), ("temperature", 0.5), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1),
    ("presence_penalty", 0.5), ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("max_tokens", 5),
    ("min_tokens", 2), ("seed", 1), ("stop", ["x"]), ("stop_token_ids", [5]), ("ignore_eos", True),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("logit_bias", {"5": -100}),
    ("logprobs", 2), ("echo", True)])
def test_each_taken_parameter_reaches_sampling_params(name, value):
    assert name in TAKEN
    body = CompletionRequest.model_validate(BASE | {name: value})
    assert body.unsupported() == []
    params = body.sampling_params(body.max_tokens, body.logprobs)
    want = {"best_of": ("n", value), "logit_bias": ("logit_bias", {5: -100.0}), "echo": (None, None)}.get(
        name, (name, value))
    if want[0] is not None:
        assert getattr(params, want[0]) == want[1]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_parameter_is_refused_by_name(name):
    value = {"length_penalty": 2.0, "spaces_between_special_tokens": False, "bad_words": ["x"],
             "logits_processors": ["x"]}.get(name, 1)
    for model, base in ((CompletionRequest, BASE), (ChatCompletionRequest, {"model": "m", "messages": [
            {"role": "user", "content": "hi"}]})):
        with pytest.raises(ValidationError, match=f"unsupported parameter.*{name} "):
            model.model_validate(base | {name: value})
    harmless = REFUSED[name].harmless[0]
    CompletionRequest.model_validate(BASE | {name: harmless})  # a default a client always sends is taken


@pytest.mark.parametrize("extra, needle", [
    ({"echo": True, "logprobs": 1}, "echo with logprobs"), ({"best_of": 3, "stream": True}, "best_of with stream")])
def test_combinations_refused_by_name(extra, needle):
    assert needle in CompletionRequest.model_validate(BASE | extra).unsupported()[0]


@pytest.mark.parametrize("extra, needle", [
    ({"n": 2, "best_of": 1}, "best_of: must be >= n"), ({"n": 129}, "n: must be in [1, 128]"),
    ({"logit_bias": {"a": 1}}, "keys must be token ids"), ({"logit_bias": {"1": 200}}, "in [-100, 100]")])
def test_bad_values_name_the_field(extra, needle):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(BASE | extra)
    assert needle in error_text(e.value)
