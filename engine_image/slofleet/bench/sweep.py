"""`slofleet bench --sweep RATES`: the goodput curve. Each offered rate runs open-loop with its own seed (fresh prompts,
so no rate is served from the previous rate's prefix cache); per rate and bucket it counts offered, admitted, refused
(429: told at once to retry, so not failed, but not within SLO either) and failed requests, and those within their
SLO. Goodput is the offered rate times the share of offered requests within SLO; the knee is the highest rate at
which at least KNEE_SHARE of the offered requests are within SLO."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .loadgen import Result
from .report import good
from .workload import Target

KNEE_SHARE = 0.95
REFUSED = 429


@dataclass(slots=True, kw_only=True)
class Tally:
    """One bucket's requests at one rate (or all buckets together)."""
    offered: int = 0
    refused: int = 0  # 429
    failed: int = 0  # admitted, then an error or no answer
    within: int = 0  # answered within every target of the bucket's SLO

    @property
    def admitted(self) -> int:
        return self.offered - self.refused

    @property
    def attainment(self) -> float:
        return self.within / self.offered if self.offered else math.nan

    def add(self, other: Tally) -> None:
        self.offered += other.offered
        self.refused += other.refused
        self.failed += other.failed
        self.within += other.within


@dataclass(slots=True, kw_only=True)
class RatePoint:
    rate: float  # offered, requests per second
    seed: int
    buckets: dict[str, Tally] = field(default_factory=dict)

    @property
    def total(self) -> Tally:
        out = Tally()
        for t in self.buckets.values():
            out.add(t)
        return out

    def goodput(self, bucket: str | None = None) -> float:
        """Requests within SLO per second: the offered rate times their share of all offered requests."""
        total = self.total
        within = total.within if bucket is None else self.buckets[bucket].within
        return self.rate * within / total.offered if total.offered else 0.0


def tally(results: list[Result], target: Target | None) -> Tally:
    t = Tally(offered=len(results))
    for r in results:
        if r.status == REFUSED:
            t.refused += 1
        elif r.status != 200 or r.ttft is None:
            t.failed += 1
        elif good(r, target):
            t.within += 1
    return t


def point(rate: float, seed: int, results: list[Result], targets: dict[str, Target]) -> RatePoint:
    """One rate's tallies per bucket; a request of a bucket without a target is never within SLO."""
    names = sorted({r.bucket for r in results})
    return RatePoint(rate=rate, seed=seed, buckets={b: tally([r for r in results if r.bucket == b], targets.get(b))
                                                    for b in names})


def knee(points: list[RatePoint], share: float = KNEE_SHARE) -> float | None:
    """The highest offered rate with at least `share` of its offered requests within SLO; None when none has."""
    ok = [p.rate for p in points if p.total.offered and p.total.attainment >= share]
    return max(ok) if ok else None


def parse_rates(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0]; ValueError naming what is wrong."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes comma-separated rates in requests per second, got {text!r}") from None
    if not rates or not all(0 < r < math.inf for r in rates):
        raise ValueError(f"--sweep rates must be positive and finite, got {text!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--sweep lists a rate twice: {text!r}")
    return sorted(rates)


def table(points: list[RatePoint]) -> str:
    names = sorted({b for p in points for b in p.buckets})
    head = f"{'rate/s':>7s} {'offered':>7s} {'admitted':>8s} {'refused':>7s} {'failed':>6s} {'in SLO':>7s} " \
           f"{'goodput/s':>9s}  " + "  ".join(f"{n + ' goodput/s (in SLO)':>26s}" for n in names)
    lines = [head]
    for p in points:
        t = p.total
        cells = "  ".join(f"{p.goodput(n):>15.2f} ({p.buckets[n].attainment:>6.1%})" if n in p.buckets
                          else f"{'-':>26s}" for n in names)
        lines.append(f"{p.rate:>7g} {t.offered:>7d} {t.admitted:>8d} {t.refused:>7d} {t.failed:>6d} "
                     f"{t.attainment:>7.1%} {p.goodput():>9.2f}  {cells}")
    k = knee(points)
    lines.append(f"knee: {k:g} req/s (the highest rate with >= {KNEE_SHARE:.0%} of offered requests within SLO)"
                 if k is not None else f"knee: none (no rate had >= {KNEE_SHARE:.0%} of offered requests within SLO)")
    return "\n".join(lines)


def as_json(points: list[RatePoint]) -> dict:
    rows = []
    for p in points:
        t = p.total
        rows.append({"rate": p.rate, "seed": p.seed, "offered": t.offered, "admitted": t.admitted,
                     "refused": t.refused, "failed": t.failed, "within_slo": t.within, "attainment": t.attainment,
                     "goodput": p.goodput(),
                     "buckets": {n: {"offered": b.offered, "admitted": b.admitted, "refused": b.refused,
                                     "failed": b.failed, "within_slo": b.within, "attainment": b.attainment,
                                     "goodput": p.goodput(n)} for n, b in p.buckets.items()}})
    return {"knee": knee(points), "knee_share": KNEE_SHARE, "rates": rows}


def plot(points: list[RatePoint], path: str, title: str) -> bool:
    """Goodput per bucket and in all against the offered rate (dashed: goodput if every request were within SLO),
    and the share refused; False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p.rate for p in points]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.plot(rates, rates, ls="--", color="grey", lw=0.8, label="offered")
    ax.plot(rates, [p.goodput() for p in points], marker="o", color="k", label="all buckets")
    for i, n in enumerate(sorted({b for p in points for b in p.buckets})):
        ax.plot(rates, [p.goodput(n) if n in p.buckets else 0.0 for p in points], marker=".", color=f"C{i}", label=n)
    if (k := knee(points)) is not None:
        ax.axvline(k, color="r", ls=":", lw=1, label=f"knee {k:g}/s")
    ax.set(title="goodput (requests within SLO per second)", xlabel="offered req/s", ylabel="req/s")
    bx.plot(rates, [p.total.refused / max(1, p.total.offered) for p in points], marker="o", label="refused (429)")
    bx.plot(rates, [p.total.attainment for p in points], marker="o", label="within SLO")
    bx.axhline(KNEE_SHARE, color="r", ls=":", lw=1)
    bx.set(title="share of offered requests", xlabel="offered req/s", ylim=(0, 1.05))
    for a in (ax, bx):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True
