"""Cross-field rules, written once and enforced twice.

Each rule carries a CEL expression (rendered into the CRD as `x-kubernetes-validations`, so the API
server enforces it) and an equivalent Python predicate (enforced by the pydantic models, so
`lorarl validate` and the operator's webhook reject the same manifests with the same words). A test
evaluates every CEL rule with a real CEL engine against the examples and checks both sides agree.

A `cluster` rule holds only for jobs that run as pods (the CRD is only ever a cluster's): Python
enforces it when validation runs with the context `{"cluster": True}` (`CLUSTER`), so
`lorarl run --local` and the processes reading a rendered config are not held to it. A rule
without CEL (quantity arithmetic, the rendered config's size) is Python only: the webhook
enforces it in the cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

CLUSTER = {"cluster": True}  # validation context of a job that runs as pods
# What the CRD alone enforces (no Python-only rules): for tests that compare the two.
CRD_ONLY = {"cluster": True, "crd_only": True}


def in_cluster(info: ValidationInfo | None) -> bool:
    return bool(info is not None and isinstance(info.context, dict) and info.context.get("cluster"))


def crd_only(info: ValidationInfo | None) -> bool:
    """Validating as the CRD alone would: Python-only checks are skipped."""
    return bool(
        info is not None and isinstance(info.context, dict) and info.context.get("crd_only")
    )


@dataclass(frozen=True)
class Rule:
    cel: str | None  # None: Python only (the webhook enforces it; the CRD cannot)
    message: str
    check: Callable[[Any], bool]
    field: str | None = None  # the field the error is reported on, relative to the object
    cluster: bool = False  # enforced only for jobs that run as pods (see the module docstring)

    def to_crd(self) -> dict[str, str]:
        if self.cel is None:
            raise ValueError(f"rule {self.message!r} has no CEL: the CRD cannot carry it")
        out = {"rule": self.cel, "message": self.message}
        # fieldPath must name a field declared in the schema; metadata's fields are not.
        if self.field and not self.field.startswith("metadata."):
            out["fieldPath"] = f".{self.field}"
        return out


def rules_schema_extra(*rules: Rule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.to_crd() for r in rules if r.cel]}


def enforce(*rules: Rule):
    """A model validator that raises on the first violated rule, reporting its field and value."""

    def _check(self, info: ValidationInfo):
        cluster = in_cluster(info)
        schema_only = crd_only(info)
        for rule in rules:
            if (rule.cluster and not cluster) or (schema_only and not rule.cel):
                continue
            if not rule.check(self):
                value = _field_value(self, rule.field)
                raise PydanticCustomError(
                    "rule",
                    "{message}",
                    {"message": rule.message, "field": rule.field or "", "value": value},
                )
        return self

    return model_validator(mode="after")(_check)


def _field_value(model: Any, field: str | None) -> Any:
    if not field:
        return None
    for attr_alias in field.split("."):
        name = next(
            (n for n, f in type(model).model_fields.items() if (f.alias or n) == attr_alias),
            attr_alias,
        )
        model = getattr(model, name, None)
    if hasattr(model, "model_dump"):
        return model.model_dump(by_alias=True, exclude_none=True)
    if isinstance(model, list):
        return [
            m.model_dump(by_alias=True, exclude_none=True) if hasattr(m, "model_dump") else m
            for m in model
        ]
    return model


def named_check_error(field: str, value: Any, message: str) -> PydanticCustomError:
    """A registry's refusal (an unknown built-in, bad params) as a rule error on `field`, its
    message cut to what a one-line report shows."""
    from lorarl.api.safe_yaml import EXCERPT_CHARS

    if len(message) > 2 * EXCERPT_CHARS:
        message = message[: 2 * EXCERPT_CHARS - 3] + "..."
    return PydanticCustomError(
        "rule", "{message}", {"message": message, "field": field, "value": value}
    )
