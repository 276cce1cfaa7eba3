"""Kubernetes API errors rendered as `Status` bodies, so clients raise their own typed errors."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An API failure with the HTTP code and `reason` a real API server would send."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}

    def status(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "details": self.details,
            "code": self.code,
        }


def qualified(group: str, plural: str) -> str:
    """`lorarljobs.lorarl.dev` / `pods`: how the API server names a resource in messages."""
    return f"{plural}.{group}" if group else plural


def not_found(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{qualified(group, plural)} "{name}" not found',
        {"name": name, "group": group, "kind": plural},
    )


def already_exists(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{qualified(group, plural)} "{name}" already exists',
        {"name": name, "group": group, "kind": plural},
    )


def conflict(group: str, plural: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(group, plural)} "{name}": {why}',
        {"name": name, "group": group, "kind": plural},
    )


def stale(group: str, plural: str, name: str) -> ApiError:
    return conflict(
        group,
        plural,
        name,
        "the object has been modified; please apply your "
        "changes to the latest version and try again",
    )


def invalid(group: str, plural: str, name: str, field: str, why: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{qualified(group, plural)} "{name}" is invalid: {field}: {why}',
        {
            "name": name,
            "group": group,
            "kind": plural,
            "causes": [{"field": field, "message": why}],
        },
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def method_not_allowed(message: str) -> ApiError:
    return ApiError(405, "MethodNotAllowed", message)
