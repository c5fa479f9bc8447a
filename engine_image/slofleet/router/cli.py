"""`slofleet router`: flags, replica discovery, and the server around the Router app."""
from __future__ import annotations

import argparse
import logging
import math
import sys
import typing
import urllib.parse
from collections.abc import Callable

from slofleet.api.contract import (
    DECODE,
    KV_EVENTS_PORT,
    KV_REPLAY_PORT,
    PREFILL,
    REPLICA_HEADER,
    ROLE_LABEL,
    RUNTIMES,
    SERVICE_LABEL,
    UNIFIED,
    zmq_problem,
)

if typing.TYPE_CHECKING:
    from .kv_index import Precise
    from .proxy import Router, RouterConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for add in (add_endpoints, add_gateway, add_routing, add_timeouts, add_process):
        add(parser)


def add_endpoints(parser: argparse.ArgumentParser) -> None:
    """Where the router listens, and where its replicas are."""
    from slofleet.api.v1alpha1 import Router as Spec

    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=Spec.model_fields["port"].default, help="port to listen on")
    parser.add_argument("--upstream", action="append", default=[], metavar="URL",
                        help="a unified engine replica, e.g. http://127.0.0.1:8000 (repeat for several)")
    parser.add_argument("--prefill-upstream", action="append", default=[], metavar="URL",
                        help="a prefill engine replica (slofleet serve --role prefill; repeatable)")
    parser.add_argument("--decode-upstream", action="append", default=[], metavar="URL",
                        help="a decode engine replica (slofleet serve --role decode; repeatable)")
    parser.add_argument("--k8s-service", metavar="[NAMESPACE/]NAME",
                        help="discover replicas from this Service's EndpointSlices instead of --upstream")
    parser.add_argument("--k8s-llmservice", metavar="[NAMESPACE/]NAME",
                        help="discover every role's replicas of this LLMService (the operator's Services, by their "
                             f"{SERVICE_LABEL} and {ROLE_LABEL} labels)")
    parser.add_argument("--k8s-port-name", default=None, help="EndpointSlice port name to use (default: the first)")


def add_gateway(parser: argparse.ArgumentParser) -> None:
    """Keys, quotas, size limits and admission."""
    from .proxy import RouterConfig as Cfg  # the defaults live there (and in the resource), not in the flags

    parser.add_argument("--buckets", metavar="FILE",
                        help="YAML/JSON bucket rules: a list, {buckets: [...]}, or an LLMService/SLOPolicy; re-read "
                             "within seconds of a change")
    parser.add_argument("--api-keys-file", metavar="FILE", help="API keys, one a line (a mounted Secret works)")
    parser.add_argument("--api-keys-env", default="SLOFLEET_API_KEYS",
                        help="environment variable with comma-separated API keys")
    parser.add_argument("--rpm", type=float, default=0.0, help="default requests per minute per key (0: unlimited)")
    parser.add_argument("--tpm", type=float, default=0.0, help="default tokens per minute per key (0: unlimited)")
    parser.add_argument("--max-model-len", type=int, default=Cfg.max_model_len,
                        help="the engines' context length until a replica lists its own in /v1/models: a request "
                             "without max_tokens is charged to its key's quota for what the engine may generate")
    parser.add_argument("--max-body-bytes", type=int, default=Cfg.max_body_bytes, help="larger request bodies get 413")
    parser.add_argument("--max-prompt-tokens", type=int, default=Cfg.max_prompt_tokens,
                        help="longer prompts (estimated) get 413")
    parser.add_argument("--chars-per-token", type=float, default=4.0, help="prompt-token estimate without a tokenizer")
    parser.add_argument("--capacity-per-replica", type=int, default=Cfg.capacity_per_replica,
                        help="in-flight requests per ready replica; beyond a bucket's share of it, it is shed")
    parser.add_argument("--min-shed-share", type=float, default=0.5,
                        help="share of the capacity the least critical priority may use (the most critical: all)")
    add_admission(parser)


