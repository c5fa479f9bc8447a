"""The replica set: discovery (a static list or Kubernetes EndpointSlices), health checks, and load scraped from
each engine's /metrics.

Each replica has a role (unified, prefill or decode, as `slofleet serve --role`): from the flag it was listed
with, or from the `slofleet.dev/role` label the operator puts on each role's Service, which the EndpointSlice
controller copies onto the Service's slices.

A replica serves traffic only while its readiness path answers 200 (slofleet's /ready; vLLM's and llama-server's
/health: contract.READY_PATH). A not-ready answer, a refused connection on a probe,
or a refused connection while proxying takes it out at once (so a dead pod stops getting requests within one
probe interval); probes that time out take it out only after a few in a row, since a busy engine answers late.
It comes back on its next successful probe.

Outlier detection (as Envoy's): a replica whose proxied tries fail `eject_after` times in a row (refused, reset,
a 503, or no first byte within the try's limit) is ejected: its probes cannot bring it back for `eject_seconds`
times the number of its ejections so far (up to `max_eject_factor`), so a replica that keeps failing stops
costing retries. An answer resets its count. A replica is ejected only while another of its role is ready and not
ejected (a fault of the whole fleet, or of the last one standing, is not an outlier): else it is only taken out,
and returns on its next good probe."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slofleet.api.contract import (
    READY_PATH,
    ROLE_LABEL,
    ROLES,
    RUNTIME_METRICS,
    SERVICE_LABEL,
    SLOFLEET,
    UNIFIED,
    load_kube_config,
    parse_samples,
    sum_by_name,
)

from .wire import internal_auth

log = logging.getLogger("slofleet.router.replicas")



def scraped(runtime: str) -> dict[str, str]:
    """The runtime's series for the three gauges the router reads (those it exports), by the Replica field."""
    rm = RUNTIME_METRICS[runtime]
    return {name: attr for attr, name in (("waiting", rm.waiting), ("running", rm.running),
                                          ("kv_usage", rm.kv_usage)) if name}


SCRAPED = scraped(SLOFLEET)


@dataclass
class Replica:
    url: str
    role: str = UNIFIED
    ready: bool = False
    inflight: int = 0  # requests this router has open on it
    waiting: float = 0.0  # from the engine's /metrics
    running: float = 0.0
    kv_usage: float = 0.0
    slow_probes: int = 0  # consecutive probes that timed out
    max_model_len: int | None = None  # the engine's context length, from its /v1/models
    fails: int = 0  # proxied tries failed in a row
    ejections: int = 0  # times ejected since its last answer
    ejected_until: float = 0.0  # monotonic s: its probes bring it back only after this

    def load(self) -> float:
        """Requests on the replica: what this router sent, or what the engine reports when other routers
        (or direct clients) put more there."""
        return max(float(self.inflight), self.waiting + self.running)

    def ended(self) -> None:
        """A request this router relayed has ended. The engine's counts from the last probe held it too, so they
        drop by one until the next probe: else a burst right after a batch ends reads the stale counts as load
        and piles onto the replicas probed while idle."""
        self.inflight -= 1
        if self.running >= 1:
            self.running -= 1
        elif self.waiting >= 1:
            self.waiting -= 1


def parse_load(text: str, names: dict[str, str] = SCRAPED) -> dict[str, float]:
    """The three gauges the router needs (by `scraped`'s names), summed over label sets. Raises ValueError on a
    malformed answer."""
    sums = sum_by_name(parse_samples(text), names.keys())
    return {attr: sums[name] for name, attr in names.items()}


def endpoints_from_slices(slices: list[Any], port_name: str | None, scheme: str = "http") -> dict[str, str]:
    """Ready endpoint URL -> role, from discovery.k8s.io/v1 EndpointSlice objects (kubernetes client models or
    dicts). A slice without the role label is a unified fleet's."""

    def get(obj: Any, name: str) -> Any:
        return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)

    urls: dict[str, str] = {}
    for s in slices:
        ports = [p for p in get(s, "ports") or [] if port_name is None or get(p, "name") == port_name]
        if not ports:
            continue
        port = get(ports[0], "port")
        role = (get(get(s, "metadata") or {}, "labels") or {}).get(ROLE_LABEL, UNIFIED)
        for ep in get(s, "endpoints") or []:
            cond = get(ep, "conditions")
            if cond is not None and get(cond, "ready") is False:  # absent means ready, per the API
                continue
            for addr in get(ep, "addresses") or []:
                host = f"[{addr}]" if ":" in addr else addr
                urls[f"{scheme}://{host}:{port}"] = role
    return dict(sorted(urls.items()))


SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def service_selector(service: str) -> str:
    return f"kubernetes.io/service-name={service}"


def llmservice_selector(name: str) -> str:
    # Every engine role's Service of the LLMService, and not the router's own Service (role "router").
    return f"{SERVICE_LABEL}={name},{ROLE_LABEL} in ({','.join(ROLES)})"


def kubernetes_lister(namespace: str, selector: str, port_name: str | None) -> Callable[[], dict[str, str]]:
    """A blocking function listing the ready endpoints (URL -> role) of the EndpointSlices matching `selector`,
    through the API server (in-cluster config, else kubeconfig). Polled rather than watched: endpoints change
    rarely and a poll cannot silently stall. No namespace given: the router pod's own. Needs RBAC to list
    discovery.k8s.io endpointslices there."""
    from kubernetes import client

    if not namespace:
        namespace = open(SA_NAMESPACE).read().strip() if os.path.exists(SA_NAMESPACE) else "default"
    load_kube_config()
    api = client.DiscoveryV1Api()

    def list_urls() -> dict[str, str]:
        slices = api.list_namespaced_endpoint_slice(namespace, label_selector=selector)
        return endpoints_from_slices(slices.items, port_name)

    return list_urls


