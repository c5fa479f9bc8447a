"""Gateway duties: API keys and per-key quotas (requests and tokens per minute).

Keys come from a file (a Kubernetes Secret mounted as a volume is such a file; it is re-read when it changes, so
a rotated Secret applies without a restart) and/or an environment variable. File format, one key a line:

    sk-alice                      # default quotas
    sk-bob  rpm=60 tpm=20000      # this key's own quotas (0 = unlimited)

A file that does not parse (an unknown option, a quota that is not a number >= 0, a key listed twice) fails the
start; on a reload it is logged and the keys already loaded stay in force, as they do while the file is briefly
missing during a Secret's update. Presented keys are compared in constant time against the SHA-256 of every key.

Tokens are charged up front as the prompt's estimated tokens plus the output the request allows (its max_tokens,
else what the engine would generate): the router must decide before the engine has counted anything, and charging
the bound keeps a client from exceeding its budget by asking for long outputs."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("slofleet.router.gateway")
OPTIONS = ("name", "rpm", "tpm")


class GatewayError(Exception):
    def __init__(self, status: int, message: str, kind: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.retry_after = status, message, kind, retry_after


@dataclass
class KeyQuota:
    name: str  # a short label for logs and metrics; never the key itself
    rpm: float = 0.0
    tpm: float = 0.0


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, rpm: float, tpm: float) -> dict[bytes, KeyQuota]:
    """SHA-256 of each key -> its quotas. Raises ValueError naming the line (never the key) of a malformed one."""
    keys: dict[bytes, KeyQuota] = {}
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        opts = dict(f.partition("=")[::2] for f in fields[1:])
        bad = [i for i, f in enumerate(fields[1:], 2) if f.partition("=")[0] not in OPTIONS]
        if bad:  # named by position: a mistyped line may hold a second key
            raise ValueError(f"API keys line {n}: field {bad[0]} is not name=, rpm= or tpm=")
        h = digest(fields[0])
        if h in keys:
            raise ValueError(f"API keys line {n}: the key is listed twice")
        try:
            quota = KeyQuota(opts.get("name") or "key-" + h.hex()[:8], float(opts.get("rpm", rpm)),
                             float(opts.get("tpm", tpm)))
        except ValueError:
            raise ValueError(f"API keys line {n}: rpm and tpm must be numbers") from None
        if not (quota.rpm >= 0 and quota.tpm >= 0):  # also refuses NaN
            raise ValueError(f"API keys line {n}: rpm and tpm must be >= 0")
        keys[h] = quota
    return keys


class KeyStore:
    """Keys from `path` and from env var `env` (comma or newline separated). No keys at all: auth is off."""

    def __init__(self, path: str | None, env: str | None, rpm: float = 0.0, tpm: float = 0.0):
        self.path, self.env, self.rpm, self.tpm = path, env, rpm, tpm
        self.keys: dict[bytes, KeyQuota] = {}
        self.mtime, self.failed = -1.0, None  # the last reload's (file version, error)
        self.load(os.stat(path).st_mtime if path and os.path.exists(path) else 0.0)

    @property
    def enabled(self) -> bool:
        return bool(self.keys) or self.path is not None

    def load(self, mtime: float) -> None:
        text = Path(self.path).read_text() if mtime else ""
        if self.env and os.environ.get(self.env):
            text += "\n" + os.environ[self.env].replace(",", "\n")
        self.keys, self.mtime = parse_keys(text, self.rpm, self.tpm), mtime

    def reload(self) -> None:
        """Re-read the file if it changed (cheap enough to call every few seconds); keep the loaded keys when
        it is unreadable, malformed or missing."""
        mtime = None
        try:
            mtime = os.stat(self.path).st_mtime if self.path else 0.0
            if mtime != self.mtime:
                self.load(mtime)
                log.info("API keys reloaded: %d keys", len(self.keys))
        except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            if self.failed != (mtime, str(e)):  # once per version of the file, not every few seconds
                log.error("API keys file %s not reloaded, the %d keys loaded before stay in force: %s",
                          self.path, len(self.keys), e)
            self.failed = (mtime, str(e))
        else:
            self.failed = None

    def authenticate(self, headers: dict[str, str]) -> KeyQuota | None:
        if not self.enabled:
            return None
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
        if not key:
            raise GatewayError(401, "missing API key: send it as 'Authorization: Bearer <key>'", "authentication_error")
        # Every key is compared, in constant time, on SHA-256 digests: the time taken reveals neither how much
        # of a key matched nor how long it is.
        h, found = digest(key), None
        for known, quota in self.keys.items():
            if hmac.compare_digest(known, h):
                found = quota
        if found is None:
            raise GatewayError(401, "invalid API key", "authentication_error")
        return found


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
    def __init__(self):
        self.state: dict[str, tuple[Allowance, Allowance]] = {}

    def charge(self, quota: KeyQuota, prompt_tokens: int, output_tokens: int) -> None:
        """Charge one request and its tokens, or raise 429 with the seconds until it would fit."""
        now = time.monotonic()
        reqs, toks = self.state.setdefault(quota.name, (Allowance(quota.rpm, quota.rpm, now),
                                                        Allowance(quota.tpm, quota.tpm, now)))
        reqs.limit, toks.limit = quota.rpm, quota.tpm  # a reloaded key file may change them
        cost = prompt_tokens + output_tokens
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


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too deep, a number past the digit limit
        raise GatewayError(400, f"the request body is not valid JSON: {e}", "invalid_request_error") from None
