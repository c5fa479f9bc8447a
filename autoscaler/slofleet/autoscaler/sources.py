"""Where a role's metrics come from: each pod's own /metrics, or a Prometheus server's /federate endpoint
(which answers in the same text format, one series per pod, filtered by the labels a ServiceMonitor gives).

Every source answers one RoleSignals per pod that answered; an unreachable pod or server is missing data,
never zero load, so it is left out (and a role nobody answered for comes out stale).
"""
from __future__ import annotations

import json
import sys
import time
import urllib.parse
import urllib.request

from slofleet.api.contract import ROUTER_HELD, SLOFLEET, Sample, parse_samples, sum_by_name

from . import admissions
from .signals import RoleSignals, from_samples, parse

# What the policy reads; federating only these keeps the answer small.
FEDERATE_MATCH = '{{__name__=~"vllm:.*|llamacpp:.*|slofleet:.*",namespace="{namespace}",service="{service}"}}'


def scrape_error(where: str, e: Exception) -> None:
    print(json.dumps({"scrape_error": where, "error": str(e)}), file=sys.stderr, flush=True)


def fetch(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode()
    except (OSError, ValueError) as e:
        scrape_error(url, e)
        return None


def scrape(url: str, role: str, timeout: float, runtime: str = SLOFLEET) -> RoleSignals | None:
    """One engine's (or, with role ROUTER, a router's) /metrics at its base URL."""
    text = fetch(url.rstrip("/") + "/metrics", timeout)
    if text is None:
        return None
    try:
        return parse(text, role, time.time(), runtime)
    except ValueError as e:  # a half-written answer: missing data as well
        scrape_error(url, e)
        return None


def held_requests(url: str, timeout: float) -> float | None:
    """A router pod's held requests (summed over its labels); None when it did not answer readably."""
    text = fetch(url.rstrip("/") + "/metrics", timeout)
    if text is None:
        return None
    try:
        return sum_by_name(parse_samples(text), {ROUTER_HELD})[ROUTER_HELD]
    except ValueError as e:
        scrape_error(url, e)
        return None


def router_admissions(url: str, timeout: float) -> admissions.Admissions | None:
    """A router pod's admission counters; None when it did not answer readably."""
    text = fetch(url.rstrip("/") + "/metrics", timeout)
    if text is None:
        return None
    try:
        return admissions.from_samples(parse_samples(text), time.time())
    except ValueError as e:
        scrape_error(url, e)
        return None


def federate(prometheus: str, namespace: str, service: str, role: str, timeout: float,
             runtime: str = SLOFLEET) -> list[RoleSignals]:
    """One role's pods as Prometheus last scraped them: the series of the Kubernetes Service `service`
    (the operator's `<name>-<role>`), grouped by their `pod` label. Each pod's time is its newest sample's,
    so windows span what Prometheus saw, not when we asked."""
    query = urllib.parse.urlencode({"match[]": FEDERATE_MATCH.format(namespace=namespace, service=service)})
    text = fetch(f"{prometheus.rstrip('/')}/federate?{query}", timeout)
    if text is None:
        return []
    by_pod: dict[str, list[Sample]] = {}
    try:
        for s in parse_samples(text):
            by_pod.setdefault(s.labels.get("pod") or s.labels.get("instance", ""), []).append(s)
    except ValueError as e:
        scrape_error(prometheus, e)
        return []
    now = time.time()
    return [from_samples(samples, role, max((s.timestamp for s in samples if s.timestamp), default=now), pod, runtime)
            for pod, samples in by_pod.items()]
