"""`slofleet diagnose`, the verdict: a window of the engines' (and their router's) metrics -> for the worst bucket
the slow clock, the phase holding most of it, the numbers that decided, and what to try next. Pure.

The rule walks the issue's order of questions. Every figure is a mean or a histogram share over the window, so
it holds with 5-10 requests per bucket, and the only thresholds are the SLO's own (KV_FULL aside).
1. Which clock. A bucket misses a clock when fewer than its percentile of requests are within the target (the
   share read from the histogram as histogram_quantile reads it). The client-facing histogram judges: behind a
   router, its SLO clocks (TTFT, TPOT, E2E per bucket, whatever runtime answers). A router without them (an
   older one) gives its time to first byte as the TTFT, and E2E and TPOT are the engine's, shifted by the mean
   time the router adds after the engine (its TTFB plus stream phase, less the engine's E2E; for TPOT, per
   output token). A bucket's slow clock is its missed clock whose latency at the percentile is the most
   times over its target.
2. Which bucket. The worst bucket is the one whose slow clock is the most times over its target.
3-6. Which phase. Each phase's share of the slow clock's mean:
   TTFT (T = the router's mean TTFB, else the engine's mean TTFT): queue = queue time / T, prefill = prefill
     time / T, outside_model = (T - the engine's TTFT) / T: the router's own time, the hops to the engine, and
     for an answer not streamed (or held whole on the way) its decode too, since its first byte is its last.
   TPOT: decode time per output token is decode by definition; outside_model is the share the router's stream
     phase (first byte to last, so the client's reading too) adds to the engine's decode time.
   E2E (E = the router's mean TTFB plus stream phase, else the engine's mean E2E): queue, prefill and decode
     time / E, outside_model the rest.
   Engine phases come by each runtime's own names (contract.RUNTIME_METRICS), engine-wide where the runtime has
   no bucket label (vLLM); a share that needs a series the runtime does not export is left out and the entry
   says "not exported by RUNTIME" (llama-server exports no phase: no dominant phase then).
   The largest share dominates. KV decides instead when blocks, not the phase's own work, held the bucket back:
   its requests were preempted in the window (each preemption frees a request's KV and recomputes it later), or
   it is queue-dominated while the fullest engine's KV usage is at least KV_FULL with requests waiting or refused.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from slofleet.api.contract import (
    E2E,
    ROUTER_ADMITTED,
    ROUTER_E2E,
    ROUTER_PHASE,
    ROUTER_REFUSED,
    ROUTER_TPOT,
    ROUTER_TTFT,
    RUNTIME_METRICS,
    SLOFLEET,
    TTFT,
    Sample,
    not_exported,
    runtime_of,
)
from slofleet.api.v1alpha1 import Bucket

from .signals import Histogram

KV_FULL = 0.95  # a pool this full has no room for another sequence's blocks (the router's kv_full, too)


def phase_series(runtime: str) -> dict[str, str | None]:
    """The engine-side series diagnose reads, by the runtime's own names (None: the runtime does not export it)."""
    rm = RUNTIME_METRICS[runtime]
    return {"queue": rm.queue, "prefill": rm.prefill, "decode": rm.decode, "ttft": rm.ttft, "e2e": rm.e2e,
            "tpot": rm.tpot}


PHASE_SERIES = phase_series(SLOFLEET)
TPOT = PHASE_SERIES["tpot"]
PROMPT, OUTPUT = "vllm:request_prompt_tokens", "vllm:request_generation_tokens"
PREEMPTED, REFUSED = "slofleet:preemptions_by_bucket_total", "slofleet:admission_refusals_by_bucket_total"
PREFIX_QUERIES = "slofleet:prefix_cache_queries_by_bucket_total"
PREFIX_HITS = "slofleet:prefix_cache_hits_by_bucket_total"
DECODE_BATCH = "slofleet:decode_batch_size"
ROUTER_TTFB = "slofleet:router_time_to_first_byte_seconds"
ROUTER_RETRIES = "slofleet:router_retries_total"

