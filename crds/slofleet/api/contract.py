"""What the components share on the wire and in the cluster: roles, header names, label keys, the error body,
Kubernetes client setup, time stamps, and the Prometheus text the router and autoscaler read.

Standard library only, so the engine (which imports nothing else of `slofleet.api`) may import it too. A name
here changes only with every side at once."""
from __future__ import annotations

import dataclasses
import datetime
import math
from dataclasses import dataclass
from typing import NamedTuple

# -- roles ---------------------------------------------------------------------------------------------------
UNIFIED, PREFILL, DECODE, ROUTER = "unified", "prefill", "decode", "router"
ROLES = (UNIFIED, PREFILL, DECODE)  # the engine roles: `slofleet serve --role`, one pool each

# -- request defaults ----------------------------------------------------------------------------------------
DEFAULT_BUCKET = "default"  # the bucket of a request no rule matches, and of one sent without BUCKET_HEADER
# What /v1/completions generates without max_tokens (OpenAI's default): the engine generates it, the router charges
# quotas for it.
COMPLETIONS_MAX_TOKENS = 16

# -- HTTP headers --------------------------------------------------------------------------------------------
BUCKET_HEADER = "x-slofleet-bucket"  # the request's bucket, set by the router (or a client calling an engine)
PREFILL_HEADER = "x-slofleet-prefill-url"  # router -> decode engine: pull this prompt's KV from that prefill engine
# router -> engine: the request's bucket's TPOT target in ms, which bounds the prompt work of the steps it decodes in
# (so a bucket's SLO edit reaches the engines without rolling them); honoured from the internal token's holders only
TPOT_HEADER = "x-slofleet-tpot-ms"
REPLICA_HEADER = "x-slofleet-replica"  # router -> client (debugging): which replica answered
# The per-LLMService internal token (a Secret the operator creates): the router and the engines read it from this
# environment variable, and every router -> engine and engine -> engine request carries it as
# `Authorization: Bearer <token>`. Engines refuse /v1/* without it when it is set.
INTERNAL_TOKEN_ENV = "SLOFLEET_INTERNAL_TOKEN"
INTERNAL_TOKEN_KEY = "token"  # the key of that Secret's data
KV_MAC_HEADER = "x-slofleet-kv-mac"  # prefill engine -> decode engine: HMAC-SHA256 of the KV payload by the token
# Tracing: every response carries REQUEST_ID_HEADER (a client's own, when well-formed, else a new one), passed on
# router -> engine -> prefill peer with the W3C trace context (traceparent, tracestate: OpenTelemetry's propagator);
# an engine's answer names its KV hand-off time in SERVER_TIMING_HEADER (`kv_handoff;dur=MS`) for the router's metrics.
REQUEST_ID_HEADER = "x-request-id"
SERVER_TIMING_HEADER = "server-timing"

# -- engine runtimes (spec.engine.runtime) --------------------------------------------------------------------
SLOFLEET, VLLM, LLAMACPP = "slofleet", "vllm", "llamacpp"
RUNTIMES = (SLOFLEET, VLLM, LLAMACPP)  # the first is the default
# Runtimes that order their waiting queue by the body's `priority` (lower first, as bucket priorities): the router
# sends each request's bucket priority to these only (`slofleet router --runtime`; vLLM orders by it only when
# started with --scheduling-policy priority, as the operator starts it, and otherwise ignores it).
PRIORITY_RUNTIMES = (SLOFLEET, VLLM)
# What the router probes to know a replica serves: slofleet's /ready (503 while draining); vLLM has no readiness
# endpoint (its /health answers once the engine is up) and llama-server's /health is 503 until its model is loaded.
READY_PATH = {SLOFLEET: "/ready", VLLM: "/health", LLAMACPP: "/health"}


# -- labels and annotations ----------------------------------------------------------------------------------
SERVICE_LABEL = "slofleet.dev/service"  # on every child of an LLMService: its name
RUNTIME_LABEL = "slofleet.dev/runtime"  # on engine pods: which server runs in them (one of RUNTIMES)
ROLE_LABEL = "slofleet.dev/role"  # on engine and router pods and Services: one of ROLES, or ROUTER
MANAGED_BY = {"app.kubernetes.io/managed-by": "slofleet-operator"}

