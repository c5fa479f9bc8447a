"""Pure: the routers' admission counters -> each bucket's admitted and refused requests over a window.

A request refused at admission (429 before any engine work) never reaches an engine's metrics, yet it is demand:
with SLO-predicted admission a growing queue shows up as refusals. So the policy's offered load is what the
engines saw arrive plus what the routers refused (signals.window), and status.buckets[] shows both counts.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from slofleet.api.contract import ROUTER_ADMITTED, ROUTER_REFUSED, Sample

ADMITTED, REFUSED = f"{ROUTER_ADMITTED}_total", f"{ROUTER_REFUSED}_total"


@dataclass(slots=True, kw_only=True)
class Admissions:
    """Cumulative counts at time `t`: admitted by bucket, refused by bucket and reason (summed over routers)."""
    t: float
    admitted: dict[str, float] = field(default_factory=dict)
    refused: dict[str, dict[str, float]] = field(default_factory=dict)

    def refused_by_bucket(self) -> dict[str, float]:
        return {b: sum(r.values()) for b, r in self.refused.items()}

    def plus(self, other: Admissions) -> Admissions:
        out = Admissions(t=max(self.t, other.t), admitted=dict(self.admitted),
                         refused={b: dict(r) for b, r in self.refused.items()})
        for b, n in other.admitted.items():
            out.admitted[b] = out.admitted.get(b, 0.0) + n
        for b, reasons in other.refused.items():
            mine = out.refused.setdefault(b, {})
            for reason, n in reasons.items():
                mine[reason] = mine.get(reason, 0.0) + n
        return out

    def minus(self, old: Admissions | None) -> Admissions:
        """The counts since `old`; a count that went down (a router restarted) counts from zero."""
        if old is None:
            return self
        since = lambda new, was: new - was if new >= was else new  # noqa: E731
        return Admissions(t=self.t, admitted={b: since(n, old.admitted.get(b, 0.0)) for b, n in self.admitted.items()},
                          refused={b: {r: since(n, old.refused.get(b, {}).get(r, 0.0)) for r, n in reasons.items()}
                                   for b, reasons in self.refused.items()})


def from_samples(samples: Iterable[Sample], t: float) -> Admissions:
    """One router's /metrics samples."""
    out = Admissions(t=t)
    for s in samples:
        bucket = s.labels.get("bucket", "")
        if s.name == ADMITTED:
            out.admitted[bucket] = out.admitted.get(bucket, 0.0) + s.value
        elif s.name == REFUSED:
            reasons = out.refused.setdefault(bucket, {})
            reasons[s.labels.get("reason", "")] = reasons.get(s.labels.get("reason", ""), 0.0) + s.value
    return out


@dataclass
class Ledger:
    """The routers' summed counts over the last `window_s` seconds, scrape by scrape."""
    window_s: float
    seen: list[Admissions] = field(default_factory=list)

    def add(self, a: Admissions) -> None:
        self.seen = [s for s in self.seen if s.t >= a.t - self.window_s] + [a]

    def window(self) -> Admissions | None:
        """What the routers admitted and refused between the oldest scrape kept and the newest; None until two."""
        if len(self.seen) < 2:
            return None
        return self.seen[-1].minus(self.seen[0])
