"""Time to first token, predicted at the router from what it measures, for SLO-aware admission.

A request sent to a replica waits for the prompt tokens the engine will prefill before its own, then for its own,
then for the step that samples its first token:

    ttft = (step_s + (ahead + tokens) * prefill_s_per_token) / (1 - busy_above)

`busy_above` is the share of the replica's time that the higher priorities' prompts arriving meanwhile will take
(their recent prompt tokens per second times the prefill rate): they go before it even when sent after it, so a
low priority's wait stretches by 1 / (1 - busy_above), as in a queue served by priority. Over a share of
MAX_BUSY the low priority is not served in any useful time and its prediction is unbounded.

`ahead` counts the prompt tokens of the requests this router sent to that replica that have not had their first
byte yet and run at the request's priority or higher (a lower number; the engines schedule by it): a lower
priority's queue never delays a higher one, so a higher priority may take capacity from a lower one and never the
reverse, and under overload the lower priorities are refused first.

Both rates are learned per replica, so the same prediction holds for any runtime behind the router:
- prefill seconds per token, from each request's first byte: the time it took, less one step, over the tokens
  that were ahead of it when it was sent (plus those a higher priority put ahead of it since) and its own. Fitted
  on the same sum the prediction uses, the rate takes in what the engine does meanwhile (decode steps of the
  running requests, chunking, a prefix cache's hits);
- decode step seconds, from each stream: its time after the first chunk over its chunks.
Each is an exponentially weighted mean (the prefill rate a ratio of two). Before a replica's first sample the prior
rates hold (`Rates`). A request sent to a replica with nothing pending is always admitted: it could start no sooner
anywhere, and it is how an idle replica is measured.

Pure (no I/O, the clock passed in), so that the router, `slofleet serve` and the later admission stages (tenants,
model routing's latency(m, x)) share one predictor."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_BUSY = 0.95


@dataclass(slots=True, kw_only=True)
class Rates:
    """Prior and learning rate: what a replica is assumed to do before it has been measured."""
    prefill_tps: float = 2000.0  # prompt tokens per second
    step_s: float = 0.05  # one decode step
    alpha: float = 0.2  # weight of a new sample in the running means
    window_s: float = 1.0  # the time constant of each priority's recent arrival rate
    # the share of a TTFT target a prediction may fill: it predicts a mean wait, the target holds at a percentile
    headroom: float = 0.8


@dataclass(slots=True, kw_only=True)
class Claim:
    """A request sent to a replica, from its admission to its first byte."""
    replica: str
    tokens: int
    priority: int
    ahead: int  # prompt tokens before it when sent, then plus those a higher priority put before it
    sent: float  # monotonic seconds
    streamed: bool = True  # an answer not streamed has its first byte when whole: nothing to learn from then
    open: bool = True


@dataclass(slots=True, kw_only=True)
class Prediction:
    ttft_s: float
    ahead: int  # prompt tokens before it at its priority or higher
    first: bool  # nothing on the replica before it: it would start at once


@dataclass(slots=True)
class Arrivals:
    """Prompt tokens per second sent at one priority, decaying with time constant `window_s`."""
    per_s: float = 0.0
    at: float = 0.0

    def now(self, now: float, window_s: float) -> float:
        return self.per_s * math.exp(-max(0.0, now - self.at) / window_s)

    def add(self, tokens: int, now: float, window_s: float) -> None:
        self.per_s, self.at = self.now(now, window_s) + tokens / window_s, now


@dataclass(slots=True)
class Clock:
    """One replica's learned rates and its requests before their first byte. The prefill rate is a ratio of
    means (seconds waited over tokens waited for), so a short prompt's fixed costs weigh as little as its tokens."""
    waited_s: float  # running mean of first-byte times less one step
    tokens: float  # running mean of the tokens those waited for
    step_s: float
    prefill_samples: int = 0
    step_samples: int = 0
    pending: list[Claim] = field(default_factory=list)
    arrivals: dict[int, Arrivals] = field(default_factory=dict)  # by priority

    @property
    def prefill_s_per_token(self) -> float:
        return self.waited_s / max(self.tokens, 1.0)


