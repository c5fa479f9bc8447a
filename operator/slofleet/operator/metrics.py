"""The operator's own Prometheus metrics (served by `slofleet operator --metrics-port`)."""
from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter("slofleet_operator_reconciles_total", "LLMService reconciles", ["trigger", "result"])
DURATION = Histogram("slofleet_operator_reconcile_duration_seconds", "time of one reconcile",
                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
CHANGES = Counter("slofleet_operator_child_changes_total", "children created, updated or deleted", ["kind", "action"])
