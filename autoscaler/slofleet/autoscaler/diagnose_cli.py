"""`slofleet diagnose`: read the metrics of engines and routers (given by URL; a router's engines are found from
its replicas), or of an LLMService's pods from Prometheus, and print the verdict of diagnose.judge for the worst
bucket: as text, or as exactly one JSON object with --json (errors go to stderr).

Without --window the figures are since each pod started (one scrape); with --window S they are the difference of
two scrapes S seconds apart (from Prometheus: two instant queries, now and S seconds ago, so no wait)."""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from pathlib import Path

import yaml
from pydantic import ValidationError

from slofleet.api.base import error_text
from slofleet.api.contract import DECODE, ROUTER, UNIFIED, Sample, parse_samples
from slofleet.api.v1alpha1 import Bucket, LLMService, SLOPolicy

from .diagnose import Flat, flatten, judge, since
from .sources import FEDERATE_MATCH, fetch, scrape_error

MAX_SCRAPE_WINDOW_S = 50.0  # scrapes wait out the window, and the answer must come within a minute
REPLICA_READY = "slofleet:router_replica_ready"
FIGURES = ("preemptions", "admission_refusals", "kv_usage_max", "requests_waiting", "prefix_hit_rate",
           "mean_prompt_tokens", "mean_output_tokens", "mean_decode_batch", "router_retries")  # of the evidence

Pods = dict[str, Flat]  # where -> its flattened samples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", action="append", default=[], metavar="URL",
                        help="an engine or a router (the engines it routes to are read too); repeat for several")
    parser.add_argument("--prometheus", metavar="URL", help="read the LLMService's pods from this Prometheus")
    parser.add_argument("--llmservice", metavar="NAMESPACE/NAME", help="with --prometheus: which service")
    parser.add_argument("--buckets", required=True, metavar="FILE",
                        help="an LLMService or SLOPolicy YAML, or a file with only spec.buckets: the SLOs")
    parser.add_argument("--window", type=float, default=0.0, metavar="SECONDS",
                        help="judge the last SECONDS (default: everything since the pods started)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per scrape")


def load_buckets(path: str) -> list[Bucket]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    if isinstance(data, list):  # a bare list of buckets, as the router's --buckets takes
        data = {"buckets": data}
    kind = data.get("kind")
    if kind == "LLMService":
        svc = LLMService.model_validate(data)
        if not svc.spec.buckets and svc.spec.policy_ref:
            raise ValueError(f"{path}: its buckets are in SLOPolicy {svc.spec.policy_ref}; pass that file")
        return svc.spec.buckets
    if kind == "SLOPolicy":
        return SLOPolicy.model_validate(data).spec.buckets
    return [Bucket.model_validate(b) for b in (data.get("spec") or data).get("buckets") or []]


def scrape_urls(urls: list[str], timeout: float) -> tuple[Pods, Pods]:
    """(engines, routers) by URL; a router's ready replicas are scraped as engines."""
    engines: Pods = {}
    routers: Pods = {}
    todo, seen = [u.rstrip("/") for u in urls], set()
    while todo:
        url = todo.pop(0)
        if url in seen:
            continue
        seen.add(url)
        text = fetch(url + "/metrics", timeout)
        try:
            samples = parse_samples(text) if text is not None else None
        except ValueError as e:
            scrape_error(url, e)
            samples = None
        if samples is None:
            continue
        if any(s.name.startswith("slofleet:router_") for s in samples):
            routers[url] = flatten(samples)
            todo += [s.labels["replica"].rstrip("/") for s in samples if s.name == REPLICA_READY and s.value == 1]
        else:
            engines[url] = flatten(samples)
    return engines, routers


def query_prometheus(base: str, namespace: str, name: str, at: float, timeout: float) -> tuple[Pods, Pods]:
    """(engines, routers) by pod, as Prometheus had them at time `at` (the serving roles' and the router's)."""
    engines: Pods = {}
    routers: Pods = {}
    for role in (UNIFIED, DECODE, ROUTER):
        selector = FEDERATE_MATCH.format(namespace=namespace, service=f"{name}-{role}")
        text = fetch(f"{base.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': selector, 'time': at})}",
                     timeout)
        if text is None:
            continue
        by_pod: dict[str, list] = {}
        for r in json.loads(text)["data"]["result"]:
            labels = dict(r["metric"])
            by_pod.setdefault(labels.get("pod") or labels.get("instance", ""), []).append(
                Sample(labels.pop("__name__"), labels, float(r["value"][1])))
        for pod, samples in by_pod.items():
            (routers if role == ROUTER else engines)[pod] = flatten(samples)
    return engines, routers


