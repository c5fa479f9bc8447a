"""A stand-in for slofleet.operator.kube.Kube in pure operator tests (named as such: no API server behind it)."""
from __future__ import annotations


class StandInKube:
    """An empty namespace: no children or pods yet; every apply is taken as given, or answered with `error`."""

    def __init__(self, error: Exception | None = None):
        self.error = error

    def has_kind(self, api_version: str, kind: str) -> bool:
        return False

    def children(self, namespace: str, service: str) -> dict:
        return {}

    def pods(self, namespace: str, service: str) -> list:
        return []

    def apply(self, obj: dict) -> dict:
        if self.error is not None:
            raise self.error
        return obj

    def patch_status(self, namespace: str, name: str, status: dict) -> None:
        pass
