"""TEST-ONLY: Services for pods that run as local processes (for noderunner.py): their endpoints, and a way in
from this machine.

Endpoints: the API refuses loopback addresses in EndpointSlices (and Endpoints), and pods here have 127.0.x.y
ones, so up.sh turns the controller manager's endpoint controllers off and this publishes each selector
Service's pods instead, as the endpointslice controller would (the Service's labels, one slice per port set,
ready/serving/terminating), but of addressType FQDN, where an IP literal passes as a name. Clients of the
slices (the router) connect to the address all the same.

A way in: there is no cluster network, so a Service's ClusterIP a.b.c.d is mirrored on loopback as 127.b.c.d
(all of 127.0.0.0/8 is loopback on Linux), each TCP port forwarded to a ready endpoint (the next one per
connection, as kube-proxy's round robin), and the Service annotated with where (LOCAL_URL: one URL per port,
in the order of spec.ports). A port that something else holds on that address is replaced by a free one.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import defaultdict
from functools import partial

from kubernetes import client
from kubernetes.client.rest import ApiException

LOCAL_URL = "slofleet.dev/local-url"
SERVICE_NAME = "kubernetes.io/service-name"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
PUBLISHER = "noderunner.slofleet.dev"

Ports = tuple[tuple[str, int, str], ...]  # a pod's (name, number, protocol) for the Service's ports


class Services:
    def __init__(self, core: client.CoreV1Api, node: str):
        self.core, self.discovery, self.node = core, client.DiscoveryV1Api(core.api_client), node
        self.published: dict[tuple[str, str], dict] = {}  # (namespace, slice) -> what was last written
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="services", daemon=True).start()
        self.servers: dict[tuple[str, int], tuple[asyncio.Server, str]] = {}  # (Service uid, port) -> it, its URL
        self.backends: dict[tuple[str, int], list[tuple[str, int]]] = {}  # replaced whole, read by the loop's thread
        self.turn = itertools.count()

    def sync(self, pods: list[dict]) -> None:
        """pods: every pod (raw JSON), as the node runner has just listed them."""
        members = defaultdict(list)
        for p in pods:
            if (p["spec"].get("nodeName") == self.node and (p.get("status") or {}).get("podIP")
                    and p["status"].get("phase") not in ("Succeeded", "Failed")):
                members[p["metadata"]["namespace"]].append(p)
        existing = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in
                    raw(partial(self.discovery.list_endpoint_slice_for_all_namespaces,
                                label_selector=f"{MANAGED_BY}={PUBLISHER}"))}
        slices, servers = set(), set()
        for svc in raw(self.core.list_service_for_all_namespaces):
            m, selector = svc["metadata"], svc["spec"].get("selector")
            if not selector:  # its endpoints are someone else's (the API server's own Service)
                continue
            groups = endpoint_groups(svc, [p for p in members[m["namespace"]]
                                           if selector.items() <= (p["metadata"].get("labels") or {}).items()])
            for i, (ports, endpoints) in enumerate(sorted(groups.items()) or [((), [])]):
                key = (m["namespace"], f"{m['name']}-local" + (f"-{i}" if i else ""))
                slices.add(key)
                self.publish(svc, key, ports, endpoints, key in existing)
            self.expose(svc, groups, servers)
        for ns, name in existing - slices:
            try:
                self.discovery.delete_namespaced_endpoint_slice(name, ns)
            except ApiException as e:
                if e.status != 404:
                    raise
            self.published.pop((ns, name), None)
        for key in set(self.servers) - servers:
            self.loop.call_soon_threadsafe(self.servers.pop(key)[0].close)
            self.backends.pop(key, None)

    def publish(self, svc: dict, key: tuple[str, str], ports: Ports, endpoints: list[dict], exists: bool) -> None:
        m = svc["metadata"]
        body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": key[1], "namespace": key[0],
                             "labels": (m.get("labels") or {}) | {SERVICE_NAME: m["name"], MANAGED_BY: PUBLISHER},
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": m["name"],
                                                  "uid": m["uid"], "controller": True}]},
                "addressType": "FQDN", "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
                "endpoints": endpoints}
        if exists and self.published.get(key) == body:
            return
        self.discovery.patch_namespaced_endpoint_slice(key[1], key[0], body, field_manager=PUBLISHER, force=True,
                                                       _content_type="application/apply-patch+yaml")
        self.published[key] = body

    def expose(self, svc: dict, groups: dict[Ports, list[dict]], servers: set) -> None:
        m, ip = svc["metadata"], svc["spec"].get("clusterIP") or "None"
        if ip == "None" or ":" in ip:  # headless, or IPv6
            return
        urls = []
        for port in svc["spec"].get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                continue
            key = (m["uid"], port["port"])
            servers.add(key)
            self.backends[key] = [(ep["addresses"][0], number) for ports, eps in groups.items()
                                  for name, number, _ in ports if name == (port.get("name") or "")
                                  for ep in eps if ep["conditions"]["ready"]]
            if key not in self.servers:
                self.servers[key] = self.listen(key, "127." + ip.split(".", 1)[1], port)
                print(f"noderunner: service {m['namespace']}/{m['name']}:{port['port']} at {self.servers[key][1]}",
                      flush=True)
            urls.append(self.servers[key][1])
        if urls and (m.get("annotations") or {}).get(LOCAL_URL) != " ".join(urls):
            self.core.patch_namespaced_service(m["name"], m["namespace"],
                                               {"metadata": {"annotations": {LOCAL_URL: " ".join(urls)}}})

    def listen(self, key: tuple[str, int], host: str, port: dict) -> tuple[asyncio.Server, str]:
        async def start() -> asyncio.Server:
            try:
                return await asyncio.start_server(partial(self.forward, key), host, port["port"])
            except OSError:  # held by another process (on every address), or a privileged port
                return await asyncio.start_server(partial(self.forward, key), host, 0)

        server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        scheme = "https" if port["port"] == 443 or "https" in (port.get("name") or "") else "http"
        return server, f"{scheme}://{host}:{server.sockets[0].getsockname()[1]}"

    async def forward(self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        backends, n = self.backends.get(key) or [], next(self.turn)
        for i in range(len(backends)):  # the next ready endpoint that accepts
            try:
                address = backends[(n + i) % len(backends)]
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*address), 2)
                break
            except (OSError, asyncio.TimeoutError):
                continue
        else:  # no endpoint: refused, as a Service without one is
            writer.close()
            return
        try:
            await asyncio.gather(pipe(reader, up_writer, writer), pipe(up_reader, writer, up_writer))
        finally:
            writer.close()
            up_writer.close()


def endpoint_groups(svc: dict, pods: list[dict]) -> dict[Ports, list[dict]]:
    """The Service's pods grouped by what its ports are on each (a named targetPort may differ), as endpoints."""
    groups = defaultdict(list)
    for p in pods:
        named = {cp["name"]: cp["containerPort"] for c in p["spec"]["containers"] for cp in c.get("ports") or []
                 if cp.get("name")}
        ports = []
        for port in svc["spec"].get("ports") or []:
            target = port.get("targetPort", port["port"])
            number = int(target) if isinstance(target, int) or target.isdigit() else named.get(target)
            if number is not None:  # a pod without the named port is no endpoint of it
                ports.append((port.get("name") or "", number, port.get("protocol", "TCP")))
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
        serving = ready or bool(svc["spec"].get("publishNotReadyAddresses"))
        gone = bool(p["metadata"].get("deletionTimestamp"))
        groups[tuple(ports)].append({
            "addresses": [p["status"]["podIP"]], "nodeName": p["spec"]["nodeName"],
            "conditions": {"ready": serving and not gone, "serving": serving, "terminating": gone},
            "targetRef": {"kind": "Pod", "namespace": p["metadata"]["namespace"], "name": p["metadata"]["name"],
                          "uid": p["metadata"]["uid"]}})
    return {ports: sorted(eps, key=lambda e: e["addresses"][0]) for ports, eps in groups.items()}


async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, other: asyncio.StreamWriter) -> None:
    # A clean end is passed on as a half-close; a broken side closes both, so neither waits for the other.
    try:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
        if w.can_write_eof():
            w.write_eof()
            return
    except OSError:
        pass
    w.close()
    other.close()


def raw(call) -> list[dict]:
    # Raw JSON (camelCase, as in manifests) rather than the client's snake_case models.
    return json.loads(call(_preload_content=False).data)["items"]
