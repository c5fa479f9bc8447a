"""The local cluster behaves like a real one for our pods: a pod runs with exactly its ServiceAccount's RBAC (a
TokenRequest token bound to it), sees the Secrets and ConfigMaps it mounts or takes env from (and their updates),
waits for a Secret it needs, and its Service answers from this machine at the URL the node runner advertises.

One pod (a small Python program run by the node runner with the repo's Python) reports what it can do over HTTP.
"""
from __future__ import annotations

import datetime as dt
import json
import urllib.request
import uuid
from types import SimpleNamespace

import pytest
import yaml

from tests.cluster.services import LOCAL_URL
from tests.k8s.conftest import wait_until

# What the pod checks, on every request: argv[1:] are in-pod paths the node runner relocates to the pod's folder.
PROBE = """
import http.server, json, os, sys
from kubernetes import client
from kubernetes.client.rest import ApiException
from slofleet.api.contract import load_kube_config

load_kube_config()
core = client.CoreV1Api()
sa_dir, creds = sys.argv[1:]
ns = open(sa_dir + "/namespace").read()

def status(call, *args):
    try:
        call(*args)
        return 200
    except ApiException as e:
        return e.status

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({
            "namespace": ns, "pods": [p.metadata.name for p in core.list_namespaced_pod(ns).items],
            "secrets": status(core.list_namespaced_secret, ns),
            "other_pods": status(core.list_namespaced_pod, "default"),
            "delete_pod": status(core.delete_namespaced_pod, os.environ["POD_NAME"], ns),
            "file": open(creds + "/password").read(), "mode_file": open(creds + "/cfg/mode").read(),
            "env": {k: os.environ.get(k) for k in ("PASSWORD", "MODE", "APP_greeting")},
        }).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer((os.environ["POD_IP"], 8080), Handler).serve_forever()
"""
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def manifests(ns: str) -> list[dict]:
    def meta(kind: str, name: str, api: str = "v1", **fields) -> dict:
        return {"apiVersion": api, "kind": kind, "metadata": {"name": name, "namespace": ns}, **fields}

    rbac = "rbac.authorization.k8s.io/v1"
    container = {
        "name": "probe", "image": "python:3", "command": ["python", "-c", PROBE, SA_DIR, "/etc/creds"],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "app", "key": "mode"}}}],
        "envFrom": [{"configMapRef": {"name": "app"}, "prefix": "APP_"}],
        "volumeMounts": [{"name": "creds", "mountPath": "/etc/creds", "readOnly": True},
                         {"name": "app", "mountPath": "/etc/creds/cfg", "readOnly": True}]}
    labels = {"app": "probe"}
    return [
        meta("ServiceAccount", "lister"),
        meta("Role", "list-pods", api=rbac, rules=[{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]),
        meta("RoleBinding", "lister", api=rbac, roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                         "name": "list-pods"},
             subjects=[{"kind": "ServiceAccount", "name": "lister", "namespace": ns}]),
        meta("ConfigMap", "app", data={"mode": "fast", "greeting": "hello"}),
        meta("Deployment", "probe", api="apps/v1", spec={
            "replicas": 1, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                "serviceAccountName": "lister", "containers": [container],
                "volumes": [{"name": "creds", "secret": {"secretName": "creds"}},
                            {"name": "app", "configMap": {"name": "app"}}]}}}),
        meta("Service", "probe", spec={"selector": labels,
                                       "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}),
    ]


@pytest.fixture(scope="module")
def probe(cluster):
    """The probe's namespace and its Service's local URL, once it is Ready."""
    if not cluster.local:
        pytest.skip("needs the test-only node runner (pods run as local processes with the repo's Python)")
    ns = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(manifests(ns)))
    # The Secret it needs comes last: its pod waits for it, as with a kubelet, and then starts.
    def waiting() -> list[dict]:
        return [c["state"]["waiting"] for p in cluster.items("pods", ns, "app=probe")
                for c in (p.get("status") or {}).get("containerStatuses") or [] if "waiting" in c["state"]]

    assert wait_until("the pod to wait for its Secret", waiting, 30)[0]["reason"] == "CreateContainerConfigError"
    cluster.kubectl("create", "secret", "generic", "creds", "-n", ns, "--from-literal=password=s3cret")
    cluster.kubectl("rollout", "status", "deployment/probe", "-n", ns, "--timeout=60s")
    url = wait_until("the Service's local URL",
                     lambda: (cluster.get("service", "probe", ns)["metadata"].get("annotations") or {}).get(LOCAL_URL),
                     30)
    # Ready in the API a moment before the proxy sends to it (as kube-proxy lags the endpoints).
    wait_until("the Service to answer", lambda: answer(url), 30)
    yield ns, url
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def ask(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def answer(url: str) -> dict | None:
    try:
        return ask(url)
    except OSError:
        return None


def test_pod_runs_with_exactly_its_service_accounts_rbac(probe):
    ns, url = probe
    seen = ask(url)
    assert seen["namespace"] == ns
    assert len(seen["pods"]) == 1 and seen["pods"][0].startswith("probe-")  # list pods: granted
    # Not granted: reading Secrets, pods of another namespace, deleting its own pod. No admin credentials leak in.
    assert (seen["secrets"], seen["other_pods"], seen["delete_pod"]) == (403, 403, 403)


def test_pod_sees_the_secret_and_configmap_it_mounts_and_their_updates(cluster, probe):
    ns, url = probe
    seen = ask(url)
    assert (seen["file"], seen["mode_file"]) == ("s3cret", "fast")
    assert seen["env"] == {"PASSWORD": "s3cret", "MODE": "fast", "APP_greeting": "hello"}
    cluster.kubectl("patch", "secret", "creds", "-n", ns, "-p", json.dumps({"stringData": {"password": "rotated"}}))
    cluster.kubectl("patch", "configmap", "app", "-n", ns, "-p", json.dumps({"data": {"mode": "slow"}}))
    # Files follow their objects (env, as with a kubelet, stays what the container started with).
    def followed() -> bool:
        s = ask(url)
        return (s["file"], s["mode_file"], s["env"]["PASSWORD"]) == ("rotated", "slow", "s3cret")

    wait_until("the mounted files to follow", followed, 20)


def test_service_answers_from_the_host_at_its_local_url(cluster, probe):
    ns, url = probe
    ip = cluster.get("service", "probe", ns)["spec"]["clusterIP"]
    # The ClusterIP's mirror on loopback, at the Service's port unless something else holds it (or it is privileged).
    assert url.startswith(f"http://127.{ip.split('.', 1)[1]}:")
    assert ask(url)["namespace"] == ns
    listed = cluster.kubectl("get", "svc", "-A", "-o", "json")
    assert url in {(s["metadata"].get("annotations") or {}).get(LOCAL_URL) for s in json.loads(listed.stdout)["items"]}


def test_token_is_bound_to_the_pod_and_renewed_at_80_percent_of_its_lifetime(monkeypatch, tmp_path):
    # Pure (a stand-in API): the shortest TokenRequest lifetime, 10 minutes, is too long to wait out.
    from tests.cluster import volumes

    asked, clock = [], [1000.0]

    class Core:
        def create_namespaced_service_account_token(self, sa, ns, body, _preload_content):
            asked.append((sa, ns, body["spec"]))
            expires = dt.datetime.fromtimestamp(clock[0] + body["spec"]["expirationSeconds"], dt.timezone.utc)
            status = {"token": f"t{len(asked)}", "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}
            return SimpleNamespace(data=json.dumps({"status": status}))

    monkeypatch.setattr(volumes.time, "time", lambda: clock[0])
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1"}, "spec": {"serviceAccountName": "sa"}}
    vols = volumes.PodVolumes(Core(), pod, tmp_path, "https://127.0.0.1:6443")
    src = {"path": "token", "expirationSeconds": 3600}
    assert vols.token(src) == b"t1"
    assert asked == [("sa", "ns", {"expirationSeconds": 3600,
                                   "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u1"}})]
    clock[0] += 0.79 * 3600
    assert vols.token(src) == b"t1" and len(asked) == 1
    clock[0] += 0.02 * 3600
    assert vols.token(src) == b"t2" and len(asked) == 2
