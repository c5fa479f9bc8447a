"""The policy's load forecast, from nothing but the windows it has read: the level of the latest samples, the
trend of a least-squares line through a longer span (so that one burst is not a trend), yesterday's curvature
once a whole season (a day) has been seen, and the forecast's own error, measured as each forecast comes due,
from which the policy takes its headroom."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

MIN_ERRORS = 20  # forecasts come due before their error sets the headroom


@dataclass
class Forecaster:
    trend_s: float = 1800.0  # the trend's line is fitted through the samples of this span
    level_s: float = 60.0  # the level is the mean of the samples of this span (each one a window itself)
    season_s: float = 86400.0
    slot_s: float = 300.0  # resolution of the seasonal profile
    keep_s: float = 3600.0  # forecast errors are kept this long
    samples: deque = field(default_factory=deque)  # (time, value) within trend_s
    level: float | None = None  # the line at the newest sample
    noise: float = 0.0  # the newest sample's counting noise, relative to it
    trend: float = 0.0  # its slope, per second
    pending: deque = field(default_factory=deque)  # (due time, forecast)
    errors: deque = field(default_factory=deque)  # (time, log(actual / forecast))
    season: int | None = None  # the season the slots below are filling
    sums: np.ndarray | None = None
    counts: np.ndarray | None = None
    last: np.ndarray | None = None  # the previous season's mean per slot (nan: not seen)

    @property
    def t(self) -> float:
        return self.samples[-1][0] if self.samples else -math.inf

    def add(self, t: float, y: float, n: float = math.inf) -> None:
        """A window's value `y`, timed at the window's middle, counted from `n` requests."""
        if t <= self.t:
            return
        while self.pending and self.pending[0][0] <= t:
            error = math.log((y + 1e-9) / (self.pending.popleft()[1] + 1e-9))
            self.errors.append((t, min(max(error, -1.0), 1.0)))  # a forecast near zero is not a factor of e^20
        while self.errors and self.errors[0][0] < t - self.keep_s:
            self.errors.popleft()
        self.samples.append((t, y))
        # two standard deviations of a count of n bursty arrivals (variance about 4n; a Poisson count's is n)
        self.noise = 4 / math.sqrt(max(n, 1.0))
        while self.samples[0][0] < t - self.trend_s:
            self.samples.popleft()
        ts, ys = np.array(self.samples).T
        var = float(((ts - ts.mean()) ** 2).sum())
        self.trend = float(((ts - ts.mean()) * (ys - ys.mean())).sum()) / var if len(ts) >= 3 and var else 0.0
        near = ts >= t - self.level_s
        self.level = float(ys[near].mean()) + self.trend * (t - float(ts[near].mean()))
        self.remember(t, y)

    def remember(self, t: float, y: float) -> None:
        season, slots = int(t // self.season_s), int(round(self.season_s / self.slot_s))
        if season != self.season:
            if self.sums is not None:  # the season just ended becomes the profile, unless seasons were skipped
                with np.errstate(invalid="ignore"):
                    self.last = self.sums / self.counts if season == self.season + 1 else None
            self.season, self.sums, self.counts = season, np.zeros(slots), np.zeros(slots)
        slot = int(t % self.season_s // self.slot_s) % slots
        self.sums[slot] += y
        self.counts[slot] += 1

    def seasonal(self, t: float) -> float:
        """The previous season's profile at `t`, linear between slot middles (nan where it was not seen)."""
        if self.last is None:
            return math.nan
        x = t % self.season_s / self.slot_s - 0.5
        i, f = math.floor(x), x - math.floor(x)
        return (1 - f) * self.last[i % len(self.last)] + f * self.last[(i + 1) % len(self.last)]

    def at(self, when: float) -> float:
        """Level plus trend until `when`, bent by the curvature the previous season had over the same span (a
        linear trend misses the turns of the day); never below the newest sample when it rises above the level by
        more than its counting noise, so a step counts at once while a small window's noise does not."""
        if self.level is None:
            return 0.0
        h = when - self.t
        f = self.level + self.trend * h
        bend = self.seasonal(when) - 2 * self.seasonal(self.t) + self.seasonal(self.t - h)
        if math.isfinite(bend):
            f += bend
        recent = self.samples[-1][1]
        return max(f, recent if recent > self.level * (1 + self.noise) else 0.0, 0.0)

    def predict(self, when: float) -> float:
        """The forecast the policy acts on; its error is measured when `when` comes."""
        f = self.at(when)
        self.pending.append((when, f))
        return f

    def headroom(self, q: float) -> float:
        """The factor over the forecast that would have covered share `q` of the recent outcomes (1 until enough
        forecasts have come due)."""
        if len(self.errors) < MIN_ERRORS:
            return 1.0
        return math.exp(float(np.quantile([e for _, e in self.errors], q)))
