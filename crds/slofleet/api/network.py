"""spec.network of an LLMService: who besides its router reaches the engines, and the endpoint picker that the
operator's InferencePools (the Gateway API Inference Extension's) name."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from slofleet.api.base import Model


class EndpointPicker(Model):
    """An endpoint picker Service (the inference extension's EPP, e.g. llm-d's) that a gateway asks which engine
    takes each request."""
    name: str = Field(..., min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="the picker's Service, in the service's namespace")
    port: int = Field(9002, ge=1, le=65535, description="its ext-proc port")
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose", description="when the picker does not "
                                                           "answer: FailOpen sends the request on anyway, FailClose "
                                                           "refuses it")


class Network(Model):
    """Who besides the service's router, its engines and the autoscaler may reach the engines (a NetworkPolicy)."""
    gateway_namespace: str | None = Field(None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                          description="namespace of a gateway (e.g. an endpoint picker) whose pods "
                                          "may call the engines directly; with router.enabled=false they need no "
                                          "internal token on the generation endpoints")
    endpoint_picker: EndpointPicker | None = Field(None, description="the endpointPickerRef of the InferencePool the "
                                                   "operator makes for the engines that serve requests (where the "
                                                   "InferencePool CRD exists); absent, the pool names none")
