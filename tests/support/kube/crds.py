"""Read a CustomResourceDefinition manifest into what the emulator serves for each version."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import jsonpath


@dataclass(frozen=True)
class ScalePaths:
    """Where `/scale` reads and writes replicas in the custom object (JSONPaths)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


@dataclass(frozen=True)
class VersionInfo:
    """One served version of a resource, with what kmock's ResourceInfo cannot hold."""

    group: str
    version: str
    plural: str
    singular: str
    kind: str
    list_kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status_subresource: bool = False
    scale: ScalePaths | None = None
    printer_columns: tuple[PrinterColumn, ...] = ()
    selectable_fields: frozenset[str] = field(default_factory=frozenset)
    storage: bool = True


def _require(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    value = mapping.get(key) if isinstance(mapping, Mapping) else None
    if value in (None, "", [], {}):
        raise ValueError(f"CRD manifest: {where}.{key} is required")
    return value


def parse_crd(crd: Mapping[str, Any]) -> list[VersionInfo]:
    """Every served version of the CRD; a malformed manifest is a ValueError naming the field."""
    if crd.get("kind") != "CustomResourceDefinition":
        raise ValueError(
            f"CRD manifest: kind must be CustomResourceDefinition, got {crd.get('kind')!r}"
        )
    spec = _require(crd, "spec", "")
    group = _require(spec, "group", "spec")
    names = _require(spec, "names", "spec")
    plural = _require(names, "plural", "spec.names")
    kind = _require(names, "kind", "spec.names")
    scope = spec.get("scope", "Namespaced")
    if scope not in ("Namespaced", "Cluster"):
        raise ValueError(f"CRD manifest: spec.scope must be Namespaced or Cluster, got {scope!r}")
    expected_name = f"{plural}.{group}"
    actual_name = (crd.get("metadata") or {}).get("name")
    if actual_name != expected_name:
        raise ValueError(
            f"CRD manifest: metadata.name must be {expected_name!r}, got {actual_name!r}"
        )
    versions = _require(spec, "versions", "spec")
    result = []
    for i, ver in enumerate(versions):
        where = f"spec.versions[{i}]"
        name = _require(ver, "name", where)
        if not ver.get("served", True):
            continue
        subs = ver.get("subresources") or {}
        scale = None
        if "scale" in subs:
            sc = subs["scale"] or {}
            scale = ScalePaths(
                spec_replicas=_require(sc, "specReplicasPath", f"{where}.subresources.scale"),
                status_replicas=_require(sc, "statusReplicasPath", f"{where}.subresources.scale"),
                label_selector=sc.get("labelSelectorPath"),
            )
        columns = tuple(
            _column(c, f"{where}.additionalPrinterColumns[{j}]")
            for j, c in enumerate(ver.get("additionalPrinterColumns") or [])
        )
        result.append(
            VersionInfo(
                group=group,
                version=name,
                plural=plural,
                singular=names.get("singular") or kind.lower(),
                kind=kind,
                list_kind=names.get("listKind") or f"{kind}List",
                namespaced=scope == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                status_subresource="status" in subs,
                scale=scale,
                printer_columns=columns,
                selectable_fields=frozenset(
                    str(f.get("jsonPath", "")).lstrip(".")
                    for f in ver.get("selectableFields") or ()
                ),
                storage=bool(ver.get("storage", len(versions) == 1)),
            )
        )
    if not result:
        raise ValueError(f"CRD manifest {expected_name}: no served versions")
    return result


def _column(col: Mapping[str, Any], where: str) -> PrinterColumn:
    path = _require(col, "jsonPath", where)
    try:
        jsonpath.compile_path(path)
    except ValueError as exc:
        raise ValueError(f"CRD manifest: {where}.jsonPath: {exc}") from exc
    col_type = _require(col, "type", where)
    if col_type not in ("string", "integer", "number", "boolean", "date"):
        raise ValueError(
            f"CRD manifest: {where}.type {col_type!r} is not one of "
            "string/integer/number/boolean/date"
        )
    return PrinterColumn(
        name=_require(col, "name", where),
        type=col_type,
        json_path=path,
        description=col.get("description", ""),
        priority=int(col.get("priority", 0)),
        format=col.get("format", ""),
    )
