"""TEST-ONLY node runner: a simulated Kubernetes node that really runs pods, as local processes.

It registers node `slofleet-node`, binds every unscheduled pod to it (there is no kube-scheduler), starts each
container's command + args as a local process with the pod's environment and a 127.0.x.y pod IP (`$(VAR)` in
args expanded as the kubelet does; configMap volumes written to a local folder, their mount paths rewritten in
env and args), reports Ready from the container's HTTP readiness probe, restarts exited containers, and on pod
deletion sends SIGTERM, waits out the grace period and then removes the pod. Images, init containers, other
volume kinds, resource limits and security contexts are ignored: this is no kubelet, only enough of one for
operator, autoscaler and router tests against real processes.

Usage: KUBECONFIG=... python noderunner.py --state-dir DIR   (commands resolve in this process's PATH)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from localproc import Container, now  # beside this script

NODE = "slofleet-node"


@dataclass
class Pod:
    uid: str
    namespace: str
    name: str
    ip: str
    containers: list[Container] = field(default_factory=list)
    reported: dict = field(default_factory=dict)


def resolve_env(pod: dict, container: dict, ip: str) -> dict[str, str]:
    fields = {"status.podIP": ip, "metadata.name": pod["metadata"]["name"], "spec.nodeName": NODE,
              "metadata.namespace": pod["metadata"]["namespace"], "status.hostIP": "127.0.0.1"}
    # The runner's own environment underneath (as a process would inherit it: machine settings such as
    # OPENBLAS_CORETYPE matter to torch), the pod's on top.
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"} | {"POD_IP": ip}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif (ref := (var.get("valueFrom") or {}).get("fieldRef")) and ref["fieldPath"] in fields:
            env[var["name"]] = fields[ref["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    # The kubelet's $(VAR) expansion; $$(VAR) escapes it.
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class Runner:
    def __init__(self, state: Path):
        self.core = client.CoreV1Api()
        self.coord = client.CoordinationV1Api()
        self.state = state
        self.pods: dict[str, Pod] = {}
        self.next_ip = 2

    def register_node(self) -> None:
        node = {"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE, "slofleet.dev/test-node": "true"}},
                "spec": {}}
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        cap = {"cpu": "64", "memory": "256Gi", "pods": "250", "nvidia.com/gpu": "8"}
        status = {"capacity": cap, "allocatable": cap, "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                  "conditions": [{"type": "Ready", "status": "True", "reason": "NodeRunnerReady",
                                  "message": "test-only node runner", "lastHeartbeatTime": now(),
                                  "lastTransitionTime": now()}],
                  "nodeInfo": {"kubeletVersion": "v1.36.3-noderunner", "containerRuntimeVersion": "local-process://",
                               "architecture": "amd64", "operatingSystem": "linux", "osImage": "", "kernelVersion": "",
                               "bootID": "", "machineID": "", "systemUUID": "", "kubeProxyVersion": ""}}
        self.core.patch_node_status(NODE, {"status": status})

    def allocate_ip(self) -> str:
        n, self.next_ip = self.next_ip, self.next_ip + 1
        return f"127.0.{n // 250 + 1}.{n % 250 + 2}"

    def start_pod(self, pod: dict) -> Pod:
        m, spec = pod["metadata"], pod["spec"]
        p = Pod(m["uid"], m["namespace"], m["name"], self.allocate_ip())
        folder = self.state / f"{p.namespace}_{p.name}_{p.uid[:8]}"
        mounts = self.materialize_volumes(pod, folder)
        for c in spec["containers"]:
            env = resolve_env(pod, c, p.ip)
            local = {vm["mountPath"]: mounts[vm["name"]] for vm in c.get("volumeMounts") or [] if vm["name"] in mounts}
            env = {k: relocate(v, local) for k, v in env.items()}
            argv = [relocate(expand(a, env), local) for a in (c.get("command") or []) + (c.get("args") or [])]
            if argv:
                argv[0] = shutil.which(argv[0], path=env["PATH"]) or argv[0]
            p.containers.append(Container(c["name"], argv, env, probe_url(c, p.ip), folder / f"{c['name']}.log",
                                          folder / f"{c['name']}.pid"))
        for c in p.containers:
            c.start()
        return p

    def materialize_volumes(self, pod: dict, folder: Path) -> dict[str, str]:
        out = {}
        for v in pod["spec"].get("volumes") or []:
            path = folder / "volumes" / v["name"]
            path.mkdir(parents=True, exist_ok=True)
            if "configMap" in v:
                try:
                    cm = self.core.read_namespaced_config_map(v["configMap"]["name"], pod["metadata"]["namespace"])
                    for key, value in (cm.data or {}).items():
                        (path / key).write_text(value)
                except ApiException:
                    pass
            out[v["name"]] = str(path)
        return out

    def sync(self) -> None:
        # Raw JSON (camelCase, as in manifests) rather than the client's snake_case models.
        pods = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
        seen = set()
        for pod in pods:
            spec, meta = pod["spec"], pod["metadata"]
            if not spec.get("nodeName"):
                if not meta.get("deletionTimestamp"):
                    self.bind(meta)
                continue
            if spec["nodeName"] != NODE:
                continue
            seen.add(meta["uid"])
            if meta.get("deletionTimestamp"):
                self.finish(pod)
            elif meta["uid"] not in self.pods:
                if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    continue
                self.pods[meta["uid"]] = self.start_pod(pod)
            else:
                self.tend(self.pods[meta["uid"]], pod)
        for uid in [u for u in self.pods if u not in seen]:  # removed behind our back
            for c in self.pods.pop(uid).containers:
                c.stop(2)

    def bind(self, meta: dict) -> None:
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}}
        try:
            # Unparsed: the client's Binding model fails to deserialize the server's answer.
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def tend(self, p: Pod, pod: dict) -> None:
        for c in p.containers:
            if not c.running() and time.monotonic() >= c.next_start:
                if c.proc is not None:  # it exited: back off, then start it again (restartPolicy Always)
                    c.restarts, c.ready = c.restarts + 1, False
                    c.next_start = time.monotonic() + min(10, 2 ** min(c.restarts, 4))
                    c.proc = None
                    continue
                c.start()
            c.ready = c.probe()
        self.report(p, pod)

    def report(self, p: Pod, pod: dict) -> None:
        ready = all(c.ready for c in p.containers)
        statuses = [{"name": c.name, "ready": c.ready, "started": c.running(), "restartCount": c.restarts,
                     "image": next(x["image"] for x in pod["spec"]["containers"] if x["name"] == c.name),
                     "imageID": "", "containerID": f"local-process://{c.proc.pid if c.proc else 0}",
                     "state": {"running": {"startedAt": c.started_at}} if c.running()
                     else {"waiting": {"reason": "CrashLoopBackOff" if c.restarts else "ContainerCreating"}}}
                    for c in p.containers]
        key = (ready, tuple((s["ready"], s["started"], s["restartCount"]) for s in statuses))
        if p.reported.get("key") == key:
            return
        t = now()
        cond = lambda type_, ok: {"type": type_, "status": "True" if ok else "False", "lastTransitionTime": t}
        status = {"phase": "Running", "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}], "podIP": p.ip,
                  "podIPs": [{"ip": p.ip}], "startTime": p.reported.get("start", t), "containerStatuses": statuses,
                  "conditions": [cond("PodScheduled", True), cond("Initialized", True),
                                 cond("ContainersReady", ready), cond("Ready", ready)]}
        try:
            self.core.patch_namespaced_pod_status(p.name, p.namespace, {"status": status})
            p.reported.update(key=key, start=status["startTime"])
        except ApiException as e:
            if e.status != 404:
                raise

    def finish(self, pod: dict) -> None:
        meta = pod["metadata"]
        p = self.pods.pop(meta["uid"], None)
        grace = pod["spec"].get("terminationGracePeriodSeconds") or 30
        for c in p.containers if p else []:
            c.stop(grace)
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], grace_period_seconds=0,
                                            body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                        preconditions={"uid": meta["uid"]}))
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def shutdown(self, *_) -> None:
        for p in self.pods.values():
            for c in p.containers:
                c.stop(5)
        raise SystemExit(0)


def probe_url(container: dict, ip: str) -> str | None:
    http = (container.get("readinessProbe") or {}).get("httpGet")
    if not http:
        return None
    port = http["port"]
    if isinstance(port, str) and not port.isdigit():
        port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
    return f"http://{ip}:{port}{http.get('path', '/')}"


def relocate(text: str, local: dict[str, str]) -> str:
    # One pass, longest mount first: a local folder (under /tmp) must not be rewritten again by a /tmp mount.
    if not local:
        return text
    pattern = "|".join(re.escape(m) for m in sorted(local, key=len, reverse=True))
    return re.sub(pattern, lambda m: local[m.group(0)], text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-dir", type=Path, required=True, help="pod logs, volumes and pid files")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between syncs")
    args = parser.parse_args()
    config.load_kube_config()
    runner = Runner(args.state_dir)
    signal.signal(signal.SIGTERM, runner.shutdown)
    signal.signal(signal.SIGINT, runner.shutdown)
    runner.register_node()
    last_beat = time.monotonic()
    while True:
        try:
            runner.sync()
            if time.monotonic() - last_beat > 10:
                runner.heartbeat()
                last_beat = time.monotonic()
        except (ApiException, OSError) as e:  # the API server restarting: try again next round
            print(f"noderunner: {e}", flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    raise SystemExit(main())
