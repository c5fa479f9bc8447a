"""Request traces for the simulator: the three real ones (see data/SOURCES.md for their licences) replayed
and time-scaled, and a synthesized 24-hour day built from them."""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
FILES = {"conversation": "azure2023_conv.csv", "code": "azure2023_code.csv", "long": "mooncake_conversation.jsonl"}
# Published Azure 2024 week-long figures (data/SOURCES.md): peak/mean of the diurnal load per service.
PEAK_TO_MEAN = {"conversation": 1.9, "code": 3.5, "long": 1.9}


@dataclass
class Trace:
    name: str
    arrival: np.ndarray  # seconds from the start, sorted
    prompt: np.ndarray  # prompt tokens
    output: np.ndarray  # generated tokens (>= 1)
    bucket: np.ndarray | None = None  # each request's bucket (an index into the simulator's buckets); None: all 0

    def classes(self) -> np.ndarray:
        return np.zeros(len(self.arrival), np.int64) if self.bucket is None else self.bucket

    @property
    def duration(self) -> float:
        return float(self.arrival[-1]) if len(self.arrival) else 0.0

    @property
    def rate(self) -> float:
        return len(self.arrival) / max(self.duration, 1e-9)

    def head(self, seconds: float) -> Trace:
        n = int(np.searchsorted(self.arrival, seconds))
        return Trace(self.name, self.arrival[:n], self.prompt[:n], self.output[:n], self.classes()[:n])


@functools.cache  # parsed once per process; callers never modify a Trace's arrays
def load(name: str) -> Trace:
    path = DATA / FILES[name]
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        t = np.array([r["timestamp"] for r in rows], dtype=np.float64) / 1000.0
        p = np.array([r["input_length"] for r in rows])
        o = np.array([r["output_length"] for r in rows])
    else:
        cols = np.loadtxt(path, delimiter=",", skiprows=1, dtype=str)
        # 7 decimal digits of seconds; microseconds are plenty
        stamps = np.array([s[:26] for s in cols[:, 0]], dtype="datetime64[us]")
        t = (stamps - stamps.min()).astype(np.float64) / 1e6
        p, o = cols[:, 1].astype(np.int64), cols[:, 2].astype(np.int64)
    order = np.argsort(t, kind="stable")
    return Trace(name, t[order] - t[order][0], np.maximum(p[order], 1).astype(np.int32),
                 np.maximum(o[order], 1).astype(np.int32))


def scale(trace: Trace, speed: float) -> Trace:
    """Replay `speed` times faster: the same requests, arrival rate x speed."""
    return Trace(trace.name, trace.arrival / speed, trace.prompt, trace.output, trace.bucket)


def overlay(trace: Trace, factor: float, seed: int = 0) -> Trace:
    """`factor` times the load at real time: the trace itself plus copies shifted by a random offset (wrapping
    around its end), the last copy thinned to the fraction left. Unlike `scale`, a burst keeps its length, so
    the scrape, decision and cold-start clocks meet the trace's own time scale, as a fleet serving many users of
    the same kind of traffic would."""
    rng = np.random.default_rng(seed)
    span, whole = trace.duration, int(factor)
    copies = whole + (factor - whole > 1e-9)
    parts = []
    for i in range(copies):
        keep = np.ones(len(trace.arrival), bool) if i < whole else rng.random(len(trace.arrival)) < factor - whole
        shift = rng.random() * span if i else 0.0
        parts.append((np.fmod(trace.arrival[keep] + shift, span + 1e-9), np.flatnonzero(keep)))
    t = np.concatenate([a for a, _ in parts])
    pick = np.concatenate([k for _, k in parts])
    order = np.argsort(t, kind="stable")
    return Trace(trace.name, t[order], trace.prompt[pick[order]], trace.output[pick[order]],
                 None if trace.bucket is None else trace.bucket[pick[order]])


def diurnal(peak_to_mean: float, seconds: int, peak_hour: float = 14.0) -> np.ndarray:
    """A smooth daily curve with mean 1 and the given peak/mean: exp(k cos(...)), whose peak/mean is
    e^k / I0(k); k is found by bisection."""
    lo, hi = 0.0, 10.0
    for _ in range(60):
        k = (lo + hi) / 2
        lo, hi = (k, hi) if np.exp(k) / np.i0(k) < peak_to_mean else (lo, k)
    phase = 2 * np.pi * (np.arange(seconds) / 86400.0 - peak_hour / 24.0)
    curve = np.exp(k * np.cos(phase))
    return curve / curve.mean()


def burst_shape(trace: Trace, smooth_s: int = 5) -> np.ndarray:
    """Second-level modulation (mean 1) from a real trace: per-second arrival counts over a short moving
    average, so the trace's own Poisson noise is not added twice to the synthesized day's."""
    counts = np.bincount(trace.arrival.astype(np.int64)).astype(np.float64)
    shape = np.convolve(counts, np.ones(smooth_s) / smooth_s, mode="same")
    return shape / shape.mean()


def synth_day(base: Trace, peak_rate: float, hours: float = 24.0, peak_to_mean: float | None = None,
              seed: int = 0) -> Trace:
    """A day whose hourly shape follows the published diurnal peak/mean and whose second-level bursts are
    the base trace's (tiled with a random shift per hour); request lengths are resampled from the base.
    Scaled so that its busiest minute expects `peak_rate` requests/s."""
    rng = np.random.default_rng(seed)
    seconds = int(hours * 3600)
    ptm = peak_to_mean or PEAK_TO_MEAN[base.name]
    shape = burst_shape(base)
    tiles = [np.roll(shape, rng.integers(len(shape))) for _ in range(seconds // len(shape) + 1)]
    rate = diurnal(ptm, 86400)[np.arange(seconds) % 86400] * np.concatenate(tiles)[:seconds]
    minutes = rate[: len(rate) // 60 * 60].reshape(-1, 60).mean(axis=1)
    counts = rng.poisson(rate * peak_rate / minutes.max())
    t = np.repeat(np.arange(seconds, dtype=np.float64), counts) + rng.random(int(counts.sum()))
    t.sort()
    pick = rng.integers(len(base.arrival), size=len(t))
    return Trace(f"{base.name}-day", t, base.prompt[pick], base.output[pick])
