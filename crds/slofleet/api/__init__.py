"""slofleet's custom resources (pydantic models of the served version) and their CRD generator."""
from slofleet.api.v1alpha1 import (
                                   API_VERSION,
                                   GROUP,
                                   ROLES,
                                   VERSION,
                                   LLMService,
                                   LLMServiceSpec,
                                   LLMServiceStatus,
                                   Pool,
                                   SLOPolicy,
)

__all__ = ["API_VERSION", "GROUP", "ROLES", "VERSION", "LLMService", "LLMServiceSpec", "LLMServiceStatus", "Pool",
           "SLOPolicy"]
