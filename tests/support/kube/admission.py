"""Validating admission, played by tests: hooks get a real `AdmissionReview` and answer with one.

The emulator calls matching hooks before it commits a write; a denial becomes the error a real
API server returns (`admission webhook "<name>" denied the request: ...`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from .crds import VersionInfo
from .errors import ApiError

# Takes an AdmissionReview request, returns an AdmissionReview (or just its `response`).
AdmissionHook = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class AdmissionRule:
    name: str
    hook: AdmissionHook
    group: str | None = None  # None: any
    plural: str | None = None
    operations: frozenset[str] = frozenset({"CREATE", "UPDATE"})
    subresources: frozenset[str | None] = field(default_factory=lambda: frozenset({None}))

    def applies(self, res: VersionInfo, operation: str, subresource: str | None) -> bool:
        return (
            (self.group is None or self.group == res.group)
            and (self.plural is None or self.plural == res.plural)
            and operation in self.operations
            and subresource in self.subresources
        )


def review(
    res: VersionInfo,
    operation: str,
    namespace: str | None,
    name: str | None,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    subresource: str | None,
) -> dict[str, Any]:
    """The review a real API server sends: `subResource`/`requestSubResource` are `omitempty`,
    so a write to the main resource carries neither (webhooks tell the two apart by absence)."""
    gvk = {"group": res.group, "version": res.version, "kind": res.kind}
    gvr = {"group": res.group, "version": res.version, "resource": res.plural}
    sub = {"subResource": subresource, "requestSubResource": subresource} if subresource else {}
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "requestKind": gvk,
            "resource": gvr,
            "requestResource": gvr,
            **sub,
            "name": name or (new or old or {}).get("metadata", {}).get("name", ""),
            "namespace": namespace or "",
            "operation": operation,
            "userInfo": {"username": "kube-emulator-test", "groups": ["system:authenticated"]},
            "object": new,
            "oldObject": old,
            "dryRun": False,
            "options": None,
        },
    }


def run_hooks(
    rules: Collection[AdmissionRule],
    res: VersionInfo,
    operation: str,
    namespace: str | None,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    subresource: str | None = None,
) -> None:
    """Call every matching hook in order; the first denial aborts the write."""
    for rule in rules:
        if not rule.applies(res, operation, subresource):
            continue
        name = ((new or old or {}).get("metadata") or {}).get("name")
        try:
            answer = rule.hook(review(res, operation, namespace, name, new, old, subresource))
        except Exception as exc:  # failurePolicy: Fail
            raise ApiError(
                500,
                "InternalError",
                f'Internal error occurred: failed calling webhook "{rule.name}": {exc}',
            ) from exc
        response = answer.get("response", answer) if isinstance(answer, dict) else None
        if not isinstance(response, dict) or "allowed" not in response:
            raise ApiError(
                500,
                "InternalError",
                f"Internal error occurred: webhook "
                f'"{rule.name}" returned no response.allowed: {answer!r}',
            )
        if not response["allowed"]:
            status = response.get("status") or {}
            code = max(int(status.get("code") or 400), 400)
            raise ApiError(
                code,
                status.get("reason") or ("Forbidden" if code == 403 else "BadRequest"),
                f'admission webhook "{rule.name}" denied the request: '
                f"{status.get('message') or 'without explanation'}",
            )


def http_hook(url: str, *, timeout: float = 10.0, verify: bool = False) -> AdmissionHook:
    """A hook that POSTs the review to a real webhook server (e.g. kopf's); returns its answer."""
    import httpx

    def call(review_body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(url, json=review_body, timeout=timeout, verify=verify)
        reply.raise_for_status()
        return reply.json()

    return call
