"""The operator's Kubernetes API access: server-side apply of children, listing them, pruning, status patches.

Server-side apply under one field manager makes every reconcile idempotent (an unchanged object is not
written) and restart-safe (children have fixed names, so a second operator run adopts rather than duplicates).
"""
from __future__ import annotations

import time

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from slofleet.api.contract import SERVICE_LABEL, load_kube_config
from slofleet.api.v1alpha1 import API_VERSION

FIELD_MANAGER = "slofleet-operator"
# Kinds the operator owns and prunes (the ServiceMonitor and InferencePool only where their CRDs exist).
CHILD_KINDS = [("v1", "ConfigMap"), ("apps/v1", "Deployment"), ("v1", "Service"),
               ("policy/v1", "PodDisruptionBudget"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
               ("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "Secret"),
               ("networking.k8s.io/v1", "NetworkPolicy"), ("inference.networking.k8s.io/v1", "InferencePool")]


def connect() -> dynamic.DynamicClient:
    load_kube_config()
    return dynamic.DynamicClient(client.ApiClient())


def permanent(e: BaseException) -> bool:
    """The API server refused in a way a retry does not change (422 invalid, 403 forbidden, ...): a 4xx answer
    other than 409 Conflict (written meanwhile) and 429 Too Many Requests. The dynamic client's errors are
    ApiExceptions too."""
    return isinstance(e, ApiException) and e.status is not None and 400 <= e.status < 500 and e.status not in (409, 429)


class Kube:
    def __init__(self, dyn: dynamic.DynamicClient, discovery_ttl: float = 60.0):
        self.dyn = dyn
        self.discovery_ttl = discovery_ttl
        self._kinds: dict[tuple[str, str], tuple[float, bool]] = {}

    def _res(self, api_version: str, kind: str):
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def has_kind(self, api_version: str, kind: str) -> bool:
        # Remembered for a while: a miss makes the dynamic client rediscover every API group.
        seen = self._kinds.get((api_version, kind))
        if seen and time.monotonic() - seen[0] < self.discovery_ttl:
            return seen[1]
        try:
            self._res(api_version, kind)
            found = True
        except ResourceNotFoundError:
            found = False
        self._kinds[(api_version, kind)] = (time.monotonic(), found)
        return found

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return self._res(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def get_policy(self, namespace: str, name: str) -> dict | None:
        return self.get(API_VERSION, "SLOPolicy", namespace, name)

    def apply(self, obj: dict) -> dict:
        meta = obj["metadata"]
        res = self._res(obj["apiVersion"], obj["kind"])
        return res.server_side_apply(body=obj, name=meta["name"], namespace=meta["namespace"],
                                     field_manager=FIELD_MANAGER, force_conflicts=True).to_dict()

    def children(self, namespace: str, service: str) -> dict[tuple[str, str], dict]:
        """(kind, name) -> object, for every existing child of `service` (found by label, owned by uid)."""
        out: dict[tuple[str, str], dict] = {}
        for api_version, kind in CHILD_KINDS:
            if not self.has_kind(api_version, kind):
                continue
            try:
                items = self._res(api_version, kind).get(namespace=namespace,
                                                         label_selector=f"{SERVICE_LABEL}={service}").to_dict()
            except NotFoundError:  # its CRD went away since discovery (which the client caches on disk)
                self._kinds[(api_version, kind)] = (time.monotonic(), False)
                continue
            for item in items.get("items", []):
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                out[(kind, item["metadata"]["name"])] = item
        return out

    def pods(self, namespace: str, service: str) -> list[dict]:
        """The service's engine and router pods (for their containers' state)."""
        return self._res("v1", "Pod").get(namespace=namespace,
                                          label_selector=f"{SERVICE_LABEL}={service}").to_dict().get("items", [])

    def delete(self, obj: dict) -> None:
        meta = obj["metadata"]
        try:
            self._res(obj["apiVersion"], obj["kind"]).delete(name=meta["name"], namespace=meta["namespace"])
        except NotFoundError:
            pass

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        # A merge patch of the operator's own status fields; status.autoscaling (the autoscaler's) is untouched.
        self._res(API_VERSION, "LLMService").status.patch(
            name=name, namespace=namespace, body={"status": status}, content_type="application/merge-patch+json")

    def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
        """A merge patch of a pod's annotations (None removes one); a pod gone meanwhile is no error."""
        try:
            self._res("v1", "Pod").patch(name=name, namespace=namespace,
                                         body={"metadata": {"annotations": annotations}},
                                         content_type="application/merge-patch+json")
        except NotFoundError:
            pass
