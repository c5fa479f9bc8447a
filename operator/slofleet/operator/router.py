"""Pure: the router in front of an LLMService's engines (`slofleet router`): its Deployment, Service, and the
ServiceAccount + RoleBinding that let it list the engines' EndpointSlices.

The router finds the engines by the labels the operator puts on each role's Service (the EndpointSlice
controller copies them onto the slices), so scaling a role, a rollout or a role switch needs no router restart.
Under the precise policy it also follows each engine pod's KV events, at the pod's address on the ports of
slofleet.api.contract, and loads the engines' model from the same volume to hash requests as they do.
Its permissions come from one ClusterRole installed with the operator (manifests/rbac.yaml, the chart), bound
per service in the service's namespace: the operator only needs `bind` on that ClusterRole, not its rules.
"""
from __future__ import annotations

from slofleet.api.contract import KV_EVENTS_PORT, KV_HASH_SEED_ENV, KV_REPLAY_PORT, ROLE_LABEL, ROUTER, SERVICE_LABEL
from slofleet.api.router import PRECISE_MEMORY
from slofleet.api.v1alpha1 import LLMService
from slofleet.operator.podspec import (
    CONFIG_HASH,
    DRAIN_DELAY_SECONDS,
    DRAIN_SLACK_SECONDS,
    SCRATCH_ENV,
    labels,
    model_arg,
    model_volumes,
    own_image,
    probe,
    restricted,
    token_env,
)

ROLE = ROUTER
DEFAULT_CLUSTER_ROLE = "slofleet-router"
# The buckets (the ConfigMap's policy.json) and the API keys (spec.router.auth's Secret): mounted, and re-read by the
# router when they change, so neither rolls its pods.
CONFIG_DIR = "/etc/slofleet"
AUTH_DIR = "/etc/slofleet-auth"


def name_of(svc: LLMService) -> str:
    return f"{svc.metadata['name']}-{ROLE}"


def router_labels(svc: LLMService) -> dict[str, str]:
    return labels(svc.metadata["name"], ROLE, app="slofleet-router")


def router_args(svc: LLMService) -> list[str]:
    r, m = svc.spec.router, svc.metadata
    return ["--host", "$(POD_IP)", "--port", str(r.port),
            "--k8s-llmservice", f"{m.get('namespace', 'default')}/{m['name']}", "--k8s-port-name", "http",
            "--buckets", f"{CONFIG_DIR}/policy.json", "--policy", r.policy, "--runtime", svc.spec.engine.runtime,
            "--prefill-threshold-tokens", str(svc.spec.topology.prefill_threshold_tokens),
            "--hold-timeout-seconds", str(r.hold_timeout_seconds),
            # what a request without max_tokens is charged for, even before an engine is up to say it
            "--max-model-len", str(svc.spec.engine.max_model_len),
            # open streams get as long to finish as the engines give theirs
            "--grace-period", str(svc.spec.engine.drain_seconds), "--drain-delay", str(DRAIN_DELAY_SECONDS),
            *auth_args(svc), *precise_args(svc)]


def auth_args(svc: LLMService) -> list[str]:
    a = svc.spec.router.auth
    if a is None:
        return []
    return ["--api-keys-file", f"{AUTH_DIR}/{a.key}", "--rpm", f"{a.requests_per_minute:g}",
            "--tpm", f"{a.tokens_per_minute:g}"]


def precise_args(svc: LLMService) -> list[str]:
    """The engines' model as they load it (its tokenizer and fingerprint make their hash chain), and where each
    replica the router finds publishes its KV events: at the ports the engines bind (podspec.serve_args)."""
    if not svc.spec.router.kv_events():
        return []
    return ["--model", model_arg(svc), "--kv-events-endpoint", f"tcp://{{host}}:{KV_EVENTS_PORT}",
            "--kv-events-replay-endpoint", f"tcp://{{host}}:{KV_REPLAY_PORT}"]


