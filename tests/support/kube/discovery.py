"""Discovery documents (`/api`, `/apis`, `/apis/{g}`, `/api/v1`, `/apis/{g}/{v}`): what kopf scans
and what lets `kubectl get lrj` resolve a short name to a resource."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from .crds import VersionInfo

SUBRESOURCE_VERBS = ["get", "patch", "update"]


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes version order: GA before beta before alpha, higher numbers first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (0, 0, 0)
    stage = {"alpha": 1, "beta": 2, None: 3}[m[2]]
    return (stage, int(m[1]), int(m[3] or 0))


def _group_versions(infos: Iterable[VersionInfo]) -> dict[str, list[str]]:
    groups: dict[str, set[str]] = {}
    for info in infos:
        if info.group:
            groups.setdefault(info.group, set()).add(info.version)
    return {g: sorted(vs, key=version_priority, reverse=True) for g, vs in sorted(groups.items())}


def _group_doc(group: str, versions: list[str], preferred: str) -> dict[str, Any]:
    return {
        "name": group,
        "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
        "preferredVersion": {"groupVersion": f"{group}/{preferred}", "version": preferred},
    }


def _preferred(group: str, versions: list[str], infos: list[VersionInfo]) -> str:
    storage = {i.version for i in infos if i.group == group and i.storage}
    return next((v for v in versions if v in storage), versions[0])


def api_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def api_group_list(infos: list[VersionInfo]) -> dict[str, Any]:
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [
            _group_doc(g, vs, _preferred(g, vs, infos)) for g, vs in _group_versions(infos).items()
        ],
    }


def api_group(group: str, infos: list[VersionInfo]) -> dict[str, Any] | None:
    versions = _group_versions(infos).get(group)
    if not versions:
        return None
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        **_group_doc(group, versions, _preferred(group, versions, infos)),
    }


def resource_list(
    group: str,
    version: str,
    infos: list[VersionInfo],
    verbs_of: dict[tuple[str, str, str], list[str]],
) -> dict[str, Any] | None:
    """The APIResourceList of one group/version, or None when nothing is served there."""
    chosen = [i for i in infos if (i.group, i.version) == (group, version)]
    if not chosen:
        return None
    resources: list[dict[str, Any]] = []
    for info in sorted(chosen, key=lambda i: i.plural):
        resources.append(
            {
                "name": info.plural,
                "singularName": info.singular,
                "namespaced": info.namespaced,
                "kind": info.kind,
                "verbs": verbs_of[(info.group, info.version, info.plural)],
                **({"shortNames": list(info.short_names)} if info.short_names else {}),
                **({"categories": list(info.categories)} if info.categories else {}),
            }
        )
        if info.status_subresource:
            resources.append(
                {
                    "name": f"{info.plural}/status",
                    "singularName": "",
                    "namespaced": info.namespaced,
                    "kind": info.kind,
                    "verbs": SUBRESOURCE_VERBS,
                }
            )
        if info.scale is not None:
            resources.append(
                {
                    "name": f"{info.plural}/scale",
                    "singularName": "",
                    "namespaced": info.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": SUBRESOURCE_VERBS,
                }
            )
    group_version = f"{group}/{version}" if group else version
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }
