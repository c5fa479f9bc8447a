"""Pure: the engine pod template of one role (the `slofleet serve` command line, probes, resources, volumes); the
other runtimes' containers come from runtimes.py, on the same pod."""
from __future__ import annotations

from dataclasses import dataclass

from slofleet.api.contract import (
    ENGINE_SETTINGS,
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_KEY,
    KV_EVENTS_PORT,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_PORT,
    KV_REPLAY_PORT_NAME,
    MANAGED_BY,
    ROLE_LABEL,
    RUNTIME_LABEL,
    SERVICE_LABEL,
    SLOFLEET,
)
from slofleet.api.runtime import SLOFLEET_IMAGE
from slofleet.api.v1alpha1 import Bucket, LLMService

MODEL_VOLUME = "model"
GPU = "nvidia.com/gpu"
DRAIN_DELAY_SECONDS = 2  # after SIGTERM, /ready answers 503 this long before the listener closes
# The kubelet's SIGKILL comes drainSeconds + this after SIGTERM: past the whole SIGTERM sequence of the engine and
# the router (the drain delay, then drainSeconds for open requests, then their error answers).
DRAIN_SLACK_SECONDS = 10
CONFIG_HASH = "slofleet.dev/config-hash"  # pod template annotation: a new internal token rolls the pods
CACHE_DIR = "/var/cache/slofleet"
SCRATCH_ENV = {"HOME": "/tmp", "TMPDIR": "/tmp", "SLOFLEET_CACHE": CACHE_DIR}


def labels(name: str, role: str | None = None, app: str = "slofleet-engine") -> dict[str, str]:
    out = {"app.kubernetes.io/name": app, "app.kubernetes.io/instance": name, **MANAGED_BY, SERVICE_LABEL: name}
    if role:
        out[ROLE_LABEL] = role
    return out


def restricted(pod: bool = False) -> dict:
    """A fresh securityContext meeting the "restricted" Pod Security Standard, for a pod or for each of its
    containers (init containers too), with a read-only root filesystem."""
    if pod:
        return {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"}}
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def own_image(svc: LLMService) -> str:
    """slofleet's image, which the router and the other runtimes' init steps run: engine.image where the engines
    run slofleet too, else the default."""
    e = svc.spec.engine
    return e.image if e.runtime == SLOFLEET and e.image else SLOFLEET_IMAGE


def secret_name(svc: LLMService) -> str:
    return f"{svc.metadata['name']}-internal-token"


def token_env(svc: LLMService, name: str = INTERNAL_TOKEN_ENV) -> dict:
    """The service's internal token (engines and router alike), from its Secret as the variable `name`: read once,
    at the container's start."""
    return {"name": name,
            "valueFrom": {"secretKeyRef": {"name": secret_name(svc), "key": INTERNAL_TOKEN_KEY}}}


def bucket_priorities(buckets: list[Bucket]) -> str:
    return ",".join(f"{b.name}={b.priority}" for b in buckets)


def bucket_tpots(buckets: list[Bucket]) -> str:
    return ",".join(f"{b.name}={b.slo.tpot_ms}" for b in buckets if b.slo is not None and b.slo.tpot_ms)


def model_arg(svc: LLMService) -> str:
    m = svc.spec.model
    # The embedded model is addressed by name; the others are files under the weights volume.
    return m.name if m.source == "embedded" else f"{m.path.rstrip('/')}/{m.name}"


def flag(name: str, value: bool | int | float | str) -> list[str]:
    """One `slofleet serve` flag, spelled as its argparse definition (booleans as --x / --no-x)."""
    opt = name.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{opt}" if value else f"--no-{opt}"]
    return [f"--{opt}", f"{value:g}" if isinstance(value, float) else str(value)]


def serve_args(svc: LLMService, role: str, buckets: list[Bucket]) -> list[str]:
    e = svc.spec.engine
    # $(POD_IP) is expanded by the kubelet from the env below: each pod binds its own address.
    # Requests name the model as the service (as in KubeAI) or its servedName; the engine adds the weights' name.
    args = ["--host", "$(POD_IP)", *flag("port", e.port), "--model", model_arg(svc),
            "--served-model-name", svc.spec.model.served_name or svc.metadata["name"], "--role", role,
            *flag("grace_period", e.drain_seconds), *flag("drain_delay", DRAIN_DELAY_SECONDS),
            *flag("price_per_hour", e.price_per_hour)]
    for name in ENGINE_SETTINGS:
        args += flag(name, getattr(e, name))
    # Behind the router every request comes with its bucket's priority and TPOT target, so the engines need the
    # buckets only when clients call them directly: a bucket edit then reaches the router and autoscaler without
    # rolling the engines.
    if buckets and not svc.spec.router.enabled:
        args += ["--bucket-priorities", bucket_priorities(buckets)]
        args += ["--bucket-tpot-ms", bucket_tpots(buckets)] if bucket_tpots(buckets) else []
    # A gateway in the router's place (router off, its namespace named: the one source besides the service's own
    # pods that the engines' NetworkPolicy admits) sends no internal token; it still guards KV hand-off and drain.
    if not svc.spec.router.enabled and svc.spec.network.gateway_namespace:
        args.append("--no-require-internal-token")
    # Only where the router follows them: publishing costs a second hash chain per block. Every role publishes, as
    # the router follows every replica it finds; it connects to the pod's address, not through a Service.
    if svc.spec.router.kv_events():
        args += ["--kv-events-endpoint", f"tcp://0.0.0.0:{KV_EVENTS_PORT}",
                 "--kv-events-replay-endpoint", f"tcp://0.0.0.0:{KV_REPLAY_PORT}"]
    return args + list(e.args)


def resources(svc: LLMService) -> dict:
    r = svc.spec.engine.resources
    requests = {k: str(v) for k, v in r.requests.items()}
    limits = {k: str(v) for k, v in r.limits.items()}
    if svc.spec.engine.gpus:
        requests[GPU] = limits[GPU] = str(svc.spec.engine.gpus)
    return {"requests": requests, "limits": limits}


def probe(path: str, port: int, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 2}


def ports(svc: LLMService) -> list[dict]:
    """The engine container's ports: HTTP, and the KV event publisher and its replay socket when they are on."""
    out = [("http", svc.spec.engine.port)]
    if svc.spec.router.kv_events():
        out += [(KV_EVENTS_PORT_NAME, KV_EVENTS_PORT), (KV_REPLAY_PORT_NAME, KV_REPLAY_PORT)]
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in out]