# -- metric names the router and autoscaler read from an engine's /metrics -----------------------------------
NUM_RUNNING = "vllm:num_requests_running"
NUM_WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
QUEUED_PROMPT_TOKENS = "slofleet:queued_prompt_tokens"
PREEMPTIONS = "vllm:num_preemptions"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
ROUTER_HELD = "slofleet:router_held_requests"  # the router's requests held while a role has no ready replica
# the router's admission, per bucket (counters, exposed with `_total`): admitted by mode, refused by reason
ROUTER_ADMITTED = "slofleet:router_admitted"
ROUTER_REFUSED = "slofleet:router_refused"

# -- the router's SLO clocks: per bucket, whatever runtime serves behind it (the status, autoscaler, diagnose and
# dashboard read these, so they work for every runtime) ---------------------------------------------------------
ROUTER_TTFT = "slofleet:router_time_to_first_token_seconds"  # arrival to the first token relayed
ROUTER_TPOT = "slofleet:router_time_per_output_token_seconds"  # first token to the last, per token after the first
ROUTER_E2E = "slofleet:router_e2e_request_latency_seconds"  # arrival to the last byte relayed
ROUTER_PHASE = "slofleet:router_phase_seconds"  # label `phase`: the router's own phases (router/metrics.py PHASES)
ROUTER_SLO = "slofleet:router_slo_requests"  # counter, labels bucket and `met` (true/false): judged by every target


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeMetrics:
    """One runtime's /metrics names for what the control plane reads (counters by their base name, exposed with
    `_total`); None where the runtime exports nothing of the kind, so that a reader says "not exported by RUNTIME"
    rather than guessing. The histograms are per request, in seconds; none carries a bucket label (the router's
    clocks do)."""
    running: str | None  # gauge: requests in the running batch
    waiting: str | None  # gauge: requests queued inside the engine
    kv_usage: str | None  # gauge: fraction of the KV cache in use, 0-1
    preemptions: str | None  # counter
    prompt_tokens: str | None  # counter
    generation_tokens: str | None  # counter
    finished: str | None  # counter: requests that ended
    queue: str | None  # histogram: arrival to first scheduled (the "queue" phase)
    prefill: str | None  # histogram: first scheduled to first token (the "prefill" phase)
    decode: str | None  # histogram: first token to the last (the "decode" phase)
    ttft: str | None  # histogram
    itl: str | None  # histogram: between consecutive output tokens
    tpot: str | None  # histogram: per request, its decode time per output token after the first
    e2e: str | None  # histogram
    by_bucket: bool  # whether its series carry a `bucket` label (else they are engine-wide)

    def phase(self, name: str) -> str | None:
        """The series of a phase or gauge by its field name (queue, prefill, decode, kv_usage, ...)."""
        return getattr(self, name)


# slofleet's engine exports vLLM's names (and its own slofleet:* beside them): one row serves both. llama-server
# (--metrics) has gauges and totals but no per-request histograms, so no queue, prefill or decode phase, and its
# recent builds dropped the KV usage gauge (docs/runtimes.md lists what each runtime exports).
_VLLM_NAMES = RuntimeMetrics(
    running=NUM_RUNNING, waiting=NUM_WAITING, kv_usage=KV_USAGE, preemptions=PREEMPTIONS, prompt_tokens=PROMPT_TOKENS,
    generation_tokens=GENERATION_TOKENS, finished=REQUEST_SUCCESS, queue="vllm:request_queue_time_seconds",
    prefill="vllm:request_prefill_time_seconds", decode="vllm:request_decode_time_seconds", ttft=TTFT, itl=ITL,
    tpot="vllm:request_time_per_output_token_seconds", e2e=E2E, by_bucket=False)
