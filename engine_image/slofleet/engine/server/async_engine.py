"""Runs the engine core in its own thread and hands each request's outputs to an asyncio queue."""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import deque
from collections.abc import Callable

from ..engine import LLMEngine, RequestOutput
from ..request import Request
from ..sampling_params import SamplingParams
from ..stats import StepRecord

log = logging.getLogger("slofleet.engine.loop")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_output: Callable[[RequestOutput], None],
                 on_fatal: Callable[[], None] = lambda: None, on_step: Callable[[StepRecord], None] = lambda _: None):
        self.engine = engine
        self.on_output, self.on_step = on_output, on_step
        self.on_fatal = on_fatal  # called once if the loop dies
        self.queues: dict[str, asyncio.Queue] = {}
        self.live: set[str] = set()  # ids the engine holds until their finishing output (an abort's too)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.wake = threading.Event()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None
        self.calls: deque[tuple[Callable, asyncio.Future]] = deque()  # work for the engine's thread, between steps

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=30)

    def add(self, prompt: str | list[int] | None, params: SamplingParams, request_id: str, priority: int | None,
            bucket: str, **handoff) -> tuple[Request, asyncio.Queue]:
        """Queue a request (raises the engine's InvalidRequest, AdmissionError or UpstreamError synchronously,
        before any byte is sent). A request id still live here (a client's own x-request-id, reused) gets a suffix:
        the engine's ids must be unique; the returned request has the one used."""
        if self.error is not None:
            raise RuntimeError("the engine loop is dead")
        if request_id in self.live:
            request_id = f"{request_id}.{uuid.uuid4().hex[:8]}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        try:
            req = self.engine.add_request(prompt, params, request_id, priority, bucket, **handoff)
        except Exception:
            self.queues.pop(request_id, None)
            raise
        for sample in req.samples():  # n > 1: every sample's deltas go to the one queue
            self.queues[sample.request_id] = queue
            self.live.add(sample.request_id)
        self.wake.set()
        return req, queue

    def call(self, fn: Callable) -> asyncio.Future:
        """Run fn on the engine's thread between two steps (the model is not to be run from two threads at once);
        the future holds its result or its exception."""
        if self.error is not None:
            raise RuntimeError("the engine loop is dead")
        future = self.loop.create_future()
        self.calls.append((fn, future))
        self.wake.set()
        return future

    def _run_calls(self) -> None:
        while self.calls:
            fn, future = self.calls.popleft()
            try:
                result, error = fn(), None
            except Exception as e:  # the caller's to report
                result, error = None, e
            self.loop.call_soon_threadsafe(_settle, future, result, error)

    def abort(self, request_id: str) -> None:
        if self.queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self.wake.set()

    def _deliver(self, out: RequestOutput) -> None:
        queue = self.queues.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)
            if out.finished:
                self.queues.pop(out.request_id, None)

    def _run(self) -> None:
        try:
            while not self.stopping:
                self._run_calls()
                if not self.engine.has_unfinished():
                    self.wake.wait(0.1)
                    self.wake.clear()
                    continue
                seen = self.engine.last_step
                for out in self.engine.step():
                    self.on_output(out)
                    if out.finished:
                        self.live.discard(out.request_id)
                    self.loop.call_soon_threadsafe(self._deliver, out)
                if self.engine.last_step is not seen:
                    self.on_step(self.engine.last_step)
        except BaseException as e:  # a dead engine must surface as failed requests and a failed /health
            log.exception("engine loop crashed")
            self.error = e
            for rid in list(self.queues):
                self.loop.call_soon_threadsafe(self._fail, rid)
            self.on_fatal()

    def _fail(self, request_id: str) -> None:
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(None)


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if not future.done():  # its caller may have gone
        future.set_exception(error) if error is not None else future.set_result(result)