def model_volumes(svc: LLMService) -> tuple[list[dict], list[dict], list[dict]]:
    """(volumes, mounts, init containers) for scratch space and the model weights, as the engines get them (and a
    router that loads their model: the same files, so the same tokenizer and fingerprint)."""
    m = svc.spec.model
    # The root filesystem is read-only: /tmp (HOME and TMPDIR) and the converted-model cache are emptyDirs.
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR}]
    inits: list[dict] = []
    if m.source == "pvc":
        volumes.append({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": m.pvc_name, "readOnly": True}})
        mounts.append({"name": MODEL_VOLUME, "mountPath": m.path, "readOnly": True})
    elif m.source == "init":
        volumes.append({"name": MODEL_VOLUME, "emptyDir": {}})
        mounts.append({"name": MODEL_VOLUME, "mountPath": m.path, "readOnly": True})
        inits.append({"name": "fetch-model", "image": m.init_image, "command": list(m.init_command or []),
                      "env": [{"name": k, "value": v} for k, v in SCRATCH_ENV.items()],
                      "volumeMounts": [dict(mounts[0]), {"name": MODEL_VOLUME, "mountPath": m.path}],
                      "securityContext": restricted()})
    return volumes, mounts, inits


@dataclass(slots=True, kw_only=True)
class EnginePod:
    """What differs between the runtimes' engine pods: the engine container and the volumes and init steps it needs."""
    container: dict
    volumes: list[dict]
    inits: list[dict]


def pod_template(svc: LLMService, role: str, buckets: list[Bucket], config_hash: str) -> dict:
    name, e = svc.metadata["name"], svc.spec.engine
    if e.runtime == SLOFLEET:
        pod = slofleet_pod(svc, role, buckets)
    else:
        from slofleet.operator import runtimes  # imported here: it builds on this module's helpers

        pod = runtimes.engine_pod(svc)
    spec: dict = {
        "containers": [pod.container], "volumes": pod.volumes,
        "terminationGracePeriodSeconds": e.drain_seconds + DRAIN_SLACK_SECONDS,
        "securityContext": restricted(pod=True),
        "automountServiceAccountToken": False,  # an engine never calls the API server
    }
    if pod.inits:
        spec["initContainers"] = pod.inits
    if e.gpus:
        spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": {**labels(name, role), RUNTIME_LABEL: e.runtime},
                         "annotations": {CONFIG_HASH: config_hash}}, "spec": spec}


def pod_env(svc: LLMService, token: str | None) -> list[dict]:
    """The engine container's environment: its pod's address and name, scratch space, the user's engine.env, then
    the internal token under the name the runtime reads it from (None: no token), which no user entry replaces."""
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    user = {k: v for k, v in svc.spec.engine.env.items() if k not in (INTERNAL_TOKEN_ENV, token)}
    env += [{"name": k, "value": v} for k, v in sorted({**SCRATCH_ENV, **user}.items())]  # the user's win
    return env + ([token_env(svc, token)] if token else [])


def slofleet_pod(svc: LLMService, role: str, buckets: list[Bucket]) -> EnginePod:
    e = svc.spec.engine
    volumes, mounts, inits = model_volumes(svc)
    container = {
        "name": "engine", "image": own_image(svc), "imagePullPolicy": e.image_pull_policy,
        "command": ["slofleet", "serve"], "args": serve_args(svc, role, buckets),
        "env": pod_env(svc, INTERNAL_TOKEN_ENV), "ports": ports(svc),
        "resources": resources(svc),
        # Startup covers model loading; after it, liveness only asks "is the process alive" and
        # readiness "is it admitting" (false while draining on SIGTERM).
        "startupProbe": probe("/health", e.port, 5, max(1, e.startup_seconds // 5)),
        "livenessProbe": probe("/health", e.port, 10, 3),
        "readinessProbe": probe("/ready", e.port, 2, 2),
        "volumeMounts": mounts,
        "securityContext": restricted(),
    }
    return EnginePod(container=container, volumes=volumes, inits=inits)