def memory_warning(svc: LLMService) -> str | None:
    """What to change when the router's memory limit cannot hold the precise policy's model (the CRD cannot refuse
    it: a quantity is past CEL's cost budget there), so that the user reads more than an OOMKilled router."""
    from kubernetes.utils import parse_quantity  # only the operator has the client

    limit = svc.spec.router.resources.limits.get("memory")
    try:
        if not svc.spec.router.kv_events() or limit is None or parse_quantity(limit) >= parse_quantity(PRECISE_MEMORY):
            return None
    except ValueError:  # not a quantity: the API server refuses the Deployment, and says so
        return None
    return (f"router.policy precise loads the engines' model in the router: give it router.resources.limits.memory "
            f"of at least {PRECISE_MEMORY} (it has {limit})")


def env(svc: LLMService) -> list[dict]:
    out = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, token_env(svc)]
    if svc.spec.router.kv_events():
        # Scratch and the model cache as the engines have them, and their chain's seed where the user set one.
        seed = {k: v for k, v in svc.spec.engine.env.items() if k == KV_HASH_SEED_ENV}
        out += [{"name": k, "value": v} for k, v in sorted({**SCRATCH_ENV, **seed}.items())]
    return out


def pod_template(svc: LLMService, config_map: str, config_hash: str) -> dict:
    r, e = svc.spec.router, svc.spec.engine
    if r.kv_events():  # it loads the engines' model: their weights volume (or init container) and cache
        volumes, mounts, inits = model_volumes(svc)
    else:
        volumes, mounts, inits = [{"name": "tmp", "emptyDir": {}}], [{"name": "tmp", "mountPath": "/tmp"}], []
    volumes.append({"name": "config", "configMap": {"name": config_map}})
    mounts.append({"name": "config", "mountPath": CONFIG_DIR, "readOnly": True})
    if r.auth is not None:  # without its Secret the pod waits, as a router without its keys must not serve
        volumes.append({"name": "auth", "secret": {"secretName": r.auth.secret_name}})
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    container = {
        "name": ROLE, "image": r.pod_image(own_image(svc)), "imagePullPolicy": e.image_pull_policy,
        "command": ["slofleet", "router"], "args": router_args(svc), "env": env(svc),
        "ports": [{"name": "http", "containerPort": r.port, "protocol": "TCP"}],
        "resources": {"requests": {k: str(v) for k, v in r.resources.requests.items()},
                      "limits": {k: str(v) for k, v in r.resources.limits.items()}},
        # Ready as soon as it answers, not when an engine is: with every pool at zero the router must stay in
        # its Service to hold requests, which is what the autoscaler scales up from zero on.
        "readinessProbe": probe("/health", r.port, 2, 2),
        "livenessProbe": probe("/health", r.port, 10, 3),
        "volumeMounts": mounts,
        "securityContext": restricted(),
    }
    if r.kv_events():  # it answers once the model is loaded (converted, on a first start): as long as an engine
        container["startupProbe"] = probe("/health", r.port, 5, max(1, e.startup_seconds // 5))
    # It keeps its ServiceAccount token: it lists the engines' EndpointSlices.
    spec = {"serviceAccountName": name_of(svc), "containers": [container], "volumes": volumes,
            "terminationGracePeriodSeconds": e.drain_seconds + DRAIN_SLACK_SECONDS,
            "securityContext": restricted(pod=True)}
    if inits:
        spec["initContainers"] = inits
    return {"metadata": {"labels": router_labels(svc), "annotations": {CONFIG_HASH: config_hash}}, "spec": spec}


def children(svc: LLMService, owner: dict, cluster_role: str, config_map: str, config_hash: str) -> list[dict]:
    """ServiceAccount, RoleBinding, Deployment, Service, each owned by `owner` (an owner reference)."""
    name, selector = name_of(svc), {SERVICE_LABEL: svc.metadata["name"], ROLE_LABEL: ROLE}

    def md() -> dict:
        return {"name": name, "namespace": svc.metadata.get("namespace", "default"), "labels": router_labels(svc),
                "ownerReferences": [owner]}

    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": md()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": md(),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_role},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": svc.metadata.get("namespace", "default")}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": md(),
         "spec": {"replicas": svc.spec.router.replicas, "selector": {"matchLabels": selector},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                  "template": pod_template(svc, config_map, config_hash)}},
        {"apiVersion": "v1", "kind": "Service", "metadata": md(),
         "spec": {"selector": selector,
                  "ports": [{"name": "http", "port": svc.spec.router.port, "targetPort": "http"}]}},
    ]
