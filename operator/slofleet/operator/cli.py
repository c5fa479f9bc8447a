"""`slofleet operator`: runs the kopf operator that reconciles LLMService resources."""
from __future__ import annotations

import argparse
import logging
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from slofleet.operator.router import DEFAULT_CLUSTER_ROLE
    from slofleet.operator.trust import AUTOSCALER_NAMESPACE

    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="namespace to watch (repeatable); default: all namespaces")
    parser.add_argument("--standalone", action="store_true",
                        help="no kopf peering: run exactly one replica (what the manifests do)")
    parser.add_argument("--peering", default="slofleet",
                        help="kopf peering object name, for several replicas with one active")
    parser.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (0: off)")
    parser.add_argument("--health-port", type=int, default=8081, help="liveness endpoint port, /healthz (0: off)")
    parser.add_argument("--resync-seconds", type=float, default=30.0, help="periodic re-reconcile of every service")
    parser.add_argument("--router-cluster-role", default=DEFAULT_CLUSTER_ROLE,
                        help="ClusterRole each LLMService's router is bound to (listing EndpointSlices)")
    parser.add_argument("--autoscaler-namespace",
                        default=os.environ.get("SLOFLEET_AUTOSCALER_NAMESPACE", AUTOSCALER_NAMESPACE),
                        help="namespace of the autoscaler, whose pods each service's NetworkPolicy lets scrape the "
                             f"engines (default: $SLOFLEET_AUTOSCALER_NAMESPACE, else {AUTOSCALER_NAMESPACE})")
    parser.add_argument("--verbose", action="store_true")


def run(args: argparse.Namespace) -> int:
    import kopf
    from prometheus_client import start_http_server

    from slofleet.operator import handlers

    handlers.register(args.resync_seconds, args.router_cluster_role, args.autoscaler_namespace)
    if args.metrics_port:
        start_http_server(args.metrics_port)

    @kopf.on.startup()
    def configure(settings: kopf.OperatorSettings, **_) -> None:
        # Progress lives in annotations: the CRD's structural status schema would prune kopf's own fields.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="slofleet.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="slofleet.dev")
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 60

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO)
    kopf.run(standalone=args.standalone, peering_name=None if args.standalone else args.peering,
             namespaces=args.namespace, clusterwide=not args.namespace,
             liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None)
    return 0
