"""The HTTP server's own settings (`slofleet serve` flags beside EngineConfig's): listener, draining, limits, auth."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from slofleet.api.contract import DEFAULT_ENGINE_PORT, DEFAULT_GRACE_SECONDS, INTERNAL_TOKEN_ENV, zmq_problem

# The container's memory limit in bytes, as a pod gets it from `resourceFieldRef: {resource: limits.memory}`; without
# it, the cgroup's own limit (v2, then v1) is read.
MEMORY_LIMIT_ENV = "SLOFLEET_MEMORY_LIMIT"
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
NO_LIMIT = 1 << 60  # cgroup v1 writes a number near 2**63 for "no limit"


@dataclass(slots=True, kw_only=True)
class ServerSettings:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=DEFAULT_ENGINE_PORT, metadata={"help": "port to listen on"})
    grace_period: float = field(default=float(DEFAULT_GRACE_SECONDS), metadata={
        "help": "seconds to finish in-flight requests after SIGTERM"})
    drain_delay: float = field(default=2.0, metadata={
        "help": "seconds /ready reports 503 after SIGTERM before the listener closes, so load balancers stop first"})
    log_level: str = field(default="info", metadata={"choices": ("debug", "info", "warning", "error")})
    api_key: str = field(default_factory=lambda: os.environ.get("SLOFLEET_API_KEY", ""), metadata={
        "help": "require 'Authorization: Bearer KEY' on /v1/* (default: $SLOFLEET_API_KEY; empty: no key)"})
    internal_token: str = field(default_factory=lambda: os.environ.get(INTERNAL_TOKEN_ENV, ""), metadata={
        "help": f"the LLMService's internal token (default: ${INTERNAL_TOKEN_ENV}): /v1/* needs it (or --api-key), "
                "and only its holders may hand a request's prefill to a peer"})
    price_per_hour: float = field(default=0.0, metadata={
        "help": "what this replica costs per hour, for the cost counters (slofleet:request_cost, replica_cost)"})
    otlp_traces_endpoint: str = field(default="", metadata={
        "help": "send request traces by OTLP/HTTP to this URL (http://collector:4318 gets /v1/traces); the last "
                "traces are kept in memory either way, at GET /debug/traces"})
    max_request_bytes: int = field(default=4 << 20, metadata={
        "help": "largest request body accepted; larger ones get 413 before they are parsed"})
    request_read_timeout: float = field(default=30.0, metadata={
        "help": "seconds a client may take to send its request body (slow senders get 408)"})
    kv_events_endpoint: str = field(default="", metadata={
        "help": "publish the prefix cache's changes as vLLM's KV events (ZMQ PUB, msgpack) on this address, e.g. "
                "tcp://0.0.0.0:5557 (empty: off)"})
    kv_events_replay_endpoint: str = field(default="", metadata={
        "help": "answer replay requests for missed KV event batches (ZMQ ROUTER) on this address, e.g. "
                "tcp://0.0.0.0:5558"})
    bucket_ttft_ms: str = field(default="", metadata={
        "help": "TTFT target per bucket in ms, e.g. 'chat=500,doc=1500': a request predicted to miss it (from the "
                "prompt tokens queued at its priority or higher and the measured prefill rate) gets 429 with "
                "Retry-After before any engine work (as the router's slo-predicted admission)"})
    require_internal_token: bool = field(default=True, metadata={
        "help": "with an internal token, every /v1/* call needs it; --no-require-internal-token lets callers without "
                "it use the generation endpoints (completions, chat, models): a gateway and its endpoint picker in "
                "front of the engines, where the NetworkPolicy admits only them. KV hand-off and drain still need it"})

    def __post_init__(self) -> None:
        problems = [f"--port must be 1-65535, got {self.port}" if not 0 < self.port < 65536 else None,
                    *(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(self, name):g}"
                      for name in ("grace_period", "drain_delay", "price_per_hour", "request_read_timeout")
                      if not getattr(self, name) >= 0),
                    f"--max-request-bytes must be at least 1, got {self.max_request_bytes}"
                    if self.max_request_bytes < 1 else None,
                    zmq_problem("--kv-events-endpoint", self.kv_events_endpoint),
                    zmq_problem("--kv-events-replay-endpoint", self.kv_events_replay_endpoint),
                    "--kv-events-replay-endpoint needs --kv-events-endpoint (it replays what that one published)"
                    if self.kv_events_replay_endpoint and not self.kv_events_endpoint else None,
                    self.ttft_problem()]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("; ".join(problems))

    def ttft_problem(self) -> str | None:
        try:
            self.bucket_ttft_map()
        except ValueError as e:
            return str(e)
        return None

    def bucket_ttft_map(self) -> dict[str, float]:
        """Seconds to first token, by bucket."""
        from ..config import by_bucket

        return {k: v / 1000 for k, v in by_bucket(self.bucket_ttft_ms, "bucket_ttft_ms", "positive number").items()}


def memory_limit() -> tuple[int, str] | None:
    """The container's memory limit in bytes and where it was read, or None when there is none."""
    sources = [(MEMORY_LIMIT_ENV, os.environ.get(MEMORY_LIMIT_ENV, ""))]
    for path in CGROUP_LIMITS:
        try:
            with open(path) as f:
                sources.append((path, f.read()))
        except OSError:
            continue
    for where, text in sources:
        text = text.strip()
        if text.isdigit() and 0 < int(text) < NO_LIMIT:
            return int(text), where
    return None


def kv_pool_problem(kv_cache_memory_gb: float, num_blocks: int) -> str | None:
    """Why a KV pool of this size cannot fit the container: refused at start rather than OOM-killed once it fills.
    A fixed --num-blocks is sized only once the model is loaded, so only the memory budget is checked here."""
    limit = memory_limit()
    want = int(kv_cache_memory_gb * 2**30)
    if num_blocks or limit is None or want < limit[0]:
        return None
    return (f"--kv-cache-memory-gb {kv_cache_memory_gb:g} ({want} bytes) does not fit the container's memory limit "
            f"of {limit[0]} bytes ({limit[1]}), which must also hold the model: lower it or raise the limit")