RUNTIME_METRICS: dict[str, RuntimeMetrics] = {
    SLOFLEET: dataclasses.replace(_VLLM_NAMES, by_bucket=True),
    VLLM: _VLLM_NAMES,
    LLAMACPP: RuntimeMetrics(
        running="llamacpp:requests_processing", waiting="llamacpp:requests_deferred", kv_usage=None,
        preemptions=None, prompt_tokens="llamacpp:prompt_tokens", generation_tokens="llamacpp:tokens_predicted",
        finished=None, queue=None, prefill=None, decode=None, ttft=None, itl=None, tpot=None, e2e=None,
        by_bucket=False),
}
ENGINE_PHASES = ("queue", "prefill", "decode")  # the engine-side phases `slofleet diagnose` splits a clock into


def runtime_of(names: set[str] | frozenset[str]) -> str:
    """Which runtime exported these series: llama-server's prefix, else slofleet's own series beside vLLM's
    names, else vLLM (an engine's scrape, not a router's)."""
    if any(n.startswith("llamacpp:") for n in names):
        return LLAMACPP
    return SLOFLEET if any(n.startswith("slofleet:") for n in names) else VLLM


def not_exported(runtime: str) -> str:
    """What a reader of RUNTIME_METRICS says of a phase whose series is None."""
    return f"not exported by {runtime}"


# -- KV events (`slofleet serve --kv-events-endpoint`: vLLM's wire format over ZMQ, engine/server/kv_events.py) ---
KV_EVENTS_TOPIC = "kv"  # the topic is f"{KV_EVENTS_TOPIC}@{epoch}@{model}", the epoch new at every engine start
# Where an engine publishes them (vLLM's ports) and answers replays, as named container ports in a cluster: the router
# subscribes at these ports on each replica's address (its --kv-events-endpoint templates).
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5558
KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME = "kv-events", "kv-replay"


def zmq_problem(flag: str, address: str) -> str | None:
    """What is wrong with a ZMQ address (tcp://HOST:PORT, tcp://*:PORT to bind, ipc://PATH), or None."""
    if not address:
        return None
    scheme, sep, rest = address.partition("://")
    if sep and rest and scheme == "ipc":
        return None
    host, _, port = rest.rpartition(":")
    if sep and scheme == "tcp" and host and (port == "*" or port.isdigit() and 0 < int(port) < 65536):
        return None
    return f"{flag} must be a ZMQ address such as tcp://0.0.0.0:5557 or ipc:///tmp/kv-events, got {address!r}"


# Seeds the published hash chain (as vLLM's): the router must see the engines' value to compute the same hashes.
KV_HASH_SEED_ENV = "PYTHONHASHSEED"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: int | None = None) -> dict:
    """The OpenAI-shaped error object every HTTP component answers with."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def pod_url(pod: dict, port: int | None = None) -> str | None:
    """A pod's base URL, http://IP:PORT: at `port`, else at its container port named http (else its first, else
    DEFAULT_ENGINE_PORT); None until the pod has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    if port is None:
        ports = [p for c in (pod.get("spec") or {}).get("containers") or [] for p in c.get("ports") or []]
        named = next((p for p in ports if p.get("name") == "http"), ports[0] if ports else None)
        port = named["containerPort"] if named else DEFAULT_ENGINE_PORT
    return f"http://{ip}:{port}"


