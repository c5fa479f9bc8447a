"""How a failed reconcile reaches kopf: a refusal of the API server that a retry cannot change is permanent, the
rest is retried after a delay; both leave a ReconcileFailed warning. Pure: a stand-in Kube, no cluster."""
from __future__ import annotations

import json

import kopf
import pytest
from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import api_exception

from slofleet.operator import handlers
from tests.support.kube import StandInKube

BODY = {"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "s", "namespace": "ns", "uid": "uid-1", "generation": 1}, "spec": {}}


def refusal(status: int, reason: str) -> Exception:
    """What the dynamic client raises for an HTTP answer `status`."""
    e = ApiException(status=status, reason=reason)
    e.body = json.dumps({"kind": "Status", "code": status, "message": f"the API server says {reason}"})
    return api_exception(e)


@pytest.mark.parametrize("error, permanent", [
    (refusal(422, "Unprocessable Entity"), True), (refusal(403, "Forbidden"), True),
    (refusal(400, "Bad Request"), True), (refusal(409, "Conflict"), False), (refusal(429, "Too Many Requests"), False),
    (refusal(500, "Internal Server Error"), False), (ConnectionRefusedError("API server down"), False),
])
def test_refusals_are_permanent_and_the_rest_is_retried_later(monkeypatch, error, permanent):
    warned = []
    monkeypatch.setattr(handlers, "_kube", StandInKube(error))
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append((reason, message)))
    with pytest.raises((kopf.PermanentError, kopf.TemporaryError)) as raised:
        handlers.reconcile_once(BODY, "create")
    assert isinstance(raised.value, kopf.PermanentError) is permanent
    if not permanent:
        assert raised.value.delay == handlers.RETRY_SECONDS
    assert raised.value.__cause__ is error
    ((reason, message),) = warned
    assert reason == "ReconcileFailed" and str(error)[:100] in message
