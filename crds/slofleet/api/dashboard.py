"""Generates the Grafana dashboard the chart and the manifests ship: `python -m slofleet.api.dashboard [outdir]`;
without an outdir into `charts/slofleet/dashboards/` and `manifests/dashboards/` (kustomize reads no files above
its root), like the CRDs.

One row per category of the observability loop (request shape, queue, prefill, decode, KV, tail, quality, cost),
every per-bucket series split by `bucket` and filtered by the `$bucket` variable. The series are the ones engines
and routers export; the labels `namespace` and `service` are the ones a ServiceMonitor (which the operator creates
where its CRD exists) gives: `<llmservice>-<role>` for engines, `<llmservice>-router` for the router. A test parses
every expression and checks each series against a live scrape.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slofleet.api.contract import ROUTER_E2E, ROUTER_SLO, ROUTER_TPOT, ROUTER_TTFT

ENGINE = 'namespace="$namespace", service=~"$llmservice-(unified|prefill|decode)"'
ROUTER = 'namespace="$namespace", service="$llmservice-router"'
BUCKET = ', bucket=~"$bucket"'
MET = ', met="true"'  # the router's requests that met every target of their bucket
WINDOW = "[$__rate_interval]"
DS = {"type": "prometheus", "uid": "${datasource}"}
Target = tuple[str, str]  # (PromQL, legend)


def rate(metric: str, sel: str = ENGINE + BUCKET, by: str = "bucket") -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}{WINDOW}))"


def quantile(p: float, metric: str, sel: str = ENGINE + BUCKET, by: str = "bucket") -> str:
    return f"histogram_quantile({p}, {rate(metric + '_bucket', sel, by + ', le')})"


def quantiles(metric: str, ps=(0.5, 0.95, 0.99), sel: str = ENGINE + BUCKET, by: str = "bucket") -> list[Target]:
    return [(quantile(p, metric, sel, by), f"{{{{{by}}}}} p{round(p * 100)}") for p in ps]


def per_bucket(expr: str, legend: str = "{{bucket}}") -> list[Target]:
    return [(expr, legend)]


def ratio(num: str, den: str) -> str:
    return f"{num} / {den}"


GIB = " / 2^30"
# category -> panels: (title, unit, targets, description)
ROWS: dict[str, list[tuple[str, str, list[Target], str]]] = {
    "Request shape": [
        ("Requests per second", "reqps", per_bucket(rate("vllm:request_success_total")), "finished, any reason"),
        ("Prompt tokens", "short", quantiles("vllm:request_prompt_tokens", (0.5, 0.99)), ""),
        ("Output tokens", "short", quantiles("vllm:request_generation_tokens", (0.5, 0.99))
         + quantiles("vllm:request_max_num_generation_tokens", (0.5,)), "generated; and max_tokens asked (p50)"),
        ("Route chosen (router)", "reqps", per_bucket(rate("slofleet:router_routed_total", ROUTER + BUCKET,
                                                             "bucket, how"), "{{bucket}} {{how}}")
         + per_bucket(rate("slofleet:router_pd_routes_total", ROUTER + BUCKET, "bucket, route"),
                      "{{bucket}} {{route}}"), "replica choice, and where prompts were prefilled"),
        ("Model chosen", "reqps", per_bucket(rate("vllm:request_success_total", by="bucket, model_name"),
                                             "{{bucket}} {{model_name}}"), ""),
    ],
    "Queue": [
        ("Queue time", "s", quantiles("vllm:request_queue_time_seconds"), "arrival to first scheduled; this engine "
         "has no batching window, so this is the batch wait too"),
        ("Waiting requests", "short", per_bucket(f"sum by (bucket) (slofleet:num_requests_waiting_by_bucket"
                                                 f"{{{ENGINE}{BUCKET}}})")
         + per_bucket(f"sum by (bucket) (slofleet:router_held_requests{{{ROUTER}{BUCKET}}})", "{{bucket}} held"),
         "in the engines' queues; held by the router while no replica is ready"),
        ("Admission refusals", "reqps", per_bucket(rate("slofleet:admission_refusals_by_bucket_total"),
                                                   "{{bucket}} engine")
         + per_bucket(rate("slofleet:router_rejected_total", ROUTER + BUCKET, "bucket, reason"),
                      "{{bucket}} router {{reason}}"), "429s by the engines, refusals by the router"),
        ("Priority", "short", quantiles("slofleet:request_priority", (0.5,)), "lower runs first"),
        ("Queued prompt tokens", "short", per_bucket(f"sum (slofleet:queued_prompt_tokens{{{ENGINE}}})", "all"),
         "engine-wide"),
    ],
    "Prefill": [
        ("Prefill time", "s", quantiles("vllm:request_prefill_time_seconds"), "first scheduled to first token"),
        ("Prefill tokens/s per request", "short",
         per_bucket(ratio(rate("slofleet:prefill_tokens_computed_total"),
                          rate("vllm:request_prefill_time_seconds_sum"))),
         "prompt tokens computed over prefill time (cache hits and transferred KV excluded)"),
        ("Prefix-cache hit rate", "percentunit",
         per_bucket(ratio(rate("slofleet:prefix_cache_hits_by_bucket_total"),
                          rate("slofleet:prefix_cache_queries_by_bucket_total"))), "of prompt tokens"),
    ],
    "Decode": [
        ("Time per output token", "s", quantiles("vllm:request_time_per_output_token_seconds"), "per request"),
        ("Decode time", "s", quantiles("vllm:request_decode_time_seconds"), "first token to finish"),
        ("Decode tokens/s", "short", per_bucket(rate("vllm:generation_tokens_total")), ""),
        ("Decode batch size and tokens per step", "short",
         quantiles("slofleet:decode_batch_size", (0.5, 0.99), ENGINE, "service")
         + [(quantile(0.5, "vllm:iteration_tokens_total", ENGINE, "service"), "{{service}} tokens/step p50")],
         "engine-wide, per step"),
        ("Sampling", "reqps", per_bucket(rate("slofleet:requests_by_sampling_total", by="bucket, sampling"),
                                         "{{bucket}} {{sampling}}"), "greedy vs sampled"),
    ],
    "KV cache": [
        ("KV GiB used / total", "decgbytes", [(f"sum by (pod) (slofleet:kv_cache_bytes_used{{{ENGINE}}}){GIB}",
                                               "{{pod}} used"),
                                              (f"sum by (pod) (slofleet:kv_cache_bytes_total{{{ENGINE}}}){GIB}",
                                               "{{pod}} total")], ""),
        ("Block usage", "percentunit", [(f"max by (pod) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "{{pod}}")], ""),
        ("Unfilled slots (fragmentation)", "short",
         [(f"sum by (pod) (slofleet:kv_unfilled_slots{{{ENGINE}}})", "{{pod}}")],
         "token slots allocated to running requests, not yet filled"),
        ("Evictions and preemptions", "ops",
         [(rate("slofleet:kv_evictions_total", ENGINE, "pod"), "{{pod}} evicted blocks")]
         + per_bucket(rate("slofleet:preemptions_by_bucket_total"), "{{bucket}} preemptions"), ""),
        ("Prefix reuse", "percentunit", [(ratio(rate("vllm:prefix_cache_hits_total", ENGINE, "service"),
                                                rate("vllm:prefix_cache_queries_total", ENGINE, "service")),
                                          "{{service}}")], "engine-wide hit rate"),
    ],
    "Tail": [
        ("TTFT (router)", "s", quantiles(ROUTER_TTFT, sel=ROUTER + BUCKET),
         "arrival at the router to the first token relayed, whatever runtime answers"),
        ("TPOT (router)", "s", quantiles(ROUTER_TPOT, sel=ROUTER + BUCKET),
         "per request: first token to last over the tokens after the first, as the client receives them"),
        ("E2E (router)", "s", quantiles(ROUTER_E2E, sel=ROUTER + BUCKET), "arrival to the last byte relayed"),
        ("Outside the model: router TTFT - engine TTFT (p99)", "s",
         per_bucket(f"{quantile(0.99, ROUTER_TTFT, ROUTER + BUCKET)} - "
                    f"{quantile(0.99, 'vllm:time_to_first_token_seconds')}"),
         "routing, retries, hand-off and network: high while the engines look fine (engines that label their "
         "histograms by bucket: slofleet's)"),
        ("Router time by phase (p99)", "s",
         per_bucket(quantile(0.99, "slofleet:router_phase_seconds", ROUTER + BUCKET, "bucket, phase"),
                    "{{bucket}} {{phase}}"), "gateway, classify, hold, choose, retry, upstream, handoff, own, stream"),
        ("Requests over their SLO", "percentunit",
         per_bucket(f"1 - {rate(ROUTER_SLO + '_total', ROUTER + BUCKET + MET)} / "
                    f"{rate(ROUTER_SLO + '_total', ROUTER + BUCKET)}", "{{bucket}} router")
         + per_bucket('max by (bucket, clock) (slofleet:slo_bad_requests:ratio_rate5m{namespace="$namespace", '
                      'service=~"$llmservice-(unified|decode)", bucket=~"$bucket"})', "{{bucket}} {{clock}}"),
         "the router's share of requests that missed a target of their bucket (refused ones included), and the "
         "5m bad-request ratio per clock, from the chart's recording rules (monitoring.prometheusRule)"),
    ],
    "Quality": [
        ("Finish reasons", "reqps", per_bucket(rate("vllm:request_success_total", by="bucket, finished_reason"),
                                               "{{bucket}} {{finished_reason}}"), "stop, length, abort, error"),
        ("Aborted or failed", "percentunit",
         per_bucket(ratio(rate("vllm:request_success_total", ENGINE + BUCKET + ', finished_reason=~"abort|error"'),
                          rate("vllm:request_success_total"))), ""),
        ("Router retries and cut streams", "reqps",
         per_bucket(rate("slofleet:router_retries_total", ROUTER + BUCKET), "{{bucket}} retried")
         + per_bucket(rate("slofleet:router_streams_cut_total", ROUTER + BUCKET, "bucket, reason"),
                      "{{bucket}} cut {{reason}}"), ""),
        ("HTTP status (router)", "reqps", per_bucket(rate("slofleet:router_requests_total", ROUTER + BUCKET,
                                                          "bucket, code"), "{{bucket}} {{code}}"), ""),
    ],
    "Cost": [
        ("Cost per request", "currencyUSD", per_bucket(ratio(rate("slofleet:request_cost_total"),
                                                             rate("vllm:request_success_total"))),
         "each engine step's time split over its requests, at --price-per-hour"),
        ("Cost per 1k tokens", "currencyUSD",
         per_bucket(f"1000 * {rate('slofleet:request_cost_total')} / ({rate('vllm:prompt_tokens_total')} + "
                    f"{rate('vllm:generation_tokens_total')})"), "prompt and generated"),
        ("Cost per successful request", "currencyUSD",
         per_bucket(ratio(rate("slofleet:request_cost_total"),
                          rate("vllm:request_success_total", ENGINE + BUCKET + ', finished_reason=~"stop|length"'))),
         "finished by stop or length"),
        ("Spend per hour", "currencyUSD", [(f"3600 * {rate('slofleet:replica_cost_total', ENGINE, 'service')}",
                                            "{{service}} replicas"),
                                           (f"3600 * {rate('slofleet:request_cost_total', ENGINE, 'service')}",
                                            "{{service}} attributed to requests")], "the gap is idle time"),
    ],
}


def variable(name: str, query: str, regex: str = "", multi: bool = False) -> dict:
    out = {"name": name, "type": "query", "datasource": DS, "query": {"query": query, "refId": name},
           "definition": query, "refresh": 2, "regex": regex, "sort": 1, "multi": multi, "includeAll": multi}
    return out | ({"current": {"text": "All", "value": "$__all"}, "allValue": ".*"} if multi else {})


def dashboard() -> dict:
    panels, y = [], 0
    for title, row in ROWS.items():
        panels.append({"id": len(panels) + 1, "type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        for i, (name, unit, targets, doc) in enumerate(row):
            panels.append({"id": len(panels) + 1, "type": "timeseries", "title": name, "description": doc,
                           "datasource": DS, "gridPos": {"h": 8, "w": 8, "x": i % 3 * 8, "y": y + i // 3 * 8},
                           "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                           "targets": [{"refId": chr(65 + j), "datasource": DS, "expr": e, "legendFormat": legend}
                                       for j, (e, legend) in enumerate(targets)]})
        y += (len(row) + 2) // 3 * 8
    return {
        "uid": "slofleet-buckets", "title": "slofleet: where did the time go (per bucket)", "tags": ["slofleet"],
        "description": "The observability loop per bucket: request shape, queue, prefill, decode, KV, tail, quality "
                       "and cost. Which clock is slow, in which bucket, and which phase holds the time.",
        "schemaVersion": 39, "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        # Grafana's schema requires the list, and Grafana adds its built-in annotations to a dashboard without it
        "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                  "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                  "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            variable("namespace", "label_values(vllm:num_requests_running, namespace)"),
            # the LLMService: engine Services are named <llmservice>-<role>
            variable("llmservice", 'label_values(vllm:num_requests_running{namespace="$namespace"}, service)',
                     "/^(.*)-(?:unified|prefill|decode)$/"),
            # the router's buckets (any runtime), and an engine's that labels them (slofleet's, router off)
            variable("bucket", f'label_values({{__name__=~"{ROUTER_TTFT}_count|vllm:e2e_request_latency_seconds_'
                     f'count", namespace="$namespace"}}, bucket)', multi=True),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


def targets() -> list[Path]:
    repo = Path(__file__).resolve().parents[3]
    return [repo / "charts" / "slofleet" / "dashboards", repo / "manifests" / "dashboards"]


def main(argv: list[str]) -> int:
    for out in [Path(argv[0])] if argv else targets():
        out.mkdir(parents=True, exist_ok=True)
        (out / "slofleet.json").write_text(render())
        print(out / "slofleet.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