def add_admission(parser: argparse.ArgumentParser) -> None:
    """SLO-predicted admission's priors (predict.Rates holds the defaults): what a replica is assumed to do until
    the router has measured it."""
    from .predict import Rates

    prior = Rates()
    parser.add_argument("--admit-prefill-tps", type=float, default=prior.prefill_tps,
                        help="slo-predicted admission: prompt tokens/s a replica prefills until measured")
    parser.add_argument("--admit-step-ms", type=float, default=prior.step_s * 1000,
                        help="slo-predicted admission: a replica's decode step until measured")
    parser.add_argument("--admit-headroom", type=float, default=prior.headroom,
                        help="slo-predicted admission: the share of a TTFT target a predicted (mean) wait may fill")


def add_routing(parser: argparse.ArgumentParser) -> None:
    """Replica choice: the policy, prefix affinity, retries and the prefill hand-off."""
    from slofleet.api.v1alpha1 import Router as Spec

    from .proxy import RouterConfig as Cfg  # the defaults live there (and in the resource), not in the flags

    parser.add_argument("--runtime", default=Cfg.runtime, choices=RUNTIMES,
                        help="the server behind the router (spec.engine.runtime): its readiness path and metric names; "
                             "vllm and slofleet get each request's bucket priority in the body's `priority`, "
                             "llamacpp does not")
    parser.add_argument("--policy", default=Spec.model_fields["policy"].default,
                        choices=typing.get_args(Spec.model_fields["policy"].annotation))
    parser.add_argument("--model", default=None,
                        help="--policy precise: the engines' --model, for its tokenizer, chat template and fingerprint")
    parser.add_argument("--kv-events-endpoint", default=f"tcp://{{host}}:{KV_EVENTS_PORT}", metavar="TEMPLATE",
                        help="--policy precise: each replica's KV event publisher ({host}: the replica's)")
    parser.add_argument("--kv-events-replay-endpoint", default=f"tcp://{{host}}:{KV_REPLAY_PORT}", metavar="TEMPLATE",
                        help="--policy precise: each replica's replay socket, to fill gaps (empty: none)")
    parser.add_argument("--prefix-index-blocks", type=int, default=1_000_000,
                        help="--policy precise: (replica, block) entries the index holds at most")
    parser.add_argument("--affinity-chars", type=int, default=Cfg.affinity_chars,
                        help="leading prompt characters hashed for prefix affinity")
    parser.add_argument("--load-factor", type=float, default=1.25,
                        help="bounded load: a replica takes at most this times the mean load")
    parser.add_argument("--max-attempts", type=int, default=Cfg.max_attempts,
                        help="replicas tried before the first byte")
    parser.add_argument("--prefill-threshold-tokens", type=int, default=Cfg.prefill_threshold_tokens,
                        help="prompts of at least this many (estimated) tokens are prefilled on a prefill replica "
                             "and handed to a decode replica; shorter ones go straight to a decode replica")


def add_timeouts(parser: argparse.ArgumentParser) -> None:
    """Timeouts, connection limits and shutdown."""
    from .proxy import RouterConfig as Cfg  # the defaults live there (and in the resource), not in the flags

    parser.add_argument("--hold-timeout-seconds", type=float, default=Cfg.hold_timeout,
                        help="while no replica is ready, hold requests this long for one (scale from zero), "
                             "then answer 503")
    parser.add_argument("--upstream-ttfb-timeout", type=float, default=Cfg.ttfb_timeout,
                        help="seconds for replicas (over all tries) to send a request's first token, then 504")
    parser.add_argument("--upstream-idle-timeout", type=float, default=Cfg.idle_timeout,
                        help="seconds a started answer may go without a byte, then it ends with an SSE error event")
    parser.add_argument("--body-timeout", type=float, default=Cfg.body_timeout,
                        help="seconds a client has to send its request body, then 408")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a client has to send a request's line and headers, then the connection closes")
    parser.add_argument("--max-header-bytes", type=int, default=64 << 10,
                        help="larger request heads close the connection")
    parser.add_argument("--keep-alive-timeout", type=int, default=5,
                        help="seconds an idle kept-alive client connection stays open")
    parser.add_argument("--health-interval", type=float, default=1.0, help="seconds between replica probes")
    parser.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds open streams get to finish after SIGTERM, past the drain delay")
    parser.add_argument("--drain-delay", type=float, default=2.0,
                        help="seconds after SIGTERM that /ready and new requests answer 503 before the listener "
                             "closes, so load balancers stop sending first")


