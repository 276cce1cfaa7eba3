"""Shared pydantic base: camelCase on the wire (Kubernetes style), snake_case in Python."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# The largest integer a spec may hold: the API server stores int64, but its schema bounds are
# float64, where 2**63 - 1 rounds up and wraps to -2**63 (every integer would then be refused).
# 2**53 - 1 is the largest integer a float64 (and a JSON number) carries exactly.
MAX_INT = 2**53 - 1
# The longest deadline, TTL or timeout a spec may ask for (ten years): larger numbers are typos or
# probes, and some consumers (timers, Kubernetes' own int32 fields) overflow on them.
MAX_SECONDS = 10 * 365 * 24 * 3600


class ApiModel(BaseModel):
    """What users write: every number finite (`.inf`/`.nan` in YAML are refused, not stored)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
    )

    def wire(self) -> dict:
        """The object as it appears in a manifest: camelCase, unset optionals omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ReportModel(ApiModel):
    """What lorarl measures (progress, status): a diverged run's NaN loss or infinite gradient
    norm is a fact to report, not bad input."""

    model_config = ConfigDict(allow_inf_nan=True)
