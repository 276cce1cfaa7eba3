"""`meta.k8s.io/v1` Table responses, which `kubectl get` asks for to print its columns."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import jsonpath
from .crds import PrinterColumn

NAME_COLUMN = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "priority": 0,
    "description": "Name must be unique within a namespace.",
}
AGE_COLUMN = PrinterColumn(
    "Age",
    "date",
    ".metadata.creationTimestamp",
    "CreationTimestamp is the time the object was created.",
)


def wants_table(accept: str | None) -> bool:
    return bool(accept) and "as=Table" in accept.replace(" ", "")


def human_age(timestamp: str, now: dt.datetime | None = None) -> str:
    """A coarse `kubectl`-style age: 42s, 17m, 5h, 3d."""
    try:
        then = dt.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return "<invalid>"
    seconds = int(((now or dt.datetime.now(dt.timezone.utc)) - then).total_seconds())
    if seconds < 0:
        return "<invalid>"
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 3 * 3600:
        return f"{seconds // 60}m"
    if seconds < 48 * 3600:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _cell(column: PrinterColumn, obj: Mapping[str, Any]) -> Any:
    values = jsonpath.find(obj, column.json_path)
    if not values or values[0] is None:
        return None
    value = values[0]
    try:
        if column.type == "date":
            return human_age(str(value))
        if column.type == "integer":
            return int(value)
        if column.type == "number":
            return float(value)
        if column.type == "boolean":
            return bool(value)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, str) else _compact(value)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _row_object(obj: Mapping[str, Any], include: str) -> dict[str, Any] | None:
    if include == "None":
        return None
    if include == "Object":
        return dict(obj)
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": obj.get("metadata", {}),
    }


def render_table(
    objects: Iterable[Mapping[str, Any]],
    columns: Sequence[PrinterColumn],
    resource_version: str,
    include_object: str = "Metadata",
) -> dict[str, Any]:
    """The Table for these objects: Name first, then the printer columns (or Age if none)."""
    cols = list(columns) or [AGE_COLUMN]
    definitions = [dict(NAME_COLUMN)] + [
        {
            "name": c.name,
            "type": c.type,
            "format": c.format,
            "description": c.description,
            "priority": c.priority,
        }
        for c in cols
    ]
    rows = []
    for obj in objects:
        row: dict[str, Any] = {
            "cells": [obj.get("metadata", {}).get("name")] + [_cell(c, obj) for c in cols],
        }
        embedded = _row_object(obj, include_object)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }
