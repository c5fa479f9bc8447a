"""`slofleet autoscaler --kubernetes`: every LLMService with spec.autoscaling.enabled, each role on its own
interval: find the role's pods by the operator's labels, read their metrics (from the pods, or from
Prometheus), decide, and record the decision in status.autoscaling.<role> (+ an Event when it changes).
The operator alone turns the decision into Deployment replicas.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException

from slofleet.api.contract import ROLE_LABEL, ROUTER, SERVICE_LABEL, now
from slofleet.api.v1alpha1 import LLMService, RoleAutoscaling, SLOPolicy

from . import actuate
from .kube import Kube
from .policy import Decision, Fleet, Policy, PolicyConfig
from .signals import History, merge
from .sources import federate, held_requests, scrape


@dataclass
class RoleState:
    policy: Policy
    history: History
    written: RoleAutoscaling | None = None  # what this process last wrote
    written_at: float = 0.0


@dataclass
class ServiceState:
    roles: dict[str, RoleState] = field(default_factory=dict)
    due: float = 0.0


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds) and bool(pod["status"].get("podIP"))


def selector(service: str, role: str) -> str:
    return f"{SERVICE_LABEL}={service},{ROLE_LABEL}={role}"


def pod_url(pod: dict) -> str:
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or []]
    port = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else {"containerPort": 8000})
    return f"http://{pod['status']['podIP']}:{port['containerPort']}"


class Autoscaler:
    def __init__(self, kube: Kube, base: PolicyConfig, namespace: str | None = None, prometheus: str | None = None,
                 resync_s: float = 60.0):
        self.kube, self.base, self.namespace = kube, base, namespace
        self.prometheus, self.resync_s = prometheus, resync_s
        self.services: dict[str, ServiceState] = {}  # by uid

    def tick(self) -> None:
        seen = set()
        for raw in self.kube.services(self.namespace):
            svc = LLMService.model_validate(raw)
            uid = svc.metadata["uid"]
            if not svc.spec.autoscaling.enabled or svc.metadata.get("deletionTimestamp"):
                continue
            seen.add(uid)
            st = self.services.setdefault(uid, ServiceState())
            t = time.time()
            if t < st.due:
                continue
            st.due = t + svc.spec.autoscaling.interval_seconds
            try:
                self.service(raw, svc, st)
            except ApiException as e:  # one service's trouble (e.g. deleted meanwhile) is not the others'
                print(json.dumps({"service": svc.metadata["name"], "api_error": e.status, "error": e.reason}),
                      file=sys.stderr, flush=True)
        for uid in set(self.services) - seen:  # deleted, or autoscaling turned off: forget it
            del self.services[uid]

    def buckets(self, svc: LLMService) -> list:
        if svc.spec.buckets or not svc.spec.policy_ref:
            return svc.spec.buckets
        raw = self.kube.policy(svc.metadata["namespace"], svc.spec.policy_ref)
        return SLOPolicy.model_validate(raw).spec.buckets if raw else []

    def service(self, raw: dict, svc: LLMService, st: ServiceState) -> None:
        ns, name = svc.metadata["namespace"], svc.metadata["name"]
        held: float | None = None
        for role, rs in actuate.settings(svc, self.buckets(svc), self.base).items():
            state = st.roles.get(role)
            if state is None:
                state = st.roles[role] = RoleState(Policy(rs.policy), History(rs.window_s))
                recorded = svc.status.autoscaling.get(role)
                if recorded is not None and recorded.desired_replicas is not None:
                    # A restarted autoscaler holds what is on record, not what happens to be running.
                    state.policy.last = Decision(recorded.desired_replicas, "on record", recorded.condition or "Ok")
            state.policy.cfg, state.history.span = rs.policy, rs.window_s  # the spec may have changed
            pods = [p for p in self.kube.pods(ns, selector(name, role)) if not p["metadata"].get("deletionTimestamp")]
            up = [p for p in pods if ready(p)]
            fleet = Fleet(ready=len(up), starting=len(pods) - len(up))
            timeout = min(5.0, svc.spec.autoscaling.interval_seconds / 2)
            if self.prometheus:
                sigs = federate(self.prometheus, ns, f"{name}-{role}", role, timeout)
            else:
                sigs = [s for s in (scrape(pod_url(p), role, timeout) for p in up) if s is not None]
            if sigs:
                state.history.add(merge(role, min(s.t for s in sigs), sigs))
            t = time.time()
            d = state.policy.decide(t, state.history.window(t, rs.slo), fleet)
            if fleet.total == 0 and d.desired == 0:
                held = self.held(ns, name) if held is None else held
                d = state.policy.last = actuate.scale_from_zero(d, fleet.total, held)
            self.record(raw, svc, role, state, d, fleet, t)

    def held(self, ns: str, name: str) -> float:
        """Requests the service's router pods hold for want of a replica (0 without router pods)."""
        routers = [p for p in self.kube.pods(ns, selector(name, ROUTER)) if ready(p)]
        return sum(h for h in (held_requests(pod_url(p), 2.0) for p in routers) if h is not None)

    def record(self, raw: dict, svc: LLMService, role: str, state: RoleState, d: Decision, fleet: Fleet,
               t: float) -> None:
        before = state.written or svc.status.autoscaling.get(role)
        e = actuate.entry(d, before, now())
        print(json.dumps({"time": round(t, 1), "service": f"{svc.metadata['namespace']}/{svc.metadata['name']}",
                          "role": role, "ready": fleet.ready, "starting": fleet.starting,
                          "desired": e.desired_replicas, "condition": d.condition, "reason": d.reason}), flush=True)
        if not actuate.changed(state.written, e) and t - state.written_at < self.resync_s:
            return
        self.kube.patch_status(svc.metadata["namespace"], svc.metadata["name"], actuate.status_patch(role, e))
        ev = actuate.event(role, before, fleet.total, e)
        if ev:
            self.kube.event(raw, *ev)
        state.written, state.written_at = e, t


def run(kube: Kube, base: PolicyConfig, namespace: str | None, prometheus: str | None, resync_s: float,
        iterations: int) -> int:
    scaler = Autoscaler(kube, base, namespace, prometheus, resync_s)
    n = 0
    while not iterations or n < iterations:
        try:
            scaler.tick()
        except ApiException as e:  # the API server restarting: try again next second
            print(json.dumps({"api_error": e.status, "error": e.reason}), file=sys.stderr, flush=True)
        n += 1
        time.sleep(1.0)  # each service keeps its own interval; this only bounds how late a decision is
    return 0
