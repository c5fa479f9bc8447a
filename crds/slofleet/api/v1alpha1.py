"""slofleet.dev/v1alpha1: the LLMService and SLOPolicy custom resources as pydantic models.

These models are the single source of the CRD schemas (`python -m slofleet.api.crd` writes `crds/*.yaml`)
and the operator, autoscaler and router parse resources with them. CEL rules live beside the fields they
check, as `x-kubernetes-validations`, each with a message that says what to change.

Versioning: v1alpha1 is the only served and stored version. A later v1beta1 will be added beside it as a
new module; while the change is purely additive the CRD can list both versions with `conversion: None`, and
once a field moves or is renamed a conversion webhook (run by the operator) translates between them, with
v1alpha1 kept served-but-not-stored for one release so `kubectl get` of old objects keeps working.
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from slofleet.api.admission import ADMISSION_MODES, Admission  # noqa: F401 (ADMISSION_MODES re-exported)
from slofleet.api.base import Model as _Model
from slofleet.api.base import (
    Resources,
    to_camel,  # noqa: F401 (re-exported)
)
from slofleet.api.base import rules as _rules
from slofleet.api.contract import (  # noqa: F401 (ROLES re-exported)
    DEFAULT_ENGINE_PORT,
    DEFAULT_GRACE_SECONDS,
    ENGINE_SETTINGS,
    ROLES,
    RUNTIMES,
)
from slofleet.api.network import Network
from slofleet.api.router import Router, RouterAuth  # noqa: F401 (RouterAuth re-exported)
from slofleet.api.runtime import RUNTIME_HELP, image_help, refuse, spec_rules
from slofleet.api.status import (  # noqa: F401 (the status models re-exported)
    BucketAdmission,
    BucketStatus,
    Condition,
    LLMServiceStatus,
    RoleAutoscaling,
    RoleStatus,
)

GROUP = "slofleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"


class ModelSource(_Model):
    """Which weights to serve. `embedded` ships inside the image; `pvc` mounts a claim; `init` runs an
    init container that downloads into a shared emptyDir."""
    name: str = Field("default", description="model name passed to `slofleet serve --model`; 'default' is the "
                      "embedded SmolLM2-135M-Instruct")
    source: Literal["embedded", "pvc", "init"] = Field("embedded", description="where the weights come from")
    pvc_name: str | None = Field(None, description="PersistentVolumeClaim holding the weights (source: pvc)")
    path: str = Field("/models", description="mount path of the weights volume (source: pvc or init)")
    init_image: str | None = Field(None, description="image of the init container that fetches the weights "
                                   "(source: init)")
    init_command: list[str] | None = Field(None, description="command of that init container; it writes under `path`")
    served_name: str | None = Field(None, min_length=1, max_length=253, pattern=r"^[^,\s]+$",
                                    description="the name requests give as `model` (the first /v1/models lists); "
                                    "default: the LLMService's name. Engines also answer to the weights' own name")
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.source != 'pvc' || has(self.pvcName)", "model.source pvc needs model.pvcName"),
        ("self.source != 'init' || (has(self.initImage) && has(self.initCommand))",
         "model.source init needs model.initImage and model.initCommand"),
    ))


def engine_field(name: str):
    """A `slofleet serve` setting as a CRD field: the engine's default and rule (slofleet.api.contract)."""
    s = ENGINE_SETTINGS[name]
    bounds = {"ge": s.minimum, "le": s.maximum, "gt": 0 if s.positive else None}
    return Field(s.default, description=s.help, **{k: v for k, v in bounds.items() if v is not None})


GPUS_MESSAGE = ("engine.gpus > 1 is not supported: an engine process runs on one GPU (no tensor parallelism); "
                "use gpus: 1 and more replicas")


def _engine_rules() -> dict:
    """CEL for the rules a JSON schema cannot say (a power of two), over the shared settings."""
    pairs = [("self.gpus <= 1", GPUS_MESSAGE)]
    for name, s in ENGINE_SETTINGS.items():
        if s.power_of_two:
            powers = [2 ** i for i in range(int(s.maximum).bit_length()) if 2 ** i <= s.maximum]
            pairs.append((f"self.{to_camel(name)} in {powers}", f"{to_camel(name)} must be a power of two"))
    return _rules(*pairs)


