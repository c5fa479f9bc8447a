"""The autoscaler's Kubernetes API access: read LLMServices, SLOPolicies and pods; write its status entry and
Events. Minimal on purpose: the autoscaler never imports the operator (nor kopf), and needs none of its
server-side apply; its RBAC is exactly these calls.
"""
from __future__ import annotations

import json

from kubernetes import client
from kubernetes.client.rest import ApiException

from slofleet.api.contract import load_kube_config, now
from slofleet.api.v1alpha1 import API_VERSION, GROUP, VERSION

FIELD_MANAGER = "slofleet-autoscaler"
PLURAL = "llmservices"


def connect() -> client.ApiClient:
    load_kube_config()
    return client.ApiClient()


class Kube:
    def __init__(self, api: client.ApiClient):
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    def services(self, namespace: str | None) -> list[dict]:
        if namespace:
            out = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        else:
            out = self.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        return out["items"]

    def policy(self, namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "slopolicies", name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def pods(self, namespace: str, selector: str) -> list[dict]:
        # Raw JSON (camelCase, as in manifests) rather than the client's snake_case models.
        r = self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        return json.loads(r.data)["items"]

    def patch_status(self, namespace: str, name: str, body: dict) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, body, field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json")

    def event(self, svc: dict, type_: str, reason: str, message: str) -> None:
        m, t = svc["metadata"], now()
        body = {"metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
                "involvedObject": {"apiVersion": API_VERSION, "kind": "LLMService", "name": m["name"],
                                   "namespace": m["namespace"], "uid": m["uid"],
                                   "resourceVersion": m.get("resourceVersion")},
                "type": type_, "reason": reason, "message": message, "count": 1,
                "firstTimestamp": t, "lastTimestamp": t,
                "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER}
        self.core.create_namespaced_event(m["namespace"], body, _preload_content=False)
