"""`slofleet autoscaler --kubernetes`: every LLMService, on its own interval: find each role's pods by the
operator's labels and read their metrics (from the pods, or from Prometheus). With spec.autoscaling.enabled,
decide and record the decision in status.autoscaling.<role> (+ an Event when it changes); the operator alone
turns it into Deployment replicas. Autoscaling on or off, write each bucket's SLO attainment to status.buckets.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

from kubernetes.client.rest import ApiException

from slofleet.api.contract import PREFILL, ROLE_LABEL, ROUTER, SERVICE_LABEL, SLOFLEET, now, parse_time, pod_url
from slofleet.api.v1alpha1 import BucketStatus, LLMService, RoleAutoscaling, SLOPolicy

from . import actuate, admissions, attainment
from .kube import Kube
from .policy import Decision, Fleet, Policy, PolicyConfig
from .signals import History, RoleSignals, merge
from .sources import federate, held_requests, router_admissions, scrape

STATUS_INTERVAL_S = 30  # status.buckets is read at least this often, so a bucket's first requests show within 60 s


@dataclass
class RoleState:
    policy: Policy
    history: History
    written: RoleAutoscaling | None = None  # what this process last wrote
    written_at: float = 0.0


@dataclass
class ServiceState:
    observed: attainment.Observed
    roles: dict[str, RoleState] = field(default_factory=dict)
    due: float = 0.0  # next read of the metrics
    decide_due: float = 0.0  # next scaling decision (spec.autoscaling.intervalSeconds)
    buckets: list[BucketStatus] | None = None  # status.buckets as this process last wrote it
    buckets_at: float = 0.0
    ledger: admissions.Ledger | None = None  # the routers' admission counts over the status window


def ready(pod: dict) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds) and bool(pod["status"].get("podIP"))


def started(pods: list[dict]) -> dict[str, float]:
    """pod name -> its start time, for the pods that have one."""
    return {p["metadata"]["name"]: parse_time(p["status"]["startTime"])
            for p in pods if (p.get("status") or {}).get("startTime")}


def with_clocks(sig: RoleSignals, clocks: RoleSignals | None) -> RoleSignals:
    """An engine's signals with the router's SLO clocks in place of its own (none: without clocks)."""
    return dataclasses.replace(sig, ttft=clocks.ttft if clocks else {}, itl=clocks.itl if clocks else {},
                               e2e=clocks.e2e if clocks else {})


def selector(service: str, role: str) -> str:
    return f"{SERVICE_LABEL}={service},{ROLE_LABEL}={role}"


class Autoscaler:
    def __init__(self, kube: Kube, base: PolicyConfig, namespace: str | None = None, prometheus: str | None = None,
                 resync_s: float = 60.0, status_window_s: float = attainment.STATUS_WINDOW_S):
        self.kube, self.base, self.namespace = kube, base, namespace
        self.prometheus, self.resync_s, self.status_window_s = prometheus, resync_s, status_window_s
        self.services: dict[str, ServiceState] = {}  # by uid

    def tick(self) -> None:
        seen = set()
        for raw in self.kube.services(self.namespace):
            svc = LLMService.model_validate(raw)
            uid = svc.metadata["uid"]
            if svc.metadata.get("deletionTimestamp"):
                continue
            seen.add(uid)
            st = self.services.setdefault(uid, ServiceState(attainment.Observed(self.status_window_s)))
            t = time.time()
            if t < st.due:
                continue
            interval = svc.spec.autoscaling.interval_seconds
            st.due = t + min(interval, STATUS_INTERVAL_S)
            decide = svc.spec.autoscaling.enabled and t >= st.decide_due
            if decide:
                st.decide_due = t + interval
            try:
                self.service(raw, svc, st, decide)
            except ApiException as e:  # one service's trouble (e.g. deleted meanwhile) is not the others'
                print(json.dumps({"service": svc.metadata["name"], "api_error": e.status, "error": e.reason}),
                      file=sys.stderr, flush=True)
        for uid in set(self.services) - seen:  # deleted: forget it
            del self.services[uid]

    def buckets(self, svc: LLMService) -> list:
        if svc.spec.buckets or not svc.spec.policy_ref:
            return svc.spec.buckets
        raw = self.kube.policy(svc.metadata["namespace"], svc.spec.policy_ref)
        return SLOPolicy.model_validate(raw).spec.buckets if raw else []

    def service(self, raw: dict, svc: LLMService, st: ServiceState, decide: bool) -> None:
        ns, name, on = svc.metadata["namespace"], svc.metadata["name"], svc.spec.autoscaling.enabled
        if not on:
            st.roles.clear()  # turned on again, it starts from what is on record
        buckets = self.buckets(svc)
        held: float | None = None
        timeout = min(5.0, svc.spec.autoscaling.interval_seconds / 2)
        clocks = self.clocks(svc, st, timeout)
        counts = self.admissions(ns, name, st, timeout)
        for role, rs in actuate.settings(svc, buckets, self.base).items():
            pods = [p for p in self.kube.pods(ns, selector(name, role)) if not p["metadata"].get("deletionTimestamp")]
            up = [p for p in pods if ready(p)]
            sigs = self.read(ns, name, role, up, timeout, svc.spec.engine.runtime)
            if role != PREFILL:  # a prefill engine serves the first half of requests a decode engine answers
                for sig in sigs:  # behind a router, the engines give the phases and the router the clocks
                    st.observed.add(sig if clocks is None else with_clocks(sig, None), started(pods).get(sig.pod))
            if not on:
                continue
            state = self.role_state(svc, st, role, rs)
            if sigs:
                merged = merge(role, min(s.t for s in sigs), sigs)
                merged = merged if clocks is None or role == PREFILL else with_clocks(merged, clocks)
                merged.refused = counts.refused_by_bucket() if counts is not None else {}  # offered load
                state.history.add(merged)
            if not decide:
                continue
            fleet = Fleet(ready=len(up), starting=len(pods) - len(up))
            t = time.time()
            d = state.policy.decide(t, state.history.window(t, rs.slo), fleet)
            if fleet.total == 0 and d.desired == 0:
                held = self.held(ns, name) if held is None else held
                d = state.policy.last = actuate.scale_from_zero(d, fleet.total, held)
            self.record(raw, svc, role, state, d, fleet, t)
        self.report(svc, st, buckets)

    def clocks(self, svc: LLMService, st: ServiceState, timeout: float) -> RoleSignals | None:
        """With the router on, its pods' SLO clocks summed (none when no router answered: the clocks are the
        router's or nobody's, never the engines' in between), each pod's also kept for status.buckets."""
        if not svc.spec.router.enabled:
            return None
        ns, name = svc.metadata["namespace"], svc.metadata["name"]
        pods = [p for p in self.kube.pods(ns, selector(name, ROUTER)) if not p["metadata"].get("deletionTimestamp")]
        sigs = self.read(ns, name, ROUTER, [p for p in pods if ready(p)], timeout)
        for sig in sigs:
            st.observed.add(sig, started(pods).get(sig.pod))
        return merge(ROUTER, min((s.t for s in sigs), default=time.time()), sigs)

    def read(self, ns: str, name: str, role: str, up: list[dict], timeout: float,
             runtime: str = SLOFLEET) -> list[RoleSignals]:
        """Each ready pod's signals (from Prometheus: each pod it has series of), named by pod."""
        if self.prometheus:
            return federate(self.prometheus, ns, f"{name}-{role}", role, timeout, runtime)
        sigs = [(p, scrape(pod_url(p), role, timeout, runtime)) for p in up]
        return [dataclasses.replace(s, pod=p["metadata"]["name"]) for p, s in sigs if s is not None]

    def role_state(self, svc: LLMService, st: ServiceState, role: str, rs: actuate.RoleSettings) -> RoleState:
        state = st.roles.get(role)
        if state is None:
            state = st.roles[role] = RoleState(Policy(rs.policy), History(rs.window_s))
            recorded = svc.status.autoscaling.get(role)
            if recorded is not None and recorded.desired_replicas is not None:
                # A restarted autoscaler holds what is on record, not what happens to be running.
                state.policy.last = Decision(recorded.desired_replicas, "on record", recorded.condition or "Ok")
        state.policy.cfg, state.history.span = rs.policy, rs.window_s  # the spec may have changed
        return state

    def report(self, svc: LLMService, st: ServiceState, buckets: list) -> None:
        """status.buckets, when its figures moved (or every resync, so its time says it is current)."""
        t, window = time.time(), st.observed.window_s
        hists = st.observed.delta(t)
        means = st.observed.phase_means()
        counted = st.ledger.window() if st.ledger is not None else None
        entries = [attainment.bucket_status(b, hists, window, now(), means.get(b.name) or means.get(""), counted)
                   for b in buckets]
        if attainment.same(st.buckets, entries) and t - st.buckets_at < self.resync_s:
            return
        self.kube.patch_status(svc.metadata["namespace"], svc.metadata["name"], attainment.status_patch(entries))
        st.buckets, st.buckets_at = entries, t

    def admissions(self, ns: str, name: str, st: ServiceState, timeout: float) -> admissions.Admissions | None:
        """The service's routers' admission counts, summed (None without a router that answered), kept for the
        status window."""
        routers = [p for p in self.kube.pods(ns, selector(name, ROUTER)) if ready(p)]
        got = [a for a in (router_admissions(pod_url(p), timeout) for p in routers) if a is not None]
        if not got:
            return None
        counts = got[0]
        for a in got[1:]:
            counts = counts.plus(a)
        st.ledger = st.ledger or admissions.Ledger(self.status_window_s)
        st.ledger.add(counts)
        return counts

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
        iterations: int, status_window_s: float = attainment.STATUS_WINDOW_S) -> int:
    scaler = Autoscaler(kube, base, namespace, prometheus, resync_s, status_window_s)
    n = 0
    while not iterations or n < iterations:
        try:
            scaler.tick()
        except ApiException as e:  # the API server restarting: try again next second
            print(json.dumps({"api_error": e.status, "error": e.reason}), file=sys.stderr, flush=True)
        n += 1
        time.sleep(1.0)  # each service keeps its own interval; this only bounds how late a decision is
    return 0
