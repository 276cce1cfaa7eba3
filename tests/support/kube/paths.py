"""URL paths of the Kubernetes REST API, parsed the way the API server routes them.

kmock 0.8 reads `/api/v1/namespaces` as "namespace ``None`` with no resource", so the emulator
routes with this parser instead.
"""

from __future__ import annotations

from dataclasses import dataclass

# Subresources of a Namespace object: `/api/v1/namespaces/{name}/status` is not a resource named
# "status" inside namespace {name}.
_NAMESPACE_SUBRESOURCES = frozenset({"status", "finalize"})


@dataclass(frozen=True)
class ApiPath:
    """One resource request: `group` is '' for the core API, `name`/`namespace` may be None."""

    group: str
    version: str
    plural: str
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


@dataclass(frozen=True)
class DiscoveryPath:
    """`/api`, `/apis`, `/apis/{group}`, `/api/v1`, `/apis/{group}/{version}`."""

    group: str | None  # None for the /api and /apis roots
    version: str | None
    legacy: bool  # under /api (core) rather than /apis


def parse(path: str) -> ApiPath | DiscoveryPath | None:
    """Classify a URL path; None when it is not part of the resource API (e.g. /version)."""
    segs = [s for s in path.split("/") if s]
    if not segs or segs[0] not in ("api", "apis"):
        return None
    if segs[0] == "api":
        if len(segs) == 1:
            return DiscoveryPath(None, None, legacy=True)
        group, version, rest = "", segs[1], segs[2:]
    else:
        if len(segs) == 1:
            return DiscoveryPath(None, None, legacy=False)
        if len(segs) == 2:
            return DiscoveryPath(segs[1], None, legacy=False)
        group, version, rest = segs[1], segs[2], segs[3:]
    if not rest:
        return DiscoveryPath(group, version, legacy=group == "")
    return _parse_resource(group, version, rest)


def _parse_resource(group: str, version: str, rest: list[str]) -> ApiPath:
    namespace: str | None = None
    if (
        rest[0] == "namespaces"
        and len(rest) >= 3
        and not (group == "" and len(rest) == 3 and rest[2] in _NAMESPACE_SUBRESOURCES)
    ):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0]
    name = rest[1] if len(rest) > 1 else None
    subresource = "/".join(rest[2:]) or None
    return ApiPath(group, version, plural, namespace, name, subresource)