class Engine(_Model):
    """How each engine pod runs: image, resources and the `slofleet serve` batching/KV settings. The operator
    passes every shared setting as its flag, then `args` as given."""
    runtime: Literal[RUNTIMES] = Field(RUNTIMES[0], description=RUNTIME_HELP)
    image: str | None = Field(None, description=image_help())
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    port: int = Field(DEFAULT_ENGINE_PORT, ge=1, le=65535,
                      description="HTTP port of the OpenAI API, /health, /ready, /metrics")
    resources: Resources = Field({})
    gpus: int = Field(0, ge=0, le=16, description="GPUs per pod (nvidia.com/gpu): 0 or 1 (an engine uses one); 1 "
                      "adds GPU tolerations")
    dtype: Literal["auto", "float32", "bfloat16"] = engine_field("dtype")
    block_size: int = engine_field("block_size")
    kv_cache_memory_gb: float = engine_field("kv_cache_memory_gb")
    max_num_seqs: int = engine_field("max_num_seqs")
    max_num_batched_tokens: int = engine_field("max_num_batched_tokens")
    max_model_len: int = engine_field("max_model_len")
    enable_prefix_caching: bool = engine_field("enable_prefix_caching")
    max_waiting_requests: int = engine_field("max_waiting_requests")
    max_queued_tokens: int = engine_field("max_queued_tokens")
    num_speculative_tokens: int = engine_field("num_speculative_tokens")
    speculative_ngram: int = engine_field("speculative_ngram")
    startup_seconds: int = Field(300, ge=10, description="how long model loading may take before liveness applies "
                                 "(to the router too, which loads the model under router.policy precise)")
    drain_seconds: int = Field(DEFAULT_GRACE_SECONDS, ge=1,
                               description="on SIGTERM (a rollout, an eviction), in-flight requests get this long to "
                               "finish; the autoscaler scales down only when typical requests fit in it. A scale-down "
                               "drains a pod before removing it, however long its requests run")
    price_per_hour: float = Field(0.0, ge=0, description="what one engine pod costs per hour (any currency), for "
                                  "the cost counters per bucket")
    env: dict[str, str] = Field({}, description="extra environment for the engine container")
    args: list[str] = Field([], max_length=64, description="extra `slofleet serve` flags for settings this "
                            "schema does not name, e.g. ['--seed', '7']; passed after the generated ones")
    model_config = ConfigDict(json_schema_extra=_engine_rules())

    @model_validator(mode="after")
    def _shared_rules(self) -> Engine:
        problems = [s.problem(name, getattr(self, name)) for name, s in ENGINE_SETTINGS.items()]
        problems.append(GPUS_MESSAGE if self.gpus > 1 else None)
        if any(problems):
            raise ValueError("; ".join(p for p in problems if p))
        return self


MIN_MAX, WITHIN = "minReplicas must be <= maxReplicas", "replicas must lie within [minReplicas, maxReplicas]"


