"""TEST-ONLY: what a kubelet hands a pod's containers from the API (for noderunner.py).

Volumes as folders under the pod's folder: configMap, secret, downwardAPI and projected ones as files (rewritten
when their objects change, on each refresh), emptyDir and the rest empty. The ServiceAccount token the API
server's admission puts in every pod (a projected serviceAccountToken at /var/run/secrets/kubernetes.io/
serviceaccount) comes from the TokenRequest API, bound to the pod, and is renewed at 80% of its lifetime as the
kubelet does. The kubernetes client (and kopf through it) reads that path only where it is, not where the runner
relocates it, so a container mounting it also gets a KUBECONFIG of its own naming the relocated token file, CA and
namespace, and KUBERNETES_SERVICE_HOST/PORT of the API server: it runs with exactly its ServiceAccount's RBAC.
Env from ConfigMaps and Secrets (valueFrom, envFrom) is read at container start, as the kubelet does.
"""
from __future__ import annotations

import base64
import datetime as dt
import json
import math
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# What the node offers pods; also what a container without a limit sees as its limit (the kubelet's default).
ALLOCATABLE = {"cpu": "64", "memory": "256Gi", "pods": "250", "nvidia.com/gpu": "8"}


class Missing(Exception):
    """A ConfigMap, Secret or key the pod may not do without: the kubelet waits for it (CreateContainerConfigError)."""


