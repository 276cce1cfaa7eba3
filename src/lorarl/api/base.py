"""Shared pydantic base: camelCase on the wire (Kubernetes style), snake_case in Python."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )

    def wire(self) -> dict:
        """The object as it appears in a manifest: camelCase, unset optionals omitted."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