class Pool(_Model):
    """Replica bounds of one role. With autoscaling on, the autoscaler's decision is clamped to them;
    with it off, `replicas` (or `minReplicas`) is the count."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=0)
    replicas: int | None = Field(None, ge=0, description="fixed count when autoscaling is off")
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.minReplicas <= self.maxReplicas", MIN_MAX),
        ("!has(self.replicas) || (self.replicas >= self.minReplicas && self.replicas <= self.maxReplicas)", WITHIN),
    ))

    @model_validator(mode="after")
    def _bounds(self) -> Pool:
        # the CEL rules above, for a spec the API server never sees (slofleet simulate --llmservice FILE)
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_MAX)
        if self.replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(WITHIN)
        return self


class Topology(_Model):
    mode: Literal["unified", "disaggregated"] = "unified"
    unified: Pool | None = Field(None, description="the pool of mode unified")
    prefill: Pool | None = Field(None, description="the prefill pool of mode disaggregated")
    decode: Pool | None = Field(None, description="the decode pool of mode disaggregated")
    prefill_threshold_tokens: int = Field(512, ge=0, description="mode disaggregated: the router prefills prompts of "
                                          "at least this many tokens on a prefill replica and hands their KV to a "
                                          "decode replica; shorter prompts go straight to a decode replica")
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.mode != 'disaggregated' || (has(self.prefill) && has(self.decode))",
         "topology.mode disaggregated needs both topology.prefill and topology.decode"),
        ("self.mode != 'unified' || (!has(self.prefill) && !has(self.decode))",
         "topology.mode unified takes no prefill/decode pools: use topology.unified or set mode: disaggregated"),
    ))

    def pools(self) -> dict[str, Pool]:
        """role -> pool; a unified topology without an explicit pool gets the default bounds."""
        if self.mode == "unified":
            return {"unified": self.unified or Pool()}
        return {"prefill": self.prefill or Pool(), "decode": self.decode or Pool()}


class Match(_Model):
    """How a request falls into a bucket; all given conditions must hold. No condition: the catch-all."""
    min_prompt_tokens: int | None = Field(None, ge=0)
    max_prompt_tokens: int | None = Field(None, ge=0)
    max_output_tokens: int | None = Field(None, ge=0, description="the request's max_tokens is at most this")
    header: dict[str, str] | None = Field(None, description="request headers that must equal these values")
    route: str | None = Field(None, description="URL path prefix, e.g. /v1/chat/completions")
    tools: bool | None = Field(None, description="true: only requests that send tools; false: only those without")
    structured: bool | None = Field(None, description="true: only requests that ask for a structured output "
                                    "(response_format json, structured_outputs, guided_*); false: only others")
    model_config = ConfigDict(json_schema_extra=_rules(
        ("!has(self.minPromptTokens) || !has(self.maxPromptTokens) || self.minPromptTokens <= self.maxPromptTokens",
         "match.minPromptTokens must be <= match.maxPromptTokens"),
    ))


PERCENTILE, A_TARGET = ("slo.percentile must be > 0 and < 100, e.g. 99 for p99",
                        "slo needs at least one target: ttftMs, tpotMs or e2eMs")


class SLO(_Model):
    """Latency targets of a bucket, met when the given percentile of requests is under each target."""
    percentile: float = Field(99.0, description="e.g. 99 for p99")
    ttft_ms: int | None = Field(None, gt=0, description="time to first token")
    tpot_ms: int | None = Field(None, gt=0, description="time per output token")
    e2e_ms: int | None = Field(None, gt=0, description="whole request")
    model_config = ConfigDict(json_schema_extra=_rules(
        ("self.percentile > 0.0 && self.percentile < 100.0", PERCENTILE),
        ("has(self.ttftMs) || has(self.tpotMs) || has(self.e2eMs)", A_TARGET),
    ))

    @model_validator(mode="after")
    def _targets(self) -> SLO:
        # the CEL rules above, for buckets the API server never sees (a router's, a benchmark's or a preview's file)
        if not 0 < self.percentile < 100:
            raise ValueError(PERCENTILE)
        if self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None:
            raise ValueError(A_TARGET)
        return self


class Bucket(_Model):
    name: str = Field(..., min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    priority: int = Field(0, ge=0, le=100, description="lower runs first")
    match: Match = Field({})
    slo: SLO
    admission: Admission = Field({})

    def admission_mode(self) -> str:
        return self.admission.in_force(self.slo)


def _unique_buckets() -> dict:
    return _rules(("self.all(b, self.exists_one(c, c.name == b.name))", "bucket names must be unique"))


SIGNALS = ("slo", "queue", "kvCache")


class Autoscaling(_Model):
    """Whether and how the autoscaler moves replicas between each pool's bounds."""
    enabled: bool = Field(False, description="off: the pools run their fixed `replicas` (status.buckets is written "
                          "either way)")
    signals: list[Literal[SIGNALS]] = Field(list(SIGNALS), max_length=3, description="what adds replicas beside the "
                                            "arrival-rate forecast: slo (a bucket's attainment below its percentile), "
                                            "queue (waiting requests per replica), kvCache (KV usage over "
                                            "targetKvCacheUsage, or preemptions)")
    interval_seconds: int = Field(15, ge=1, le=3600, description="seconds between decisions")
    scale_up_stabilization_seconds: int = Field(0, ge=0, le=3600, description="scale up only to the lowest "
                                                "recommendation of this window (0: at once)")
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=3600, description="scale down only to the highest "
                                                  "recommendation of this window")
    target_kv_cache_usage: float = Field(0.8, gt=0, le=1, description="KV usage above which the kvCache signal adds "
                                         "replicas, and that a scale-down must not push the remaining ones over")


class LLMServiceSpec(_Model):
    model: ModelSource = Field({})
    engine: Engine = Field({})
    topology: Topology = Field({})
    policy_ref: str | None = Field(None, description="name of an SLOPolicy in the namespace whose buckets apply "
                                   "when `buckets` is empty")
    buckets: list[Bucket] = Field([], max_length=32, json_schema_extra=_unique_buckets())
    autoscaling: Autoscaling = Field({})
    router: Router = Field({})
    network: Network = Field({})
    model_config = ConfigDict(json_schema_extra=spec_rules())

    @model_validator(mode="after")
    def _runtime_limits(self) -> LLMServiceSpec:
        return refuse(self)  # the runtimes' CEL rules, for a spec the API server never sees


class SLOPolicySpec(_Model):
    """Buckets shared by several LLMServices (referenced by `spec.policyRef`)."""
    buckets: list[Bucket] = Field(..., min_length=1, max_length=32, json_schema_extra=_unique_buckets())


class LLMService(_Model):
    api_version: str = API_VERSION
    kind: str = "LLMService"
    metadata: dict = Field({})
    spec: LLMServiceSpec = Field({})
    status: LLMServiceStatus = Field({})


class SLOPolicy(_Model):
    api_version: str = API_VERSION
    kind: str = "SLOPolicy"
    metadata: dict = Field({})
    spec: SLOPolicySpec
