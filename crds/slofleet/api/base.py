"""What every custom-resource model shares: camelCase on the wire, CEL rules beside their fields, plain defaults."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError


def to_camel(name: str) -> str:
    # pydantic's to_camel capitalises after digits (e2e_ms -> e2EMs); Kubernetes style is e2eMs.
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def error_text(e: ValidationError, most: int = 5) -> str:
    """A validation error in one line: each field's path and what is wrong with it (the first `most` of them)."""
    parts = []
    for err in e.errors()[:most]:
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        msg = ("unknown field: remove it or check its spelling" if err["type"] == "extra_forbidden"
               else err["msg"].removeprefix("Value error, "))  # a model's own check says it all
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def rules(*pairs: tuple[str, str]) -> dict:
    """CEL rules for a schema node: (expression, message the user sees when it is false)."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in pairs]}


class Model(BaseModel):
    # camelCase on the wire (Kubernetes style), snake_case in Python; unknown fields are the API server's
    # business (it prunes them), so the models accept and ignore them. Defaults are plain values (`{}` for a
    # nested object, validated into the model) so that they appear in the CRD schema and the API server
    # applies the same defaults as Python does.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", validate_default=True)

    def wire(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class Resources(Model):
    """A container's requests and limits (cpu, memory, ...), as Kubernetes spells them."""
    requests: dict[str, int | str] = Field({"cpu": "1", "memory": "2Gi"})
    limits: dict[str, int | str] = Field({"cpu": "2", "memory": "4Gi"})
