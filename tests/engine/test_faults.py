"""Fault isolation in the engine core: an error while serving some requests fails those requests only, the engine
goes on, and nothing leaks; a fault in every step escapes (the server then fails its probes and exits)."""
from __future__ import annotations

import pytest

from slofleet.engine import InvalidRequest, LLMEngine, SamplingParams
from slofleet.engine.engine import MAX_FAILED_STEPS
from slofleet.engine.request import FinishReason
from slofleet.engine.server.collector import OTHER_BUCKET, BucketLabels

P = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(dtype="float32", num_blocks=64)


def run(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.mark.slow
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    reference = engine.add_request([1, 2, 3, 4], P)
    run(engine)
    sample, calls = engine.sampler.sample, []

    def flaky(logits, reqs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return sample(logits, reqs)

    monkeypatch.setattr(engine.sampler, "sample", flaky)
    victim = engine.add_request([5, 6, 7], P)
    outs = run(engine)
    assert victim.finish_reason is FinishReason.ERROR
    assert [o.finish_reason for o in outs if o.finished] == [FinishReason.ERROR]
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks  # its blocks went back
    again = engine.add_request([1, 2, 3, 4], P)
    run(engine)
    assert again.output_token_ids == reference.output_token_ids and again.finish_reason is FinishReason.LENGTH


@pytest.mark.slow
def test_a_fault_in_every_step_escapes(monkeypatch):
    engine = LLMEngine(dtype="float32", num_blocks=64)  # its own: it ends broken

    def broken(*_):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for _ in range(MAX_FAILED_STEPS - 1):
        engine.add_request([1, 2, 3], P)
        assert [o.finish_reason for o in engine.step()] == [FinishReason.ERROR]
    engine.add_request([1, 2, 3], P)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()


@pytest.mark.slow
def test_stop_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(InvalidRequest, match="stop_token_ids out of range"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=[engine.vocab_size + 3], min_tokens=2))
    with pytest.raises(InvalidRequest, match="prompt token ids out of range"):
        engine.add_request([1, -2], P)


def test_bucket_labels_stay_bounded():
    seen = BucketLabels(set())
    names = [f"b{i}" for i in range(40)]
    labels = [seen.label(n) for n in names]
    assert labels[:32] == names[:32] and set(labels[32:]) == {OTHER_BUCKET}
    assert seen.label("b3") == "b3" and seen.label("default") == "default"
    assert BucketLabels(set()).label("Not A Label!") == OTHER_BUCKET
    assert BucketLabels(set()).label("x" * 64) == OTHER_BUCKET
    configured = BucketLabels({"chat", "doc"})
    assert [configured.label(n) for n in ("chat", "doc", "default", "agent")] == ["chat", "doc", "default", "other"]


@pytest.mark.slow
def test_a_dead_engine_loop_fails_probes_and_requests_and_exits():
    """The server in-process (uvicorn in a thread) so a fault can be injected into its engine loop."""
    import time

    import httpx

    from slofleet.engine.config import EngineConfig
    from slofleet.engine.server.api import build_app
    from tests.support.server import serve_in_thread

    app = build_app(EngineConfig(dtype="float32", num_blocks=64))
    server, thread, url = serve_in_thread(app)
    state = app.state.slofleet
    try:
        deadline = time.monotonic() + 120
        while not state.ready and time.monotonic() < deadline:
            time.sleep(0.2)
        exited: list[int] = []
        state.async_engine.on_fatal = lambda: exited.append(1)  # instead of os._exit in this test process

        def broken(*_):
            raise RuntimeError("injected fault")

        state.engine.runner.execute = broken
        body = {"model": state.engine.model_name, "prompt": "hi", "max_tokens": 4}
        for _ in range(MAX_FAILED_STEPS):
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 500 and "request id" in r.json()["error"]["message"], r.text
            assert time.monotonic() - t0 < 5
        assert exited == [1]
        assert httpx.get(url + "/health", timeout=5).status_code == 500
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        r = httpx.post(url + "/v1/completions", json=body, timeout=5)
        assert r.status_code == 500 and "restarting" in r.json()["error"]["message"]
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.mark.slow
def test_a_failing_step_during_a_prefill_for_a_peer_fails_it_without_exporting(engine, monkeypatch):
    def broken(*_):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.sampler, "sample", broken)
    req = engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0), export_kv=True)
    outs = engine.step()  # before: exporting a prefill that sampled nothing raised IndexError out of step()
    assert [(o.request_id, o.finish_reason, o.kv) for o in outs] == [(req.request_id, FinishReason.ERROR, None)]
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
