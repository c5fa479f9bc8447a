"""The operator's calls to engine pods (only while scaling a role down, see drain.py): their in-flight work from
/metrics, and draining (POST /v1/drain) or resuming (DELETE) one, with the service's internal token."""
from __future__ import annotations

import logging
import urllib.request

from slofleet.api.contract import NUM_RUNNING, NUM_WAITING, parse_samples, sum_by_name

log = logging.getLogger("slofleet.operator.engines")
TIMEOUT = 2.0


def url_of(pod: dict, port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}" if ip else None


def in_flight(base: str | None) -> float | None:
    """Requests running or waiting on the engine; None when it cannot be read (not up, or not reachable from
    here: the operator run outside the cluster)."""
    if base is None:
        return None
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=TIMEOUT) as r:
            sums = sum_by_name(parse_samples(r.read().decode()), {NUM_RUNNING, NUM_WAITING})
    except (OSError, ValueError):
        return None
    return sums[NUM_RUNNING] + sums[NUM_WAITING]


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
