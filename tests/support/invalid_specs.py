"""LLMService specs the CRD must refuse, each with the message a user sees: applied to a real API server by
tests/k8s/test_validation.py, and matched against every CEL rule of the generated CRDs by
tests/operator/test_api_models.py."""
from __future__ import annotations

from slofleet.api.runtime import LIMITS

POOL = {"minReplicas": 1, "maxReplicas": 2}
SLO = {"ttftMs": 100}
PRECISE = {"policy": "precise", "resources": {"limits": {"memory": "2Gi"}}}
DISAGGREGATED = {"mode": "disaggregated", "prefill": POOL, "decode": POOL}


def runtime_message(what: str, runtime: str) -> str:
    """The message of the runtime limit on `what` (slofleet.api.runtime.LIMITS): each case below asks for it."""
    return next(lim.message(runtime) for lim in LIMITS if lim.what.startswith(what))


# (what is wrong, spec, the field kubectl names, the rule's message)
INVALID = [
    ("min above max", {"topology": {"unified": {"minReplicas": 3, "maxReplicas": 2}}},
     "spec.topology.unified",
     "minReplicas must be <= maxReplicas"),
    ("replicas out of bounds", {"topology": {"unified": {"minReplicas": 1, "maxReplicas": 2, "replicas": 5}}},
     "spec.topology.unified",
     "replicas must lie within [minReplicas, maxReplicas]"),
    ("disaggregated without decode", {"topology": {"mode": "disaggregated", "prefill": POOL}},
     "spec.topology",
     "topology.mode disaggregated needs both topology.prefill and topology.decode"),
    ("unified with a prefill pool", {"topology": {"mode": "unified", "prefill": POOL}},
     "spec.topology",
     "topology.mode unified takes no prefill/decode pools: use topology.unified or set mode: disaggregated"),
    ("percentile 100", {"buckets": [{"name": "a", "slo": {"percentile": 100, "ttftMs": 1}}]},
     "spec.buckets[0].slo",
     "slo.percentile must be > 0 and < 100, e.g. 99 for p99"),
    ("slo without targets", {"buckets": [{"name": "a", "slo": {"percentile": 99}}]},
     "spec.buckets[0].slo",
     "slo needs at least one target: ttftMs, tpotMs or e2eMs"),
    ("duplicate bucket names", {"buckets": [{"name": "a", "slo": SLO}, {"name": "a", "slo": SLO}]},
     "spec.buckets",
     "bucket names must be unique"),
    ("prompt range reversed", {"buckets": [{"name": "a", "slo": SLO,
                                            "match": {"minPromptTokens": 10, "maxPromptTokens": 5}}]},
     "spec.buckets[0].match",
     "match.minPromptTokens must be <= match.maxPromptTokens"),
    ("pvc source without a claim", {"model": {"source": "pvc"}}, "spec.model", "model.source pvc needs model.pvcName"),
    ("init source without an image", {"model": {"source": "init"}},
     "spec.model",
     "model.source init needs model.initImage and model.initCommand"),
    ("block size not a power of two", {"engine": {"blockSize": 24}}, "spec.engine", "blockSize must be a power of two"),
    ("two gpus per engine", {"engine": {"gpus": 2}}, "spec.engine",
     "engine.gpus > 1 is not supported: an engine process runs on one GPU (no tensor parallelism); use gpus: 1 and "
     "more replicas"),
    ("precise without prefix caching", {"router": PRECISE, "engine": {"enablePrefixCaching": False}}, "spec",
     "router.policy precise routes on the engines' prefix caches: it needs engine.enablePrefixCaching true"),
    ("precise with the engine on an event port", {"router": PRECISE, "engine": {"port": 5558}}, "spec",
     "router.policy precise: engine.port must not be 5557 or 5558, the engines' KV event ports"),
    ("disaggregated on vllm", {"engine": {"runtime": "vllm"}, "topology": DISAGGREGATED}, "spec",
     runtime_message("topology.mode disaggregated", "vllm")),
    ("disaggregated on llamacpp", {"engine": {"runtime": "llamacpp"}, "topology": DISAGGREGATED}, "spec",
     runtime_message("topology.mode disaggregated", "llamacpp")),
    ("precise on llamacpp", {"engine": {"runtime": "llamacpp"}, "router": PRECISE}, "spec",
     runtime_message("router.policy precise", "llamacpp")),
    ("speculation on llamacpp", {"engine": {"runtime": "llamacpp", "numSpeculativeTokens": 4}}, "spec",
     runtime_message("engine.numSpeculativeTokens", "llamacpp")),
    ("small blocks on vllm", {"engine": {"runtime": "vllm", "blockSize": 8}}, "spec",
     runtime_message("engine.blockSize", "vllm")),
    ("dtype on llamacpp", {"engine": {"runtime": "llamacpp", "dtype": "bfloat16"}}, "spec",
     runtime_message("engine.dtype", "llamacpp")),
]
# Schema (non-CEL) rules: one of each kind the CRD uses.
INVALID_SCHEMA = [
    ("unknown runtime", {"engine": {"runtime": "sglang"}},
     'spec.engine.runtime: Unsupported value: "sglang": supported values: "slofleet", "vllm", "llamacpp"'),
    ("unknown mode", {"topology": {"mode": "mixed"}},
     'spec.topology.mode: Unsupported value: "mixed": supported values: "unified", "disaggregated"'),
    ("port 0", {"engine": {"port": 0}}, "spec.engine.port: Invalid value: 0: spec.engine.port in body should be "
                                       "greater than or equal to 1"),
    ("bad bucket name", {"buckets": [{"name": "Chat!", "slo": SLO}]}, "spec.buckets[0].name: Invalid value: "
                                                                        '"Chat!": spec.buckets[0].name in body should '
                                                                        "match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
    ("bucket without slo", {"buckets": [{"name": "a"}]}, 'spec.buckets[0].slo: Required value'),
    ("replicas not a number", {"topology": {"unified": {"minReplicas": "one"}}},
     'spec.topology.unified.minReplicas: Invalid value: "string": spec.topology.unified.minReplicas in body must be '
     'of type integer: "string"'),
]