class Predictor:
    def __init__(self, rates: Rates | None = None):
        self.rates = rates or Rates()
        self.clocks: dict[str, Clock] = {}

    def clock(self, replica: str) -> Clock:
        c = self.clocks.get(replica)
        if c is None:
            c = self.clocks[replica] = Clock(1.0 / self.rates.prefill_tps, 1.0, self.rates.step_s)
        return c

    def ahead(self, replica: str, priority: int) -> int:
        """Prompt tokens not yet past their first byte on the replica, at this priority or higher."""
        return sum(p.tokens for p in self.clock(replica).pending if p.priority <= priority)

    def busy_above(self, replica: str, priority: int, now: float) -> float:
        """The share of the replica's time the prompts of higher priorities (lower numbers) take, recently."""
        c = self.clock(replica)
        per_s = sum(a.now(now, self.rates.window_s) for p, a in c.arrivals.items() if p < priority)
        return per_s * c.prefill_s_per_token

    def predict(self, replica: str, tokens: int, priority: int, now: float) -> Prediction:
        c, ahead = self.clock(replica), self.ahead(replica, priority)
        busy = self.busy_above(replica, priority, now)
        alone = c.step_s + (ahead + tokens) * c.prefill_s_per_token
        ttft = alone / (1 - busy) if busy < MAX_BUSY else math.inf
        first = not any(p.tokens for p in c.pending)  # nothing at all ahead: it would start at once
        return Prediction(ttft_s=ttft, ahead=ahead, first=first)

    def claim(self, replica: str, tokens: int, priority: int, now: float, streamed: bool = True) -> Claim:
        """Count a request sent to the replica; the lower priorities already waiting there now wait for it too."""
        c = self.clock(replica)
        c.arrivals.setdefault(priority, Arrivals()).add(tokens, now, self.rates.window_s)
        for p in c.pending:
            if p.priority > priority:
                p.ahead += tokens
        claim = Claim(replica=replica, tokens=tokens, priority=priority, ahead=self.ahead(replica, priority),
                      sent=now, streamed=streamed)
        c.pending.append(claim)
        return claim

    def first_byte(self, claim: Claim, now: float) -> None:
        """The claim's first byte came: learn the replica's prefill rate from how long it took."""
        if not self.release(claim) or not claim.streamed:
            return
        c = self.clock(claim.replica)
        c.waited_s = self.mean(c.waited_s, max(0.0, now - claim.sent - c.step_s), c.prefill_samples)
        c.tokens = self.mean(c.tokens, float(claim.ahead + claim.tokens), c.prefill_samples)
        c.prefill_samples += 1

    def release(self, claim: Claim) -> bool:
        """Stop counting the claim (failed, or its client left): True the first time."""
        if not claim.open:
            return False
        claim.open = False
        c = self.clocks.get(claim.replica)
        if c is not None:
            c.pending.remove(claim)
        return c is not None

    def streamed(self, replica: str, chunks: int, seconds: float) -> None:
        """A stream's chunks after its first and their time: learn the replica's decode step."""
        if chunks < 2 or replica not in self.clocks:
            return
        c = self.clocks[replica]
        c.step_s = self.mean(c.step_s, seconds / (chunks - 1), c.step_samples)
        c.step_samples += 1

    def mean(self, old: float, new: float, samples: int) -> float:
        # the first sample replaces the prior outright: a prior off by 10x would otherwise linger for many requests
        return new if samples == 0 else old + self.rates.alpha * (new - old)

    def keep(self, replicas: list[str]) -> None:
        """Forget the replicas no longer listed (their pending claims release into nothing)."""
        for url in list(self.clocks):
            if url not in replicas:
                del self.clocks[url]


def retry_after(predicted: float, target: float) -> int:
    """Seconds until the work ahead has drained enough for the target, at least 1 (capped: the prediction has
    no bound when the higher priorities fill the replica)."""
    return max(1, min(60, math.ceil(predicted - target))) if predicted < math.inf else 10