class PodVolumes:
    def __init__(self, core: client.CoreV1Api, pod: dict, folder: Path, server: str):
        self.core, self.pod, self.folder, self.server = core, pod, folder, server
        self.ns = pod["metadata"]["namespace"]
        self.volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        self.tokens: dict[tuple, tuple[bytes, float]] = {}  # (audience, seconds) -> token, when to renew it
        self.written: dict[str, set[str]] = {}  # volume -> files written there (a removed key's file goes)
        self.seen: dict[tuple[str, str], dict | None] = {}  # objects read in this pass

    def dir(self, volume: str) -> Path:
        return self.folder / "volumes" / volume

    def refresh(self) -> None:
        """(Re)writes every volume's files; raises Missing (leaving what was written) if one cannot be made."""
        self.seen = {}
        for name, v in self.volumes.items():
            files = self.files(v)
            self.dir(name).mkdir(parents=True, exist_ok=True)
            if files is None:  # emptyDir and kinds the runner does not fill: a folder
                continue
            for rel, data in files.items():
                path = self.dir(name) / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                if not path.exists() or path.read_bytes() != data:
                    tmp = path.with_name(f".{path.name}.tmp")
                    tmp.write_bytes(data)
                    os.replace(tmp, path)  # readers see the old file or the new one, never half of one
            for rel in self.written.get(name, set()) - set(files):
                (self.dir(name) / rel).unlink(missing_ok=True)
            self.written[name] = set(files)

    def files(self, v: dict) -> dict[str, bytes] | None:
        if "configMap" in v or "secret" in v:
            kind, src = ("configmaps", v["configMap"]) if "configMap" in v else ("secrets", v["secret"])
            return self.keyed(kind, src.get("name") or src.get("secretName"), src)
        if "downwardAPI" in v:
            return self.downward(v["downwardAPI"].get("items") or [])
        if "projected" in v:
            out = {}
            for s in v["projected"].get("sources") or []:
                if "serviceAccountToken" in s:
                    out[s["serviceAccountToken"]["path"]] = self.token(s["serviceAccountToken"])
                elif "configMap" in s or "secret" in s:
                    kind, src = ("configmaps", s["configMap"]) if "configMap" in s else ("secrets", s["secret"])
                    out |= self.keyed(kind, src["name"], src)
                elif "downwardAPI" in s:
                    out |= self.downward(s["downwardAPI"].get("items") or [])
            return out
        return None

    def read(self, kind: str, name: str) -> dict | None:
        """A ConfigMap's or Secret's keys as bytes; None if there is none."""
        if (kind, name) not in self.seen:
            get = self.core.read_namespaced_config_map if kind == "configmaps" else self.core.read_namespaced_secret
            try:
                obj = json.loads(get(name, self.ns, _preload_content=False).data)
            except ApiException as e:
                if e.status != 404:
                    raise
                obj = None
            data = None
            if obj is not None and kind == "secrets":
                data = {k: base64.b64decode(x) for k, x in (obj.get("data") or {}).items()}
            elif obj is not None:
                data = {k: x.encode() for k, x in (obj.get("data") or {}).items()}
                data |= {k: base64.b64decode(x) for k, x in (obj.get("binaryData") or {}).items()}
            self.seen[(kind, name)] = data
        return self.seen[(kind, name)]

    def keyed(self, kind: str, name: str, src: dict) -> dict[str, bytes]:
        data = self.read(kind, name)
        if data is None:
            if src.get("optional"):
                return {}
            raise Missing(f"{kind[:-1]} {name!r} not found")
        if not src.get("items"):
            return data
        out = {}
        for item in src["items"]:
            if item["key"] in data:
                out[item["path"]] = data[item["key"]]
            elif not src.get("optional"):
                raise Missing(f"key {item['key']!r} not in {kind[:-1]} {name!r}")
        return out

    def downward(self, items: list[dict]) -> dict[str, bytes]:
        m = self.pod["metadata"]
        fields = {"metadata.name": m["name"], "metadata.namespace": self.ns, "metadata.uid": m["uid"],
                  "metadata.labels": "\n".join(f'{k}="{x}"' for k, x in sorted((m.get("labels") or {}).items())),
                  "metadata.annotations": "\n".join(f'{k}="{x}"'
                                                    for k, x in sorted((m.get("annotations") or {}).items()))}
        out = {i["path"]: fields.get(i["fieldRef"]["fieldPath"], "").encode() for i in items if "fieldRef" in i}
        return out | {i["path"]: resource_field(self.pod, i["resourceFieldRef"]).encode()
                      for i in items if "resourceFieldRef" in i}

    def token(self, src: dict) -> bytes:
        key = (src.get("audience"), src.get("expirationSeconds", 3600))
        token, renew_at = self.tokens.get(key, (b"", 0.0))
        if time.time() < renew_at:
            return token
        m = self.pod["metadata"]
        spec = {"expirationSeconds": key[1], "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": m["name"],
                                                                 "uid": m["uid"]}}
        if key[0]:
            spec["audiences"] = [key[0]]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        r = json.loads(self.core.create_namespaced_service_account_token(
            sa, self.ns, {"spec": spec}, _preload_content=False).data)["status"]
        expires = dt.datetime.fromisoformat(r["expirationTimestamp"].replace("Z", "+00:00")).timestamp()
        self.tokens[key] = r["token"].encode(), time.time() + 0.8 * (expires - time.time())
        return self.tokens[key][0]

    def key(self, kind: str, ref: dict) -> str | None:
        """The value of env valueFrom.configMapKeyRef / secretKeyRef (None: optional and absent)."""
        data = self.read(kind, ref["name"])
        if data is not None and ref["key"] in data:
            return data[ref["key"]].decode()
        if ref.get("optional"):
            return None
        raise Missing(f"{kind[:-1]} {ref['name']!r} or its key {ref['key']!r} not found")

    def env_from(self, src: dict) -> dict[str, str]:
        kind, ref = ("configmaps", src["configMapRef"]) if "configMapRef" in src else ("secrets", src["secretRef"])
        data = self.read(kind, ref["name"])
        if data is None and not ref.get("optional"):
            raise Missing(f"{kind[:-1]} {ref['name']!r} not found")
        return {src.get("prefix", "") + k: x.decode() for k, x in (data or {}).items()}

    def mounts(self, container: dict) -> dict[str, str]:
        """mountPath -> the local folder (or file, with subPath) that stands for it. A mount inside another one
        (/etc/app/extra in /etc/app) is linked into that one's folder, so paths a program builds find it too."""
        out = {vm["mountPath"].rstrip("/"): str(self.dir(vm["name"]) / vm.get("subPath", ""))
               for vm in container.get("volumeMounts") or [] if vm["name"] in self.volumes}
        for path, local in out.items():
            parent = max((m for m in out if path.startswith(m + "/")), key=len, default=None)
            if parent is not None:
                link = Path(out[parent]) / path[len(parent) + 1:]
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.is_symlink():
                    link.symlink_to(local)
        return out

    def credentials(self, container: dict) -> dict[str, str]:
        """The env that gives a container mounting a ServiceAccount token its in-cluster API access."""
        sa = next((vm["name"] for vm in container.get("volumeMounts") or [] if vm["mountPath"] == SA_DIR), None)
        url = urlsplit(self.server)
        env = {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port or 443)}
        if sa is None:
            return env
        d = self.dir(sa)
        kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "in-cluster",
                      "clusters": [{"name": "in-cluster",
                                    "cluster": {"server": self.server, "certificate-authority": str(d / "ca.crt")}}],
                      "users": [{"name": "service-account", "user": {"tokenFile": str(d / "token")}}],
                      "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "namespace": self.ns,
                                                                      "user": "service-account"}}]}
        path = self.folder / f"{sa}.kubeconfig"
        path.write_text(json.dumps(kubeconfig, indent=1))  # JSON is YAML
        return env | {"KUBECONFIG": str(path)}


def resource_field(pod: dict, ref: dict, container: str | None = None) -> str:
    """A resourceFieldRef's value as the kubelet gives it: the named container's (in env, by default the one it is
    set in) request or limit in whole `divisor`s, rounded up; an unset limit is the node's allocatable, an unset
    request 0 (the API server has already copied a limit into an unset request)."""
    name = ref.get("containerName") or container
    spec = pod["spec"]
    c = next(x for x in [*spec["containers"], *(spec.get("initContainers") or [])] if x["name"] == name)
    kind, _, resource = ref["resource"].partition(".")
    value = ((c.get("resources") or {}).get(kind) or {}).get(resource)
    if value is None:
        value = ALLOCATABLE.get(resource, "0") if kind == "limits" else "0"
    return str(math.ceil(parse_quantity(str(value)) / parse_quantity(str(ref.get("divisor") or "1"))))