@dataclass
class ReplicaSet:
    static: dict[str, str] = field(default_factory=dict)  # URL -> role
    lister: Callable[[], dict[str, str]] | None = None  # blocking; run in a thread
    interval: float = 1.0
    timeout: float = 1.0
    # A busy engine can answer a probe late (a long prefill step, a large KV import) without being dead; only
    # this many timeouts in a row take it out. A refused connection or a not-ready answer still does at once.
    slow_limit: int = 3
    replicas: dict[str, Replica] = field(default_factory=dict)
    on_change: Callable[[list[str]], None] | None = None
    # Set (and replaced) each time a replica turns ready: requests held while none was ready wait on it.
    became_ready: asyncio.Event = field(default_factory=asyncio.Event)
    max_model_len: int | None = None  # the longest context any replica listed (kept while none is up)
    runtime: str = SLOFLEET  # what serves in the replicas: their readiness path and metric names
    eject_after: int = 3  # proxied tries failed in a row that eject a replica
    eject_seconds: float = 10.0  # an ejection's length, times the replica's ejections so far
    max_eject_factor: int = 10

    def __post_init__(self) -> None:
        self.ready_path, self.names = READY_PATH[self.runtime], scraped(self.runtime)
        self.set_urls(self.static)

    def set_urls(self, urls: dict[str, str]) -> None:
        urls = {u.rstrip("/"): role for u, role in urls.items()}
        if urls == {u: r.role for u, r in self.replicas.items()}:
            return
        old = self.replicas
        self.replicas = {u: old[u] if u in old and old[u].role == role else Replica(u, role)
                         for u, role in urls.items()}
        log.info("replicas: %s", ", ".join(f"{u} ({role})" for u, role in urls.items()) or "none")
        if self.on_change:
            self.on_change(list(self.replicas))

    def ready(self, roles: Iterable[str] = ROLES) -> list[Replica]:
        return [r for r in self.replicas.values() if r.ready and r.role in roles]

    def mark_failed(self, replica: Replica, why: str) -> None:
        if replica.ready:
            log.warning("replica %s taken out: %s", replica.url, why)
        replica.ready = False

    def failed(self, replica: Replica, why: str, out: bool = True) -> None:
        """A proxied try failed: count it, take the replica out (unless `out` is False: a slow answer, not a dead
        replica), and eject it after `eject_after` in a row."""
        replica.fails += 1
        if out:
            self.mark_failed(replica, why)
        if replica.fails < self.eject_after or self.ejected(replica):
            return
        now = time.monotonic()
        peers = [r for r in self.replicas.values() if r.role == replica.role and r is not replica]
        if not any(r.ready and r.ejected_until <= now for r in peers):
            return  # the last of its role ready and not ejected: a fault of the fleet, not of this replica
        replica.ejections += 1
        length = self.eject_seconds * min(replica.ejections, self.max_eject_factor)
        replica.ejected_until, replica.ready = now + length, False
        log.warning("replica %s ejected for %g s: %d tries failed in a row (%s)", replica.url, length, replica.fails,
                    why)

    def answered(self, replica: Replica) -> None:
        replica.fails = replica.ejections = 0

    @staticmethod
    def ejected(replica: Replica) -> bool:
        return replica.ejected_until > time.monotonic()

    async def probe(self, client: aiohttp.ClientSession, r: Replica) -> None:
        try:
            async with client.get(r.url + self.ready_path) as resp:
                ready = resp.status == 200
            if ready:
                async with client.get(r.url + "/metrics") as resp:
                    text = await resp.text()
                try:
                    for attr, value in parse_load(text, self.names).items():
                        setattr(r, attr, value)
                except ValueError as e:  # a half-written answer: keep the last load; readiness is /ready's
                    log.warning("replica %s: unreadable /metrics: %s", r.url, e)
        except asyncio.TimeoutError:
            r.slow_probes += 1
            ready, why = r.ready and r.slow_probes < self.slow_limit, f"{r.slow_probes} probes timed out in a row"
        except (aiohttp.ClientError, OSError) as e:
            ready, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "not ready"
            r.slow_probes = 0
        if not ready:
            self.mark_failed(r, why)
        elif not r.ready and not self.ejected(r):
            log.info("replica %s (%s) is ready", r.url, r.role)
            await self.learn_context(client, r)
            r.ready = True
            self.became_ready.set()
            self.became_ready = asyncio.Event()

    async def learn_context(self, client: aiohttp.ClientSession, r: Replica) -> None:
        """Ask a replica turning ready for its context length (`max_model_len` in /v1/models, as slofleet and
        vLLM list it): quotas charge a request without max_tokens for what the engine may generate."""
        try:
            async with client.get(r.url + "/v1/models") as resp:
                r.max_model_len = int((await resp.json(content_type=None))["data"][0]["max_model_len"])
        except Exception as e:  # whatever it answers, readiness is /ready's: the last known length stays
            log.info("replica %s lists no max_model_len in /v1/models: %s", r.url, e)
            return
        self.max_model_len = max(x.max_model_len for x in self.replicas.values() if x.max_model_len)

    async def run(self) -> None:
        """Probe every replica every `interval` seconds, refreshing the list from the lister first."""
        # the internal token too: an engine asks it of /v1/models
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), headers=internal_auth()) \
                as client:
            while True:
                if self.lister is not None:
                    try:
                        self.set_urls(await asyncio.to_thread(self.lister))
                    except Exception as e:  # keep the last known list while the API server is unreachable
                        log.warning("listing endpoints failed: %s", e)
                await asyncio.gather(*(self.probe(client, r) for r in list(self.replicas.values())))
                await asyncio.sleep(self.interval)
