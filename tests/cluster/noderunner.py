"""TEST-ONLY node runner: a simulated Kubernetes node that really runs pods, as local processes.

It registers node `slofleet-node`, binds every unscheduled pod to it (there is no kube-scheduler), starts each
container's command + args as a local process with the pod's environment and a 127.0.x.y pod IP (`$(VAR)` in
args expanded as the kubelet does; volumes, env from ConfigMaps and Secrets and the ServiceAccount's credentials
as volumes.py makes them, mount paths rewritten in env and args to the local folders; a Python program's listen
on every address narrowed to the pod IP by podnet/sitecustomize.py), reports Ready from the container's HTTP
readiness probe (HTTP, or exec every periodSeconds), restarts exited containers, and on pod deletion sends SIGTERM,
waits out the grace period and then removes the pod. Init containers run first, one after another, each to a clean
exit (sharing the pod's volumes: an emptyDir is one folder). The peer runtimes' image commands that the operator
renders (`vllm serve`, `/app/llama-server`) run the installs `make install-runtimes` cached, through their
launchers; such servers get their pod address from `--host $(POD_IP)` in their args. Env and downwardAPI
`resourceFieldRef`s see the container's requests and limits. It publishes Services' endpoints and makes each
Service reachable from this machine on a loopback address (services.py; the Service's annotation
slofleet.dev/local-url says where). Images, resource enforcement and security contexts are ignored: this is no
kubelet, only enough of one for operator, autoscaler and router tests against real processes.

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
from services import Services
from volumes import ALLOCATABLE, Missing, PodVolumes, resource_field

from slofleet.bench import runtimes
from slofleet.operator.runtimes import COMMAND

NODE = "slofleet-node"
PODNET = str(Path(__file__).resolve().parent / "podnet")  # its sitecustomize gives each pod its own wildcard address
REFRESH_SECONDS = 2.0  # how often a running pod's ConfigMap, Secret and token files are brought up to date
# A namespace annotation (test-only) giving its pods' commands another PATH than the runner's: a test that needs the
# real `slofleet` CLI in a session whose PATH finds the fake engine first (tests/k8s/fakebin) names it this way.
PATH_ANNOTATION = "noderunner.slofleet.dev/path"


@dataclass
class Pod:
    uid: str
    namespace: str
    name: str
    ip: str
    volumes: PodVolumes
    containers: list[Container] = field(default_factory=list)
    inits: list[Container] = field(default_factory=list)
    inits_done: int = 0  # how many init containers have exited 0, in order
    built: bool = False  # its containers are made (volumes and env resolved)
    reported: dict = field(default_factory=dict)
    waiting: str = ""  # why its containers cannot start yet
    refreshed: float = 0.0

    def every(self) -> list[Container]:
        return [*self.inits, *self.containers]


def resolve_env(pod: dict, container: dict, ip: str, vols: PodVolumes, local: dict[str, str],
                path: str | None = None) -> dict[str, str]:
    fields = {"status.podIP": ip, "metadata.name": pod["metadata"]["name"], "spec.nodeName": NODE,
              "metadata.namespace": pod["metadata"]["namespace"], "status.hostIP": "127.0.0.1",
              "metadata.uid": pod["metadata"]["uid"], "spec.serviceAccountName": pod["spec"].get("serviceAccountName")}
    # The runner's own environment underneath (as a process would inherit it: machine settings such as
    # OPENBLAS_CORETYPE matter to torch), less the admin's kubeconfig and HOME (whose ~/.kube/config may be one):
    # a pod holds only its own ServiceAccount's credentials. Then envFrom, and env over it, as the kubelet orders;
    # only what the pod names gets its mount paths relocated (a local path may lie under a mount path, e.g. /tmp).
    env = {k: v for k, v in os.environ.items() if "KUBECONFIG" not in k} | {"POD_IP": ip}
    env |= {"HOME": str(vols.folder / "home")} | vols.credentials(container) | ({"PATH": path} if path else {})
    for src in container.get("envFrom") or []:
        env |= {k: relocate(v, local) for k, v in vols.env_from(src).items()}
    for var in container.get("env") or []:
        vf = var.get("valueFrom") or {}
        if "value" in var:
            env[var["name"]] = expand(relocate(var["value"], local), env)
        elif (ref := vf.get("fieldRef")) and ref["fieldPath"] in fields:
            env[var["name"]] = fields[ref["fieldPath"]]
        elif ref := vf.get("configMapKeyRef") or vf.get("secretKeyRef"):
            if (value := vols.key("configmaps" if "configMapKeyRef" in vf else "secrets", ref)) is not None:
                env[var["name"]] = relocate(value, local)
        elif ref := vf.get("resourceFieldRef"):
            env[var["name"]] = resource_field(pod, ref, container["name"])
    return env | {"NODERUNNER_POD_IP": ip, "PYTHONPATH": os.pathsep.join(filter(None, [PODNET, env.get("PYTHONPATH")]))}


def expand(text: str, env: dict[str, str]) -> str:
    # The kubelet's $(VAR) expansion; $$(VAR) escapes it.
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class Runner:
    def __init__(self, state: Path):
        self.core = client.CoreV1Api()
        self.server = client.Configuration.get_default_copy().host  # the API server pods are pointed at
        self.services = Services(self.core, NODE)
        self.state = state
        self.pods: dict[str, Pod] = {}
        self.next_ip = 2

    def register_node(self) -> None:
        labels = {"kubernetes.io/hostname": NODE, "slofleet.dev/test-node": "true"}
        node = {"metadata": {"name": NODE, "labels": labels}, "spec": {}}
        try:
            self.core.create_node(node)
        except ApiException as e:
            if e.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        cap = ALLOCATABLE
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

    def new_pod(self, pod: dict) -> Pod:
        m = pod["metadata"]
        folder = self.state / f"{m['namespace']}_{m['name']}_{m['uid'][:8]}"
        folder.mkdir(parents=True, exist_ok=True)
        # The pod's paths go through a short alias: a Unix socket's path must fit 107 bytes, and vLLM puts its
        # sockets in TMPDIR, which is the pod's /tmp volume here.
        short = self.state / m["uid"][:8]
        if not short.is_symlink():
            short.symlink_to(folder.name)
        return Pod(m["uid"], m["namespace"], m["name"], self.allocate_ip(), PodVolumes(self.core, pod, short,
                                                                                       self.server))

    def build(self, p: Pod, pod: dict) -> None:
        """Makes the pod's containers (started by tend, init containers first); raises Missing (or the API's error)
        before making any if a volume or env var cannot be made."""
        p.volumes.refresh()
        p.refreshed = time.monotonic()
        (p.volumes.folder / "home").mkdir(exist_ok=True)
        notes = self.core.read_namespace(p.namespace).metadata.annotations or {}
        made = {kind: [self.container(p, pod, c, notes.get(PATH_ANNOTATION)) for c in pod["spec"].get(kind) or []]
                for kind in ("initContainers", "containers")}
        p.inits, p.containers, p.built, p.waiting = made["initContainers"], made["containers"], True, ""

    def container(self, p: Pod, pod: dict, c: dict, path: str | None) -> Container:
        local, folder = p.volumes.mounts(c), p.volumes.folder
        env = resolve_env(pod, c, p.ip, p.volumes, local, path)
        argv = runtime_argv([expand(relocate(a, local), env) for a in (c.get("command") or []) + (c.get("args") or [])])
        if argv:
            argv[0] = shutil.which(argv[0], path=env["PATH"]) or argv[0]
        out = Container(c["name"], argv, env, probe_url(c, p.ip), folder / f"{c['name']}.log",
                        folder / f"{c['name']}.pid")
        probe = c.get("readinessProbe") or {}
        if command := (probe.get("exec") or {}).get("command"):
            cmd = [relocate(a, local) for a in command]
            out.probe_cmd = [shutil.which(cmd[0], path=env["PATH"]) or cmd[0], *cmd[1:]]
            out.probe_period, out.probe_timeout = probe.get("periodSeconds", 10), probe.get("timeoutSeconds", 1)
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
            elif meta["uid"] in self.pods or (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                p = self.pods[meta["uid"]] = self.pods.get(meta["uid"]) or self.new_pod(pod)
                self.tend(p, pod)
        for uid in [u for u in self.pods if u not in seen]:  # removed behind our back
            for c in self.pods.pop(uid).every():
                c.stop(2)
        self.services.sync(pods)

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
        try:
            if not p.built:
                self.build(p, pod)
            elif time.monotonic() - p.refreshed > REFRESH_SECONDS:
                p.refreshed = time.monotonic()
                p.volumes.refresh()
        except (Missing, ApiException) as e:
            # Not started yet: it waits (CreateContainerConfigError). Running: it keeps its files, as with the kubelet.
            why = str(e) if isinstance(e, Missing) else f"API: {e.status} {e.reason}"
            if p.built:
                print(f"noderunner: {p.namespace}/{p.name}: volumes not refreshed: {why}", flush=True)
            p.waiting = p.waiting if p.built else why
        if p.built and not self.initialize(p):
            self.report(p, pod)
            return
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

    def initialize(self, p: Pod) -> bool:
        """Runs the init containers one after another, each until it exits 0 (a failed one again after a back-off, as
        under restartPolicy Always); True once all have, and the other containers may start."""
        while p.inits_done < len(p.inits):
            c = p.inits[p.inits_done]
            if c.proc is None:
                if time.monotonic() >= c.next_start:
                    c.start()
                return False
            if (rc := c.exited()) is None:
                return False
            if rc == 0:
                p.inits_done += 1
                continue
            print(f"noderunner: {p.namespace}/{p.name}: init container {c.name} exited {rc}", flush=True)
            c.restarts, c.proc = c.restarts + 1, None
            c.next_start = time.monotonic() + min(10, 2 ** min(c.restarts, 4))
            return False
        return True

    def report(self, p: Pod, pod: dict) -> None:
        initialized = p.built and p.inits_done == len(p.inits)
        ready = initialized and bool(p.containers) and all(c.ready for c in p.containers)
        spec = pod["spec"]
        images = {x["name"]: x["image"] for x in [*spec["containers"], *(spec.get("initContainers") or [])]}
        statuses = [status(c, images[c.name], "ContainerCreating" if initialized else "PodInitializing")
                    for c in p.containers] or [
            {"name": x["name"], "ready": False, "started": False, "restartCount": 0, "image": x["image"], "imageID": "",
             "state": {"waiting": {"reason": "CreateContainerConfigError", "message": p.waiting}}}
            for x in pod["spec"]["containers"]]
        inits = [status(c, images[c.name], "PodInitializing", done=i < p.inits_done) for i, c in enumerate(p.inits)]
        key = (ready, p.waiting, p.inits_done,
               tuple((s["ready"], s["started"], s["restartCount"]) for s in [*statuses, *inits]))
        if p.reported.get("key") == key:
            return
        t = now()
        conds = [{"type": type_, "status": "True" if ok else "False", "lastTransitionTime": t} for type_, ok in
                 [("PodScheduled", True), ("Initialized", initialized), ("ContainersReady", ready), ("Ready", ready)]]
        status_ = {"phase": "Running" if initialized else "Pending", "hostIP": "127.0.0.1",
                   "hostIPs": [{"ip": "127.0.0.1"}], "podIP": p.ip, "podIPs": [{"ip": p.ip}],
                   "startTime": p.reported.get("start", t), "containerStatuses": statuses, "conditions": conds}
        if inits:
            status_["initContainerStatuses"] = inits
        try:
            self.core.patch_namespaced_pod_status(p.name, p.namespace, {"status": status_})
            p.reported.update(key=key, start=status_["startTime"])
        except ApiException as e:
            if e.status != 404:
                raise

    def finish(self, pod: dict) -> None:
        meta = pod["metadata"]
        p = self.pods.pop(meta["uid"], None)
        grace = pod["spec"].get("terminationGracePeriodSeconds") or 30
        for c in p.every() if p else []:
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
            for c in p.every():
                c.stop(5)
        raise SystemExit(0)


def status(c: Container, image: str, waiting: str, done: bool = False) -> dict:
    """A container's status; `waiting` is why one that has not started waits; `done`: an init container that has
    exited 0."""
    if done:
        state = {"terminated": {"exitCode": 0, "reason": "Completed", "startedAt": c.started_at}}
    elif c.running():
        state = {"running": {"startedAt": c.started_at}}
    else:
        state = {"waiting": {"reason": "CrashLoopBackOff" if c.restarts else waiting}}
    return {"name": c.name, "ready": c.ready or done, "started": c.running(), "restartCount": c.restarts,
            "image": image, "imageID": "", "containerID": f"local-process://{c.proc.pid if c.proc else 0}",
            "state": state}


def runtime_argv(argv: list[str]) -> list[str]:
    """A peer runtime's image command as the operator renders it (`vllm serve ...`) as its cached install's launcher
    with the same arguments; unchanged where none matches or the runtime is not installed (it then fails to start,
    with the reason in the runner's log)."""
    for runtime, command in COMMAND.items():
        if argv[:len(command)] == command:
            if (path := runtimes.launcher(runtime)) is None:
                print(f"noderunner: {runtimes.missing_reason(runtime)}", flush=True)
                return argv
            return [str(path), *argv[len(command):]]
    return argv


def probe_url(container: dict, ip: str) -> str | None:
    http = (container.get("readinessProbe") or {}).get("httpGet")
    if not http:
        return None
    port = http["port"]
    if isinstance(port, str) and not port.isdigit():
        port = next(p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port)
    return f"http://{ip}:{port}{http.get('path', '/')}"


def relocate(text: str, local: dict[str, str]) -> str:
    # One pass, longest mount first: a local folder (under /tmp) must not be rewritten again by a /tmp mount;
    # a whole path from its start only (/tmp, not /tmpfs; /models, not the /models of a URL's /v1/models).
    if not local:
        return text
    pattern = r"(?<![\w./-])(?:" + "|".join(re.escape(m) for m in sorted(local, key=len, reverse=True)) + r")(?![\w.-])"
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
