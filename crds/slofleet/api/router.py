"""spec.router of an LLMService: the `slofleet router` in front of the engines, and what its `precise` policy needs
of the rest of the spec (CEL over the whole spec, since the rules span spec.router and spec.engine)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from slofleet.api.base import Model, Resources, rules
from slofleet.api.contract import KV_EVENTS_PORT, KV_REPLAY_PORT
from slofleet.api.images import CONTROL_IMAGE

# Measured for the embedded model: the router's tokenizer, the engine loader's torch and the model's one-time
# conversion peak at 1.45 GB resident; a full default index (--prefix-index-blocks) adds about 0.4 GB after.
PRECISE_MEMORY = "2Gi"


class RouterAuth(Model):
    """API keys and their quotas, from a Secret the router mounts and re-reads within seconds of a change."""
    secret_name: str = Field(..., min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                             description="Secret in the service's namespace that holds the keys")
    key: str = Field("keys", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="the Secret's key whose value lists the API keys, one a line: "
                     "`KEY [name=LABEL] [rpm=N] [tpm=N]` (requests and tokens per minute, 0: unlimited)")
    requests_per_minute: float = Field(0, ge=0, description="quota of a key whose line sets no rpm (0: unlimited)")
    tokens_per_minute: float = Field(0, ge=0, description="quota of a key whose line sets no tpm (0: unlimited); a "
                                     "request is charged its prompt plus the output it allows")


class Router(Model):
    """The `slofleet router` Deployment in front of the engines, the service's endpoint: buckets, priority
    shedding, prefix-aware replica choice, the prefill -> decode hand-off, and holding requests while no engine
    is ready (scale from zero). It finds the engines through their Services' EndpointSlices."""
    enabled: bool = Field(True, description="off: no router; clients call the engines' Services directly")
    replicas: int = Field(1, ge=1, le=64)
    port: int = Field(8080, ge=1, le=65535)
    policy: Literal["prefix", "least-load", "round-robin", "precise"] = Field(
        "prefix", description="replica choice: prefix (hashing the prompt's head), least-load, round-robin, or "
        "precise (the longest prefix an engine's KV events say it holds: the engines publish them on ports "
        f"{KV_EVENTS_PORT} and {KV_REPLAY_PORT}, and the router loads the engines' model for its tokenizer and "
        f"fingerprint, so it needs {PRECISE_MEMORY} of memory)")
    hold_timeout_seconds: int = Field(60, ge=0, le=3600, description="how long a request waits for a ready engine "
                                      "(scale from zero) before it gets 503")
    resources: Resources = Field({"requests": {"cpu": "100m", "memory": "128Mi"},
                                  "limits": {"cpu": "1", "memory": "512Mi"}})
    auth: RouterAuth | None = Field(None, description="API keys: absent, the router takes requests without a key")
    image: str | None = Field(None, min_length=1, description=f"the router pods' image; default: {CONTROL_IMAGE}, "
                              "or engine.image under policy precise (the router loads the engines' model)")

    def pod_image(self, engine_image: str) -> str:
        """Its own image where set; else the engines' under precise, which needs torch; else the control plane's."""
        return self.image or (engine_image if self.kv_events() else CONTROL_IMAGE)

    def kv_events(self) -> bool:
        """Whether the router follows the engines' KV events, so that they must publish them."""
        return self.enabled and self.policy == "precise"


def precise_rules() -> dict:
    """CEL on the spec for what `router.policy: precise` cannot work without. (Its memory is not among them: a
    quantity in CEL is over the API server's cost budget; the operator warns instead, see operator/router.py.)"""
    when = "!self.router.enabled || self.router.policy != 'precise' || "
    return rules(
        (when + "self.engine.enablePrefixCaching",
         "router.policy precise routes on the engines' prefix caches: it needs engine.enablePrefixCaching true"),
        (when + f"!(self.engine.port in [{KV_EVENTS_PORT}, {KV_REPLAY_PORT}])",
         f"router.policy precise: engine.port must not be {KV_EVENTS_PORT} or {KV_REPLAY_PORT}, the engines' KV "
         "event ports"),
    )
