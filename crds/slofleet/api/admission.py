"""A bucket's admission: how the router decides, before any engine work, whether to take a request (part of
slofleet.dev/v1alpha1, kept here so that the resource's module stays small)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from slofleet.api.base import Model as _Model

if TYPE_CHECKING:
    from slofleet.api.v1alpha1 import SLO

ADMISSION_MODES = ("slo-predicted", "fixed", "off")


class Admission(_Model):
    """Per-bucket admission; a request refused gets 429 with Retry-After before any engine work. The limits hold
    for the service as a whole: each of `router.replicas` routers enforces its share (status.routerAdmission)."""
    mode: Literal[ADMISSION_MODES] | None = Field(
        None, description="slo-predicted: refuse a request whose time to first token, predicted on the replica it "
        "would go to from the prompt tokens queued there at its priority or higher and that replica's observed "
        "prefill rate, exceeds slo.ttftMs (the limits below hold too); fixed: only the limits below and the "
        "fleet's in-flight capacity, shed by priority; off: admit every request. Default: slo-predicted where the "
        "bucket has slo.ttftMs, else fixed")
    max_waiting_requests: int | None = Field(None, ge=0)
    max_queued_tokens: int | None = Field(None, ge=0)
    max_requests_per_second: float | None = Field(None, gt=0)

    def in_force(self, slo: SLO | None) -> str:
        """The mode in force: the one set, else slo-predicted where there is a TTFT target to predict against."""
        if self.mode is not None:
            return self.mode
        return "slo-predicted" if slo is not None and slo.ttft_ms else "fixed"