# series name, bucket ("" when engine-wide), the router's phase ("" elsewhere), le ("" unless a histogram bucket)
Key = tuple[str, str, str, str]
Flat = dict[Key, float]


def flatten(samples: Iterable[Sample]) -> Flat:
    """One pod's samples by Key, summed over every other label (model, finish reason, status, ...)."""
    out: Flat = {}
    for s in samples:
        if not math.isnan(s.value):
            key = (s.name, s.labels.get("bucket", ""), s.labels.get("phase", ""), s.labels.get("le", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def cumulative(name: str) -> bool:
    return name.endswith(("_total", "_sum", "_count", "_bucket"))


def since(new: Flat, old: Flat | None) -> Flat:
    """One pod's window: its cumulative series minus the older scrape (from zero when there is none or when one
    went down: a restart); gauges as they are now."""
    if old is None or any(cumulative(k[0]) and v < old.get(k, 0.0) for k, v in new.items()):
        old = {}
    return {k: v - old.get(k, 0.0) if cumulative(k[0]) else v for k, v in new.items()}


def total(flats: Iterable[Flat]) -> Flat:
    out: Flat = {}
    for f in flats:
        for k, v in f.items():
            out[k] = out.get(k, 0.0) + v
    return out


def value(flat: Flat, name: str, bucket: str = "", phase: str = "") -> float:
    return flat.get((name, bucket, phase, ""), 0.0)


def hist(flat: Flat, name: str, bucket: str) -> Histogram | None:
    by_le = {float(le): v for (n, b, _, le), v in flat.items() if n == name + "_bucket" and b == bucket}
    bounds = tuple(sorted(by_le))
    h = Histogram(bounds, tuple(by_le[x] for x in bounds))
    return h if h.total > 0 else None


def mean(flat: Flat, name: str, bucket: str, phase: str = "") -> float | None:
    n = value(flat, name + "_count", bucket, phase)
    return value(flat, name + "_sum", bucket, phase) / n if n > 0 else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


# which engine series each share needs (outside_model: the engine's own clock, taken from the router's)
NEEDS = {"ttft": {"queue": "queue", "prefill": "prefill", "outside_model": "ttft"},
         "tpot": {"decode": "decode", "outside_model": "decode"},
         "e2e": {"queue": "queue", "prefill": "prefill", "decode": "decode", "outside_model": "e2e"}}


def shares(clock: str, m: dict[str, float], r_ttfb: float | None, stream: float | None,
           missing: frozenset[str] | set[str] = frozenset()) -> dict[str, float]:
    """Each phase's share of the clock's mean (the module's rule, steps 3-6), leaving out the shares that need a
    series the runtime does not export (`missing`), rather than guessing them."""
    if clock == "ttft":
        whole = r_ttfb if r_ttfb is not None else m["ttft"]
        parts = {"queue": m["queue"], "prefill": m["prefill"], "outside_model": whole - m["ttft"]}
    elif clock == "tpot":
        parts = {"decode": m["decode"], "outside_model": max((stream or 0.0) - m["decode"], 0.0)}
        whole = sum(parts.values())
    else:
        whole = r_ttfb + stream if r_ttfb is not None and stream is not None else m["e2e"]
        parts = {"queue": m["queue"], "prefill": m["prefill"], "decode": m["decode"], "outside_model": whole - m["e2e"]}
    return {k: round(max(v, 0.0) / whole, 3) if whole > 0 else 0.0 for k, v in parts.items()
            if NEEDS[clock][k] not in missing}


def engine_means(eng: Flat, runtime: str, name: str) -> tuple[dict[str, float], dict[str, str]]:
    """phase -> the bucket's mean seconds (from engine-wide series where the runtime has no bucket label), and
    phase -> "not exported by RUNTIME" for what it lacks."""
    m, missing = {}, {}
    for k, series in phase_series(runtime).items():
        if series is None:
            m[k], missing[k] = 0.0, not_exported(runtime)
            continue
        own = mean(eng, series, name)
        m[k] = own if own is not None else mean(eng, series, "") or 0.0
    return m, missing


def judged_by(eng: Flat, rtr: Flat, name: str, per_token: float, added: float) -> dict[str, tuple[Flat, str, float]]:
    """clock -> (where, histogram, seconds to add): the router's own clocks where it has them for the bucket,
    else its TTFB and the engine's TPOT and E2E shifted by what the router adds after the engine."""
    if hist(rtr, ROUTER_TTFT, name) is not None:
        return {"ttft": (rtr, ROUTER_TTFT, 0.0), "tpot": (rtr, ROUTER_TPOT, 0.0), "e2e": (rtr, ROUTER_E2E, 0.0)}
    return {"ttft": (rtr, ROUTER_TTFB, 0.0) if mean(rtr, ROUTER_TTFB, name) is not None else (eng, TTFT, 0.0),
            "tpot": (eng, TPOT, per_token), "e2e": (eng, E2E, added)}


def judge_bucket(b: Bucket, eng: Flat, rtr: Flat, kv_usage: float, runtime: str = SLOFLEET) -> dict:
    """One bucket's clocks against its SLO and, when it misses one, the slow clock, the phase shares and the
    dominant phase (module docstring)."""
    name, q = b.name, b.slo.percentile / 100
    m, missing = engine_means(eng, runtime, name)
    r_ttfb, stream = mean(rtr, ROUTER_TTFT, name) or mean(rtr, ROUTER_TTFB, name), mean(rtr, ROUTER_PHASE, name,
                                                                                          "stream")
    r_e2e = r_ttfb + stream if r_ttfb is not None and stream is not None else None
    added = max(r_e2e - m["e2e"], 0.0) if r_e2e is not None else 0.0  # by the router, after the engine finished
    per_token = max(stream - m["decode"], 0.0) / max((mean(eng, OUTPUT, name) or 2) - 1, 1) if added else 0.0
    clocks = {}
    for clock, (flat, series, shift) in judged_by(eng, rtr, name, per_token, added).items():
        target = getattr(b.slo, f"{clock}_ms")
        h = hist(flat, series, name) if target else None
        if h is not None:
            within, p = h.fraction_le(target / 1000 - shift) if target / 1000 > shift else 0.0, h.quantile(q) + shift
            clocks[clock] = {"target_ms": target, "p_ms": ms(p), "within": round(within, 3), "met": within >= q,
                             "times_target": round(p * 1000 / target, 2), "series": series,
                             **({"router_added_ms": ms(shift)} if shift else {})}
    e2e = hist(rtr, ROUTER_E2E, name) or hist(eng, E2E, name)
    entry = {"name": name, "requests": round(e2e.total) if e2e else 0, "percentile": b.slo.percentile,
             "met": all(c["met"] for c in clocks.values()) if clocks else None, "slow_clock": None, "dominant": None,
             "clocks": clocks, "mean_ms": {k: ms(v) for k, v in m.items() if v}, "runtime": runtime,
             "not_exported": missing}
    admission(entry, rtr)
    if r_ttfb is not None:
        phases = sorted(p for (n, bk, p, _) in rtr if n == ROUTER_PHASE + "_count" and bk == name)
        entry["mean_ms"] |= {"router_ttfb": ms(r_ttfb), **{f"router_{p}": ms(mean(rtr, ROUTER_PHASE, name, p))
                                                           for p in phases}}
    missed = [c for c, v in clocks.items() if not v["met"]]
    if not missed:
        return entry
    slow = max(missed, key=lambda c: clocks[c]["times_target"])
    share = shares(slow, m, r_ttfb, stream, set(missing))
    dominant = max(share, key=share.get) if share else None  # None: the runtime exports none of the phases
    preempted, refused, waiting = value(eng, PREEMPTED, name), value(eng, REFUSED, name), \
        value(eng, RUNTIME_METRICS[runtime].waiting or "")
    kv_full = kv_usage >= KV_FULL and (refused > 0 or waiting > 0)
    if dominant not in ("outside_model", None) and (preempted > 0 or (dominant == "queue" and kv_full)):
        dominant = "kv"
    queries = value(eng, PREFIX_QUERIES, name)
    entry |= {"slow_clock": slow, "dominant": dominant, "shares": share, "preemptions": preempted,
              "admission_refusals": refused, "kv_usage_max": round(kv_usage, 3), "requests_waiting": waiting,
              "prefix_hit_rate": round(value(eng, PREFIX_HITS, name) / queries, 3) if queries else None,
              "mean_prompt_tokens": round(mean(eng, PROMPT, name) or 0), "mean_output_tokens":
              round(mean(eng, OUTPUT, name) or 0), "mean_decode_batch": round(mean(eng, DECODE_BATCH, "") or 0, 1),
              "router_retries": value(rtr, ROUTER_RETRIES, name)}
    return entry


def admission(entry: dict, rtr: Flat) -> None:
    """The router's admission counts in the window; a bucket that meets its SLO while the router refused some of
    its requests is refused at admission: its demand is past what the fleet serves within target."""
    name = entry["name"]
    admitted, refused = value(rtr, f"{ROUTER_ADMITTED}_total", name), value(rtr, f"{ROUTER_REFUSED}_total", name)
    entry |= {"router_admitted": admitted, "router_refused": refused,
              "refused_at_admission": bool(refused > 0 and entry["met"])}


def refused_verdict(entries: list[dict], window_s: float | None) -> dict | None:
    """Every bucket meets its SLO, but some were refused at admission: the one refused most."""
    refused = [e for e in entries if e["refused_at_admission"]]
    if not refused:
        return None
    e = max(refused, key=lambda e: e["router_refused"])
    offered = e["router_admitted"] + e["router_refused"]
    return {"slow_clock": None, "bucket": e["name"], "dominant": "refused_at_admission",
            "evidence": {k: e[k] for k in ("requests", "percentile", "router_admitted", "router_refused")},
            "actions": [f"refused at admission: {e['router_refused']:g} of {offered:g} requests of {e['name']} were "
                        "refused (429, Retry-After) while the ones admitted met the SLO; the demand is past what the "
                        "fleet serves within target: add replicas (the pool's maxReplicas) or capacity per replica",
                        "priority: a lower spec.buckets[].priority takes capacity from the buckets above it",
                        "admission: spec.buckets[].admission.mode fixed or off admits more, at the cost of the SLO"],
            "buckets": entries, "window_s": window_s}


def actions(e: dict) -> list[str]:
    """What to look at next for the dominant phase (the issue's lists), with the bucket's own figures."""
    mm, b = e["mean_ms"], e["name"]
    if e["dominant"] is None:
        lacks = ", ".join(f"{phase} {why}" for phase, why in e["not_exported"].items())
        return [f"engine phases: {lacks}; the router's own phases (slofleet:router_phase_seconds) and the engine's "
                f"queue ({e['requests_waiting']:g} waiting) are what there is to read",
                f"capacity: {e['requests_waiting']:g} requests waiting in the engines: add sequence slots "
                "(spec.engine.maxNumSeqs) or replicas"]
    if e["dominant"] == "queue":
        return [f"capacity: requests of {b} waited {mm.get('queue', 0):g} ms on average for their first step; add "
                "sequence slots (--max-num-seqs, spec.engine.maxNumSeqs) or replicas (the pool's maxReplicas)",
                f"priority: a lower spec.buckets[].priority (--bucket-priorities) runs {b} ahead of the others",
                f"admission: spec.buckets[].admission (--max-waiting-requests, --max-queued-tokens) sheds with 429 "
                f"instead of queueing ({e['admission_refusals']:g} refused in the window)",
                "batch window: a larger --max-num-batched-tokens takes more waiting prompts into each step"]
    if e["dominant"] == "prefill":
        hits = "no lookups" if e["prefix_hit_rate"] is None else f"{e['prefix_hit_rate']:.0%} of prompt tokens"
        return [f"context length: {e['mean_prompt_tokens']} prompt tokens on average; trim the context or bound it "
                "(match.maxPromptTokens, --max-model-len)",
                f"prefix hits: {hits} from the prefix cache; keep --enable-prefix-caching on and shared text first",
                "chunked prefill: --max-num-batched-tokens is the prompt chunk per step (larger finishes a prompt "
                "sooner, smaller keeps decodes moving)",
                "a prefill pool: topology disaggregated gives long prompts their own replicas (spec.topology)"]
    if e["dominant"] == "decode":
        return [f"output length: {e['mean_output_tokens']} tokens on average; lower max_tokens or stop earlier",
                f"decode batch: {e['mean_decode_batch']:g} sequences per step on average; fewer per replica "
                "(--max-num-seqs) make each step shorter, more replicas share them",
                f"KV: {e['kv_usage_max']:.0%} of the fullest pool in use; attention reads every cached token",
                "attention backend and dtype: slofleet:dtype_info says what the engine runs (GPU: Triton kernels)",
                "sampling settings: penalties and top-k/top-p cost per step (slofleet:requests_by_sampling)",
                "speculative decoding: not in this engine yet"]
    if e["dominant"] == "kv":
        return [f"KV blocks: {e['preemptions']:g} preemptions of {b} (each recomputes the request) and "
                f"{e['kv_usage_max']:.0%} usage; give the pool more (--kv-cache-memory-gb or --num-blocks, "
                "spec.engine.kvCacheMemoryGb)",
                "fewer sequences at once (--max-num-seqs), so the running batch fits the pool",
                f"output length: max_tokens bounds each request's blocks ({e['mean_output_tokens']} tokens on average)",
                "prefix reuse: --enable-prefix-caching shares the blocks of common prefixes"]
    hop = (mm.get("router_upstream") or 0) - (mm.get("ttft") or 0)
    return [f"router/gateway time: the router's own {mm.get('router_own', 0):g} ms of each first byte on average "
            "(slofleet:router_phase_seconds: gateway, classify, hold, choose, retry)",
            f"network: the router waited {mm.get('router_upstream', 0):g} ms for the engine's first byte, "
            f"{hop:.0f} ms more than the engine's TTFT; look at the hops between (proxies, sidecars, DNS, TLS, zones)",
            f"retries: {e['router_retries']:g} requests of {b} retried on another replica (slofleet:router_retries)",
            f"client streaming: the router relayed first byte to last in {mm.get('router_stream', 0):g} ms, against "
            f"the engine's {mm.get('decode', 0):g} ms of decode (far less: answers not streamed, or held whole by a "
            "buffering hop; more: a client reading slowly)"]


def judge(buckets: list[Bucket], engines: list[Flat], routers: list[Flat], window_s: float | None) -> dict:
    """The verdict (one JSON object): the worst bucket's slow clock, dominant phase, evidence and actions, and
    every bucket's entry; nulls when every bucket meets its SLO (but for a bucket refused at admission)."""
    eng, rtr = total(engines), total(routers)
    runtime = runtime_of({k[0] for k in eng})
    rm = RUNTIME_METRICS[runtime]
    kv_usage = max((value(f, rm.kv_usage) for f in engines), default=0.0) if rm.kv_usage else 0.0
    entries = [judge_bucket(b, eng, rtr, kv_usage, runtime) for b in buckets]
    missed = [e for e in entries if e["slow_clock"]]
    if not missed:
        return refused_verdict(entries, window_s) or {
            "slow_clock": None, "bucket": None, "dominant": None, "evidence": {}, "actions": [],
            "buckets": entries, "window_s": window_s}
    worst = max(missed, key=lambda e: e["clocks"][e["slow_clock"]]["times_target"])
    evidence = {k: v for k, v in worst.items() if k not in ("name", "slow_clock", "dominant", "met")}
    return {"slow_clock": worst["slow_clock"], "bucket": worst["name"], "dominant": worst["dominant"],
            "evidence": evidence, "actions": actions(worst), "buckets": entries, "window_s": window_s}
