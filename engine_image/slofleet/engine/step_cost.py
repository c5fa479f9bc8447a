"""The engine's own step-cost model, refitted online: seconds = fixed + per_seq x sequences + per_token x prompt tokens.

The scheduler asks it how many prompt tokens a step may add before the step outlasts the tightest TPOT target among
the running decodes (`prompt_budget`), so a document's chunk never stretches a chat's time per output token past its
target. The fit is least squares over the last WINDOW steps, with a small ridge so that a window of decode-only
steps (no prompt tokens to fit on) keeps the previous per-token cost instead of an arbitrary one.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

WINDOW = 128  # steps in the fit: a few seconds of serving, so a change of load shape is learnt quickly
REFIT_EVERY = 8
RIDGE = 1e-3
# Steps of varied shape run at start where buckets have TPOT targets, so the first document's chunks are sized
# from this machine's cost rather than guessed: (prompt tokens, requests added at once).
CALIBRATION = ((16, 1), (96, 2), (48, 4), (200, 1), (24, 8), (128, 3))


def solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a @ x = b for a 3x3 system (Cramer's rule), None when singular."""
    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
    d = det(a)
    if abs(d) < 1e-18:
        return None
    return [det([[b[r] if c == k else a[r][c] for c in range(3)] for r in range(3)]) / d for k in range(3)]


@dataclass(slots=True, kw_only=True)
class StepCost:
    fixed: float = 0.0
    per_seq: float = 0.0
    per_token: float = 0.0
    steps: deque[tuple[int, int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _since_fit: int = 0

    @property
    def fitted(self) -> bool:
        return self.per_token > 0

    def observe(self, seqs: int, prompt_tokens: int, seconds: float) -> None:
        self.steps.append((seqs, prompt_tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self.fit()

    def fit(self) -> None:
        self._since_fit = 0
        # Features scaled to similar magnitudes (prompt tokens run in the hundreds) before the ridge is added.
        rows = [(1.0, s / 10, p / 100, t) for s, p, t in self.steps]
        if len(rows) < REFIT_EVERY:
            return
        prior = [self.fixed, self.per_seq * 10, self.per_token * 100]
        ridge = RIDGE * len(rows)
        a = [[sum(r[i] * r[j] for r in rows) + (ridge if i == j else 0) for j in range(3)] for i in range(3)]
        b = [sum(r[i] * r[3] for r in rows) + ridge * prior[i] for i in range(3)]
        x = solve3(a, b)
        if x is None or x[2] <= 0:
            return  # no prompt work in the window to learn its cost from: keep the last fit
        self.fixed, self.per_seq, self.per_token = max(0.0, x[0]), max(0.0, x[1] / 10), x[2] / 100

    def __str__(self) -> str:
        return (f"{self.fixed * 1e3:.1f} ms + {self.per_seq * 1e3:.2f} ms a sequence + "
                f"{self.per_token * 1e3:.3f} ms a prompt token")

    def predict(self, seqs: int, prompt_tokens: int) -> float:
        return self.fixed + self.per_seq * seqs + self.per_token * prompt_tokens

    def prompt_budget(self, seqs: int, seconds: float) -> int | None:
        """Prompt tokens a step with `seqs` sequences may add and still end within `seconds`; None before the
        first fit (no bound)."""
        if not self.fitted:
            return None
        return max(0, int((seconds - self.fixed - self.per_seq * seqs) / self.per_token))
