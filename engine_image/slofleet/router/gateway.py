"""Gateway duties: API keys and per-key quotas (requests and tokens per minute).

Keys come from a file (a Kubernetes Secret mounted as a volume is such a file; it is re-read when it changes, so
a rotated Secret applies without a restart) and/or an environment variable. File format, one key a line:

    sk-alice                      # default quotas
    sk-bob  rpm=60 tpm=20000      # this key's own quotas (0 = unlimited)

Tokens are charged up front as the prompt's estimated tokens plus the requested max_tokens (or a default when
absent): the router must decide before the engine has counted anything, and charging the bound keeps a client
from exceeding its budget by asking for long outputs."""
from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path


class GatewayError(Exception):
    def __init__(self, status: int, message: str, kind: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after


@dataclass
class KeyQuota:
    name: str  # a short label for logs and metrics; never the key itself
    rpm: float = 0.0
    tpm: float = 0.0


def parse_keys(text: str, rpm: float, tpm: float) -> dict[str, KeyQuota]:
    keys = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        key, opts = fields[0], dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        label = opts.get("name") or "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]
        keys[key] = KeyQuota(label, float(opts.get("rpm", rpm)), float(opts.get("tpm", tpm)))
    return keys


class KeyStore:
    """Keys from `path` and from env var `env` (comma or newline separated). No keys at all: auth is off."""

    def __init__(self, path: str | None, env: str | None, rpm: float = 0.0, tpm: float = 0.0):
        self.path, self.env, self.rpm, self.tpm = path, env, rpm, tpm
        self.keys: dict[str, KeyQuota] = {}
        self.mtime = -1.0
        self.reload()

    @property
    def enabled(self) -> bool:
        return bool(self.keys) or self.path is not None

    def reload(self) -> None:
        """Re-read the file if it changed (cheap enough to call every few seconds)."""
        mtime = os.stat(self.path).st_mtime if self.path and os.path.exists(self.path) else 0.0
        if mtime == self.mtime:
            return
        self.mtime = mtime
        text = Path(self.path).read_text() if mtime else ""
        if self.env and os.environ.get(self.env):
            text += "\n" + os.environ[self.env].replace(",", "\n")
        self.keys = parse_keys(text, self.rpm, self.tpm)

    def authenticate(self, headers: dict[str, str]) -> KeyQuota | None:
        if not self.enabled:
            return None
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not key:
            raise GatewayError(401, "missing API key: send it as 'Authorization: Bearer <key>'", "authentication_error")
        quota = self.keys.get(key)
        if quota is None:
            raise GatewayError(401, "invalid API key", "authentication_error")
        return quota


@dataclass
class Allowance:
    """A token bucket refilled continuously at limit/60 per second, holding at most one minute's limit."""
    limit: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.stamp) * self.limit / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        return max(0.0, (amount - self.level) * 60.0 / self.limit)


class Quotas:
    def __init__(self, default_max_tokens: int = 256):
        self.default_max_tokens = default_max_tokens
        self.state: dict[str, tuple[Allowance, Allowance]] = {}

    def charge(self, quota: KeyQuota, prompt_tokens: int, max_tokens: int | None) -> None:
        """Charge one request and its tokens, or raise 429 with the seconds until it would fit."""
        now = time.monotonic()
        reqs, toks = self.state.setdefault(quota.name, (Allowance(quota.rpm, quota.rpm, now),
                                                        Allowance(quota.tpm, quota.tpm, now)))
        reqs.limit, toks.limit = quota.rpm, quota.tpm  # a reloaded key file may change them
        cost = prompt_tokens + (self.default_max_tokens if max_tokens is None else max_tokens)
        if quota.tpm and cost > quota.tpm:
            raise GatewayError(429, f"this request needs ~{cost} tokens (prompt + max_tokens), more than the key's "
                                    f"whole quota of {quota.tpm:g} tokens per minute; lower max_tokens",
                               "rate_limit_exceeded", 60)
        for allowance, amount, what in ((reqs, 1.0, "requests"), (toks, cost, "tokens")):
            if allowance.limit:
                allowance.refill(now)
                if allowance.level < amount:
                    wait = math.ceil(allowance.wait_for(amount))
                    raise GatewayError(429, f"quota exceeded: {allowance.limit:g} {what} per minute for this key; "
                                            f"retry in {wait} s", "rate_limit_exceeded", max(1, wait))
        if reqs.limit:
            reqs.level -= 1.0
        if toks.limit:
            toks.level -= cost
