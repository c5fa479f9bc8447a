"""The LLMService's status as the operator and the autoscaler write it (slofleet.dev/v1alpha1; the resource's
module, v1alpha1.py, re-exports these)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from slofleet.api.admission import Admission
from slofleet.api.base import Model as _Model


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class RoleAutoscaling(_Model):
    """Written by the autoscaler only (its own field manager); the operator reads and clamps it."""
    desired_replicas: int | None = Field(None, ge=0)
    reason: str | None = None
    time: str | None = Field(None, description="when this decision was made (RFC 3339)")
    condition: Literal["Ok", "MetricsStale", "Stabilizing", "Draining", "ScalingLimited"] | None = Field(
        None, description="MetricsStale: no fresh metrics, the last decision is held; the others explain a hold or "
        "a bound")


class RoleStatus(_Model):
    replicas: int = 0
    ready_replicas: int = 0
    desired_replicas: int = 0


class BucketStatus(_Model):
    """Written by the autoscaler only (its own field manager): one bucket's requests that finished in the last
    `windowSeconds`, from the engines' latency histograms (interpolated inside a histogram bucket, as Prometheus'
    histogram_quantile does). Latencies are given for the targets the bucket sets."""
    name: str
    window_seconds: int = Field(0, ge=0, description="the window the figures cover, ending at `time`")
    requests: int = Field(0, ge=0, description="requests of this bucket that finished in the window")
    attainment: float | None = Field(None, ge=0, le=1, description="fraction of requests within all targets (with "
                                     "several targets: within the one fewest met, as the engines' per-target "
                                     "histograms cannot tell which requests missed several); absent without requests")
    percentile: float = Field(99.0, description="the bucket's slo.percentile, at which the latencies are read")
    ttft_ms: float | None = Field(None, description="time to first token at the percentile")
    tpot_ms: float | None = Field(None, description="time per output token at the percentile (from the engines' "
                                  "inter-token latency, so counted per token, not per request)")
    e2e_ms: float | None = Field(None, description="whole-request latency at the percentile")
    met: bool | None = Field(None, description="attainment reaches the percentile, i.e. every target holds at it; "
                             "absent without requests")
    dominant: Literal["queue", "prefill", "decode", "outside_model", "kv"] | None = Field(
        None, description="when not met: the phase holding most of the least-met clock (slofleet diagnose's rule)")
    time: str | None = Field(None, description="when these figures were read (RFC 3339)")
    admitted: int | None = Field(None, ge=0, description="requests the routers admitted in the window")
    refused: dict[str, int] = Field({}, description="requests the routers refused at admission in the window (429), "
                                    "by reason: the demand beyond what was admitted")


class BucketAdmission(Admission):
    """A bucket's admission limits as each router replica enforces them."""
    name: str


class LLMServiceStatus(_Model):
    observed_generation: int | None = None
    endpoint: str | None = None
    conditions: list[Condition] = Field([])
    roles: dict[str, RoleStatus] = Field({})
    autoscaling: dict[str, RoleAutoscaling] = Field({})
    buckets: list[BucketStatus] = Field([], description="written by the autoscaler only, for every LLMService")
    attainment: float | None = Field(None, description="the lowest attainment in `buckets` (written with them), "
                                     "shown by `kubectl get llms`")
    router_admission: list[BucketAdmission] = Field([], description="each bucket's admission limits divided among "
                                                     "the router replicas (at least 1 where a limit is set): what "
                                                     "each router enforces")
