"""Bucket classification, per-bucket admission limits, and shedding by priority.

Rules are the LLMService resource's `buckets`, parsed with its models (slofleet.api.v1alpha1): the first bucket
whose match conditions all hold wins, a bucket without conditions is the catch-all. The router has no tokenizer,
so prompt tokens are estimated from characters (`chars_per_token`); the estimate only has to put a request in the
right bucket.

Loaded from a file (the operator's ConfigMap, mounted), the rules are re-read when it changes: a bucket edit applies
without a restart. A file that does not parse then is logged and the rules loaded before stay."""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from slofleet.api.base import error_text
from slofleet.api.contract import DEFAULT_BUCKET
from slofleet.api.v1alpha1 import SLO, Bucket, Match

from .predict import Claim, Prediction, Predictor, retry_after

log = logging.getLogger("slofleet.router.buckets")


class RoutedBucket(Bucket):
    """A bucket as the router reads it: the resource's, except that a hand-written file may leave out the SLO,
    which only the autoscaler reads."""
    slo: SLO | None = None


DEFAULT_BUCKETS = [RoutedBucket(name=DEFAULT_BUCKET)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Asks:
    """What a request asks for beyond text, which a bucket's match may select on."""
    tools: bool = False  # it sends tools
    structured: bool = False  # it asks for a structured output


PLAIN = Asks()
STRUCTURED_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def asks_of(data: dict) -> Asks:
    """A request body's Asks (the engine validates these fields; a malformed one only fails to select)."""
    fmt = data.get("response_format")
    json_format = isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")
    return Asks(tools=bool(data.get("tools")),
                structured=json_format or any(data.get(k) is not None for k in STRUCTURED_FIELDS))


def matches(m: Match, prompt_tokens: int, max_tokens: int | None, headers: dict[str, str], path: str,
            asks: Asks = PLAIN) -> bool:
    if m.min_prompt_tokens is not None and prompt_tokens < m.min_prompt_tokens:
        return False
    if m.max_prompt_tokens is not None and prompt_tokens > m.max_prompt_tokens:
        return False
    # an absent max_tokens may run long, so it never satisfies an upper bound
    if m.max_output_tokens is not None and (max_tokens is None or max_tokens > m.max_output_tokens):
        return False
    if m.route is not None and not path.startswith(m.route):
        return False
    if m.tools is not None and m.tools != asks.tools:
        return False
    if m.structured is not None and m.structured != asks.structured:
        return False
    return all(headers.get(k.lower()) == v for k, v in (m.header or {}).items())


def catch_all(m: Match) -> bool:
    return all(v is None or v == {} for v in m.model_dump().values())  # `header: {}` is no condition either


def parse_buckets(items: list[dict]) -> list[Bucket]:
    """Buckets in camelCase (as in the resource) or snake_case (hand-written files), plus a catch-all when none
    is one, so that nothing goes unclassified."""
    out: list[Bucket] = [RoutedBucket.model_validate(b) for b in items]
    if not any(catch_all(b.match) for b in out):
        out.append(RoutedBucket(name=DEFAULT_BUCKET, priority=max((b.priority for b in out), default=0)))
    return out


def load_buckets(path: str | Path) -> list[Bucket]:
    """A YAML/JSON file holding a list of buckets, `{buckets: [...]}`, or a whole LLMService/SLOPolicy. What it
    cannot use is an OSError (unreadable) or a ValueError saying in one line what is wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not YAML or JSON: {' '.join(str(e).split())}") from None
    if isinstance(data, dict):
        data = (data.get("spec") or data).get("buckets", [])
    if not isinstance(data, list) or not all(isinstance(b, dict) for b in data):
        raise ValueError(f"{path}: expected a list of buckets, {{buckets: [...]}} or an LLMService/SLOPolicy")
    try:
        return parse_buckets(data)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid buckets: {error_text(e)}") from None


@dataclass
class BucketState:
    waiting: int = 0
    queued_tokens: int = 0
    allowance: float = 0.0  # token bucket for max_requests_per_second
    stamp: float = field(default_factory=time.monotonic)


@dataclass
class Ticket:
    """An admitted request's claim on its bucket, released when its first byte (or its error) arrives."""
    bucket: Bucket
    tokens: int
    state: BucketState  # its bucket's counters when admitted (kept by a reload that drops the bucket)
    released: bool = False
    claim: Claim | None = None  # its place in the predictor's count of the work on its replica


# why admission refuses a request (the router's metrics and status.buckets[] count them by these)
REFUSALS = ("predicted_ttft", "capacity", "waiting", "queued_tokens", "rate", "no_replica")


class Admission(Exception):
    def __init__(self, message: str, retry_after: int = 1, reason: str = "capacity"):
        super().__init__(message)
        self.retry_after, self.reason = retry_after, reason


class Classifier:
    """Classifies and admits, by each bucket's admission mode (Bucket.admission_mode).

    fixed: shedding by priority: the fleet holds `capacity` in-flight requests; the most critical priority may
    fill all of it, the least critical only `min_share` of it, levels between get a share in proportion to their
    rank. So under overload the sheddable buckets are refused first and the critical one keeps headroom, instead
    of all buckets failing together. Then the bucket's own limits (waiting requests, queued tokens, rate).
    slo-predicted: the same, and a request whose predicted time to first token on the replica it would go to
    (predict.py) exceeds the bucket's target is refused, before any engine work. off: every request is admitted.
    Requests of every mode count in the predictor, as work queued ahead of the others."""

    def __init__(self, buckets: list[Bucket], chars_per_token: float = 4.0, min_share: float = 0.5,
                 source: str | None = None, predictor: Predictor | None = None):
        self.chars_per_token, self.min_share, self.source = chars_per_token, min_share, source
        self.predictor = predictor or Predictor()
        self.mtime, self.failed = os.stat(source).st_mtime if source else 0.0, None
        self.state: dict[str, BucketState] = {}
        self.set_buckets(buckets)

    def set_buckets(self, buckets: list[Bucket]) -> None:
        """New rules; a bucket kept by name keeps its counters (its requests in flight, its rate allowance)."""
        # a rate-limited bucket starts with one second's worth of requests allowed
        self.state = {b.name: self.state.get(b.name) or BucketState(
            allowance=max(b.admission.max_requests_per_second or 0.0, 1.0)) for b in buckets}
        levels = sorted({b.priority for b in buckets})
        span = max(len(levels) - 1, 1)
        self.share = {p: 1.0 - (1.0 - self.min_share) * i / span for i, p in enumerate(levels)}
        self.buckets = buckets

    def reload(self) -> None:
        """Re-read the source file if it changed (cheap enough to call every few seconds)."""
        if not self.source:
            return
        try:
            mtime = os.stat(self.source).st_mtime
            if mtime == self.mtime:
                return
            buckets = load_buckets(self.source)
        except Exception as e:  # whatever the file holds (or a Secret-style swap hides a moment), the router serves on
            if self.failed != str(e):
                log.error("buckets file %s not reloaded, the buckets loaded before stay: %s", self.source, e)
            self.failed = str(e)
            return
        self.set_buckets(buckets)
        self.mtime, self.failed = mtime, None
        log.info("buckets reloaded: %s", ", ".join(b.name for b in buckets))

    def estimate_tokens(self, text_len: int) -> int:
        return int(text_len / self.chars_per_token) + 1

    def classify(self, prompt_tokens: int, max_tokens: int | None, headers: dict[str, str], path: str,
                 asks: Asks = PLAIN) -> Bucket:
        for b in self.buckets:
            if matches(b.match, prompt_tokens, max_tokens, headers, path, asks):
                return b
        return self.buckets[-1]

    def admit(self, bucket: Bucket, tokens: int, inflight: int, capacity: int, replica: str | None = None,
              streamed: bool = True) -> Ticket:
        """Admit a request of `tokens` prompt tokens, with `inflight` requests open in a fleet of `capacity`,
        bound for `replica` (None while none is ready): its ticket, or Admission saying why not."""
        st, now, mode = self.state[bucket.name], time.monotonic(), bucket.admission_mode()
        if capacity <= 0:
            raise Admission("no ready replica to serve this request; retry shortly", 2, "no_replica")
        if mode != "off":
            self.limit(bucket, st, tokens, inflight, capacity)
            if mode == "slo-predicted" and replica is not None:
                self.predicted(bucket, tokens, replica)
            self.rate(bucket, st, now)
        st.waiting += 1
        st.queued_tokens += tokens
        claim = self.predictor.claim(replica, tokens, bucket.priority, now, streamed) if replica is not None else None
        return Ticket(bucket, tokens, st, claim=claim)

    def limit(self, bucket: Bucket, st: BucketState, tokens: int, inflight: int, capacity: int) -> None:
        """The fleet's share for the bucket's priority, and the bucket's own counts."""
        adm = bucket.admission
        limit = max(1, int(capacity * self.share[bucket.priority]))
        if inflight >= limit:
            raise Admission(f"the fleet is over capacity for bucket {bucket.name!r} (priority {bucket.priority}): "
                            f"{inflight} requests in flight, this bucket is admitted below {limit}; retry later")
        if adm.max_waiting_requests is not None and st.waiting >= adm.max_waiting_requests:
            raise Admission(f"bucket {bucket.name!r} has {st.waiting} requests waiting, its limit is "
                            f"{adm.max_waiting_requests}; retry later", reason="waiting")
        if adm.max_queued_tokens is not None and st.waiting and st.queued_tokens + tokens > adm.max_queued_tokens:
            raise Admission(f"bucket {bucket.name!r} has {st.queued_tokens} prompt tokens queued, its limit is "
                            f"{adm.max_queued_tokens}; retry later", reason="queued_tokens")

    def predicted(self, bucket: Bucket, tokens: int, replica: str) -> Prediction:
        """Refuse when the request would miss its bucket's TTFT target on the replica (unless nothing is ahead
        of it there: it could start no sooner anywhere)."""
        p = self.predictor.predict(replica, tokens, bucket.priority, time.monotonic())
        target = bucket.slo.ttft_ms / 1000 if bucket.slo is not None and bucket.slo.ttft_ms else math.inf
        if p.ttft_s > target * self.predictor.rates.headroom and not p.first:
            raise Admission(f"bucket {bucket.name!r} (priority {bucket.priority}) would miss its time to first token "
                            f"target of {target * 1000:g} ms: {p.ahead} prompt tokens are queued ahead of it, "
                            f"predicted {p.ttft_s * 1000:.0f} ms; retry later", retry_after(p.ttft_s, target),
                            "predicted_ttft")
        return p

    def rate(self, bucket: Bucket, st: BucketState, now: float) -> None:
        """The bucket's requests per second, last: a request refused otherwise takes none of the allowance."""
        rate = bucket.admission.max_requests_per_second
        if rate is None:
            return
        st.allowance = min(max(rate, 1.0), st.allowance + (now - st.stamp) * rate)
        st.stamp = now
        if st.allowance < 1.0:
            raise Admission(f"bucket {bucket.name!r} is limited to {rate:g} requests per second",
                            max(1, int((1.0 - st.allowance) / rate + 0.999)), "rate")
        st.allowance -= 1.0

    def release(self, ticket: Ticket, started: str | None = None) -> None:
        """The ticket's request is no longer waiting: `started` names the replica whose first byte came (the
        predictor learns from it), None when it failed or was abandoned."""
        if ticket.released:
            return
        ticket.released = True
        st = ticket.state
        st.waiting -= 1
        st.queued_tokens -= ticket.tokens
        claim = ticket.claim
        if claim is not None:
            if started == claim.replica:
                self.predictor.first_byte(claim, time.monotonic())
            else:
                self.predictor.release(claim)

    def streamed(self, ticket: Ticket, chunks: int, seconds: float) -> None:
        """The ticket's answer streamed `chunks` chunks in `seconds` after its first: its replica's decode step."""
        if ticket.claim is not None:
            self.predictor.streamed(ticket.claim.replica, chunks, seconds)
