"""The operator's calls to engine pods (only while scaling a role down, see drain.py): their in-flight work from
/metrics, and draining (POST /v1/drain) or resuming (DELETE) one, with the service's internal token."""
from __future__ import annotations

import logging
import urllib.request

from slofleet.api.contract import RUNTIME_METRICS, SLOFLEET, parse_samples, sum_by_name

log = logging.getLogger("slofleet.operator.engines")
TIMEOUT = 2.0


def in_flight(base: str | None, runtime: str = SLOFLEET) -> float | None:
    """Requests running or waiting on the engine, under its runtime's metric names; None when it cannot be read
    (not up, or not reachable from here: the operator run outside the cluster)."""
    names = {RUNTIME_METRICS[runtime].running, RUNTIME_METRICS[runtime].waiting}
    if base is None or None in names:
        return None
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=TIMEOUT) as r:
            sums = sum_by_name(parse_samples(r.read().decode()), names)
    except (OSError, ValueError):
        return None
    return sum(sums.values())


def set_draining(base: str | None, token: str, on: bool) -> bool:
    if base is None:
        return False
    req = urllib.request.Request(base + "/v1/drain", method="POST" if on else "DELETE",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT):
            return True
    except OSError as e:  # HTTPError too
        log.warning("%s %s: %s", "draining" if on else "resuming", base, e)
        return False