def now() -> str:
    """The current time in RFC 3339 (UTC, seconds), as Kubernetes writes time stamps."""
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_time(stamp: str) -> float:
    """An RFC 3339 time stamp, as Kubernetes writes them (`now()`'s form), in seconds since the epoch."""
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def load_kube_config() -> None:
    """In a pod, its ServiceAccount; elsewhere the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config  # imported here: the engine never needs it

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


# -- Prometheus text format ----------------------------------------------------------------------------------
class Sample(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float
    timestamp: float | None = None  # seconds, when the line carries one (as /federate answers)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _labels(text: str, i: int) -> tuple[dict[str, str], int]:
    """Parse `{a="x",b="y"}` starting at text[i] == '{'; returns the labels and the index after '}'."""
    out: dict[str, str] = {}
    i += 1
    while True:
        while text[i] in " ,":
            i += 1
        if text[i] == "}":
            return out, i + 1
        eq = text.index("=", i)
        key = text[i:eq].strip()
        i = text.index('"', eq) + 1
        buf = []
        while text[i] != '"':
            if text[i] == "\\":
                i += 1
                buf.append(_ESCAPES.get(text[i], "\\" + text[i]))
            else:
                buf.append(text[i])
            i += 1
        out[key] = "".join(buf)
        i += 1


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (comments skipped). Raises ValueError on a malformed line,
    so a half-written answer reads as missing data, not as zero."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] == "#":
            continue
        try:
            brace, space = line.find("{"), line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                name, (labels, end) = line[:brace], _labels(line, brace)
            else:
                name, labels, end = line[:space], {}, space
            fields = line[end:].split()
            value = float(fields[0])
            ts = float(fields[1]) / 1000 if len(fields) > 1 else None
        except (IndexError, ValueError) as e:
            raise ValueError(f"malformed metrics line {line[:120]!r}") from e
        out.append(Sample(name, labels, value, ts))
    return out


def sum_by_name(samples: list[Sample], names: set[str] | frozenset[str]) -> dict[str, float]:
    """name -> the sum over its label sets, for the given names (0 when absent); NaN samples are skipped."""
    out = dict.fromkeys(names, 0.0)
    for s in samples:
        if s.name in out and not math.isnan(s.value):
            out[s.name] += s.value
    return out


# -- engine settings the LLMService's `spec.engine` and `slofleet serve` share ----------------------------------
@dataclass(frozen=True, slots=True)
class Setting:
    """One `slofleet serve` flag that the CRD also exposes: its default and the rule both enforce."""
    default: bool | int | float | str
    help: str
    minimum: float | None = None
    maximum: float | None = None
    positive: bool = False  # > 0 (for floats, where a minimum of 0 would admit 0)
    choices: tuple[str, ...] = ()
    power_of_two: bool = False

    def problem(self, name: str, value) -> str | None:
        """Why `value` is refused, in words a user can act on; None when it is fine."""
        if self.choices and value not in self.choices:
            return f"{name} must be one of {', '.join(self.choices)}, got {value!r}"
        if self.positive and not value > 0:
            return f"{name} must be > 0, got {value}"
        if self.minimum is not None and value < self.minimum:
            return f"{name} must be >= {self.minimum:g}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"{name} must be <= {self.maximum:g}, got {value}"
        if self.power_of_two and (value <= 0 or value & (value - 1)):
            return f"{name} must be a power of two, got {value}"
        return None


ENGINE_SETTINGS: dict[str, Setting] = {
    "dtype": Setting("auto", "auto | float32 | bfloat16 (auto: bf16 on GPU; on a CPU the faster of the two, "
                     "measured at start by a GEMM probe at the model's shapes and cached)",
                     choices=("auto", "float32", "bfloat16")),
    "block_size": Setting(16, "tokens per KV block (a power of two)", 1, 256, power_of_two=True),
    "kv_cache_memory_gb": Setting(1.0, "memory budget for the KV block pool, in GiB", positive=True),
    "max_num_seqs": Setting(64, "most requests running in one step", 1),
    "max_num_batched_tokens": Setting(512, "token budget per step, shared by decodes and prefill chunks", 1),
    "max_model_len": Setting(8192, "longest prompt + output, capped by the model's own limit", 16),
    "enable_prefix_caching": Setting(True, "reuse KV blocks of shared prompt prefixes"),
    "max_waiting_requests": Setting(256, "admission limit: waiting requests before 429", 1),
    "max_queued_tokens": Setting(262144, "admission limit: queued prompt tokens before 429", 1),
    "num_speculative_tokens": Setting(0, "speculative decoding: draft tokens per decode step, looked up in the "
                                      "request's own prompt and output (n-gram); greedy requests only; 0: off",
                                      0, 16),
    "speculative_ngram": Setting(3, "speculative decoding: tokens matched to find a draft", 1, 16),
}
DEFAULT_ENGINE_PORT = 8000  # `slofleet serve --port`, and spec.engine.port
DEFAULT_GRACE_SECONDS = 30  # `slofleet serve --grace-period`, and spec.engine.drainSeconds
