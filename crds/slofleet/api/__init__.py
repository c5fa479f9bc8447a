"""slofleet's custom resources (pydantic models of the served version) and their CRD generator.

The models load on first use, so `slofleet.api.contract` (standard library only) imports without pydantic:
the engine reads its shared names from there."""
from __future__ import annotations

import importlib

__all__ = ["API_VERSION", "GROUP", "ROLES", "VERSION", "LLMService", "LLMServiceSpec", "LLMServiceStatus", "Pool",
           "SLOPolicy"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module("slofleet.api.v1alpha1"), name)
    raise AttributeError(f"module 'slofleet.api' has no attribute {name!r}")