def windowed(new: Pods, old: Pods | None) -> list[Flat]:
    return [since(f, None if old is None else old.get(where)) for where, f in new.items()]


def report(v: dict) -> str:
    """The verdict as text: the worst bucket's clock, phase and evidence, then every bucket in a line."""
    lines = []
    if v["bucket"] is None:
        lines.append("every bucket meets its SLO")
    elif v["slow_clock"] is None:  # met, but refused at admission
        lines += [f"refused at admission: bucket {v['bucket']}", "next:", *(f"  - {a}" for a in v["actions"])]
    else:
        e = v["evidence"]
        c = e["clocks"][v["slow_clock"]]
        lines += [f"slow clock: {v['slow_clock']} of bucket {v['bucket']} (p{e['percentile']:g} {c['p_ms']:g} ms, "
                  f"target {c['target_ms']} ms, {c['within']:.0%} of {e['requests']} requests within)",
                  f"dominant: {v['dominant']} (share of the {v['slow_clock']}: "
                  + ", ".join(f"{k} {s:.0%}" for k, s in e["shares"].items()) + ")",
                  "evidence: " + ", ".join(f"{k} {x:g} ms" for k, x in e["mean_ms"].items()) + " (means)",
                  "          " + ", ".join(f"{k} {e[k]:g}" for k in FIGURES if e[k] is not None),
                  *([f"engine ({e['runtime']}): " + ", ".join(f"{k} {w}" for k, w in e["not_exported"].items())]
                    if e["not_exported"] else []),
                  "next:", *(f"  - {a}" for a in v["actions"])]
    lines.append("buckets:")
    for b in v["buckets"]:
        clocks = ", ".join(f"{k} p{b['percentile']:g} {c['p_ms']:g}/{c['target_ms']} ms"
                           for k, c in b["clocks"].items())
        state = "no requests" if b["met"] is None else "met" if b["met"] else f"missed ({b['dominant']})"
        state += f", {b['router_refused']:g} refused at admission" if b["router_refused"] else ""
        lines.append(f"  {b['name']}: {b['requests']} requests, {clocks or 'no targets observed'}: {state}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def fail(message: str) -> int:
        print(f"slofleet diagnose: {message}", file=sys.stderr)
        return 2

    if bool(args.prometheus) != bool(args.llmservice) or bool(args.url) == bool(args.prometheus):
        return fail("give --url URL (repeatable), or --prometheus URL with --llmservice NAMESPACE/NAME")
    try:
        buckets = load_buckets(args.buckets)
    except ValidationError as e:
        return fail(f"{args.buckets}: invalid buckets: {error_text(e)}")
    except (OSError, ValueError, AttributeError, yaml.YAMLError) as e:
        return fail(f"cannot read buckets from {args.buckets}: {' '.join(str(e).split())}")
    if not buckets:
        return fail(f"{args.buckets} holds no buckets")
    if args.prometheus:
        ns, _, name = args.llmservice.rpartition("/")
        read = lambda at: query_prometheus(args.prometheus, ns or "default", name, at, args.timeout)  # noqa: E731
        now = time.time()
        old = read(now - args.window) if args.window else None
        new = read(now)
    else:
        if args.window > MAX_SCRAPE_WINDOW_S:
            return fail(f"a window over {MAX_SCRAPE_WINDOW_S:g} s needs --prometheus (scrapes wait it out)")
        old = scrape_urls(args.url, args.timeout) if args.window else None
        if old is not None:
            time.sleep(args.window)
        new = scrape_urls(list(old[0]) + list(old[1]) if old else args.url, args.timeout)
    if not new[0]:
        return fail("no engine metrics could be read (a router's replicas must be reachable from here; or pass "
                    "the engines with --url)")
    verdict = judge(buckets, windowed(new[0], old and old[0]), windowed(new[1], old and old[1]),
                    args.window or None)
    print(json.dumps(verdict) if args.json else report(verdict))
    return 0