def add_process(parser: argparse.ArgumentParser) -> None:
    """Answers, traces, workers and logs."""
    from .proxy import RouterConfig as Cfg  # the defaults live there (and in the resource), not in the flags

    parser.add_argument("--replica-header", action="store_true", help=f"answer with {REPLICA_HEADER}")
    parser.add_argument("--otlp-traces-endpoint", default=Cfg.otlp_traces_endpoint, metavar="URL",
                        help="send request traces by OTLP/HTTP to this URL (http://collector:4318 gets /v1/traces); "
                             "the last traces are kept in memory either way, at GET /debug/traces")
    parser.add_argument("--workers", type=int, default=1,
                        help="router processes sharing the port (SO_REUSEPORT); quotas, admission and metrics are "
                             "per worker (server.py)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


# flag -> (least, most, whether the least itself is refused): the numbers no setting makes sense outside of
BOUNDS = {"port": (1, 65535, False), "capacity_per_replica": (1, None, False), "workers": (1, None, False),
          "max_body_bytes": (1, None, False), "max_prompt_tokens": (1, None, False), "max_attempts": (1, None, False),
          "max_model_len": (1, None, False), "max_header_bytes": (1, None, False),
          "prefix_index_blocks": (1, None, False), "affinity_chars": (1, None, False),
          "keep_alive_timeout": (0, None, False), "prefill_threshold_tokens": (0, None, False), "rpm": (0, None, False),
          "tpm": (0, None, False), "hold_timeout_seconds": (0, None, False), "grace_period": (0, None, False),
          "drain_delay": (0, None, False), "load_factor": (1, None, False), "upstream_ttfb_timeout": (0, None, True),
          "upstream_idle_timeout": (0, None, True), "body_timeout": (0, None, True), "header_timeout": (0, None, True),
          "health_interval": (0, None, True), "chars_per_token": (0, None, True), "min_shed_share": (0, 1, True),
          "admit_prefill_tps": (0, None, True), "admit_step_ms": (0, None, False), "admit_headroom": (0, 1, True)}


def problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, in one line, or None."""
    for name, (least, most, above) in BOUNDS.items():
        value, flag = getattr(args, name), "--" + name.replace("_", "-")
        if not math.isfinite(value) or (value <= least if above else value < least):
            return f"{flag} must be {'above' if above else 'at least'} {least}, got {value:g}"
        if most is not None and value > most:
            return f"{flag} must be at most {most}, got {value:g}"
    for flag, template in (("--kv-events-endpoint", args.kv_events_endpoint),
                           ("--kv-events-replay-endpoint", args.kv_events_replay_endpoint)):
        if args.policy == "precise" and template and ("{host}" not in template or zmq_problem(
                flag, template.replace("{host}", "engine"))):
            return f"{flag} must be a ZMQ address template with {{host}}, e.g. tcp://{{host}}:5557, got {template!r}"
    for url in args.upstream + args.prefill_upstream + args.decode_upstream:
        try:
            u = urllib.parse.urlsplit(url)
            ok = u.scheme == "http" and bool(u.hostname) and (u.port is None or 0 < u.port) and u.path in ("", "/")
        except ValueError:
            ok = False
        if not ok:
            return f"an upstream must be http://HOST[:PORT] (engines serve plain HTTP), got {url!r}"
    return None


class Usage(Exception):
    """A setting the router cannot start with: one line for stderr, exit code 2."""


def run(args: argparse.Namespace) -> int:
    from .server import fork_workers, listen_socket, serve

    try:
        if wrong := problem(args):
            raise Usage(wrong)
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if args.workers > 1 and (rc := fork_workers(args.workers)) is not None:
            return rc  # the parent, once its workers ended; each worker goes on below to build its own router
        app = router(args)
        try:
            sock = listen_socket(args.host, args.port, reuse_port=args.workers > 1)
        except OSError as e:
            raise Usage(f"cannot listen on {args.host}:{args.port}: {e}") from None
    except Usage as e:
        print(f"slofleet router: {e}", file=sys.stderr)
        return 2
    serve(app, sock, head_timeout=args.header_timeout, max_head_bytes=args.max_header_bytes,
          keep_alive=args.keep_alive_timeout, drain_delay=args.drain_delay, grace_period=args.grace_period)
    return 0


def router(args: argparse.Namespace) -> Router:
    """The Router app the flags describe (raises Usage)."""
    from .balancer import Balancer
    from .buckets import DEFAULT_BUCKETS, Classifier, load_buckets
    from .gateway import KeyStore, Quotas
    from .predict import Predictor, Rates
    from .proxy import Router
    from .replicas import ReplicaSet

    static = {**{u: UNIFIED for u in args.upstream}, **{u: PREFILL for u in args.prefill_upstream},
              **{u: DECODE for u in args.decode_upstream}}
    if sum(map(bool, (static, args.k8s_service, args.k8s_llmservice))) != 1:
        raise Usage("give either --upstream/--prefill-upstream/--decode-upstream (repeatable), --k8s-service or "
                    "--k8s-llmservice")
    try:
        buckets = load_buckets(args.buckets) if args.buckets else DEFAULT_BUCKETS
        keys = KeyStore(args.api_keys_file, args.api_keys_env, args.rpm, args.tpm)
    except (OSError, ValueError) as e:
        raise Usage(str(e)) from None
    replicas = ReplicaSet(static=static, lister=lister(args), interval=args.health_interval, runtime=args.runtime)
    rates = Rates(prefill_tps=args.admit_prefill_tps, step_s=args.admit_step_ms / 1000, headroom=args.admit_headroom)
    classifier = Classifier(buckets, args.chars_per_token, args.min_shed_share, args.buckets, Predictor(rates))
    return Router(config(args), replicas, classifier, keys, Quotas(),
                  Balancer(args.policy, args.load_factor, precise=precise(args)))


def lister(args: argparse.Namespace) -> Callable[[], dict[str, str]] | None:
    """Replica discovery from Kubernetes, or None for the static --upstream lists."""
    from .replicas import kubernetes_lister, llmservice_selector, service_selector

    if not (args.k8s_service or args.k8s_llmservice):
        return None
    namespace, _, name = (args.k8s_service or args.k8s_llmservice).rpartition("/")
    selector = service_selector(name) if args.k8s_service else llmservice_selector(name)
    return kubernetes_lister(namespace, selector, args.k8s_port_name)


def config(args: argparse.Namespace) -> RouterConfig:
    from .proxy import RouterConfig

    return RouterConfig(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        capacity_per_replica=args.capacity_per_replica, max_attempts=args.max_attempts,
                        affinity_chars=args.affinity_chars, replica_header=args.replica_header,
                        prefill_threshold_tokens=args.prefill_threshold_tokens, hold_timeout=args.hold_timeout_seconds,
                        ttfb_timeout=args.upstream_ttfb_timeout, idle_timeout=args.upstream_idle_timeout,
                        body_timeout=args.body_timeout, max_model_len=args.max_model_len,
                        otlp_traces_endpoint=args.otlp_traces_endpoint, runtime=args.runtime)


def precise(args: argparse.Namespace) -> Precise | None:
    """--policy precise's index of the replicas' KV blocks, or None for the other policies."""
    if args.policy != "precise":
        return None
    if not args.model:
        raise Usage("--policy precise needs --model (the engines' own)")
    from .kv_index import Precise

    try:
        return Precise(args.model, args.kv_events_endpoint, args.kv_events_replay_endpoint, args.prefix_index_blocks)
    except (OSError, ValueError) as e:
        raise Usage(f"--policy precise: {e}") from None
