"""Who is calling, and may they see this: TokenReview + SubjectAccessReview against the API server.

The server asks Kubernetes the same question kubectl's request would face (`get`/`list`
`lorarljobs.lorarl.dev` in a namespace), so the status API never shows more than kubectl would.
For `/metrics` it asks what kube-rbac-proxy asks: may the caller `get` that non-resource URL.
Review results are cached for a few seconds, keyed by a hash of the token (the token itself is
never kept), so a refreshing dashboard does not cost two API calls per request; a revoked right
stops working within `ttl` seconds.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from lorarl.api.resource import GROUP, PLURAL
from lorarl.server.kube_api import KubeApi, KubeApiError

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
ALL_NAMESPACES = ""


class Unauthenticated(Exception):
    """No token, or one the API server does not accept (HTTP 401)."""


class AuthUnavailable(RuntimeError):
    """The API server could not review the request (HTTP 503): fail closed, never open."""


@dataclass(frozen=True)
class User:
    username: str
    uid: str = ""
    groups: tuple[str, ...] = ()
    extra: dict[str, list[str]] = field(default_factory=dict, hash=False, compare=False)
    token_hash: str = ""  # keys the authorization cache; never the token itself


class Authorizer(Protocol):
    def authenticate(self, token: str) -> User:
        """Raises Unauthenticated or AuthUnavailable."""
        ...

    def allowed(self, user: User, verb: str, namespace: str) -> bool:
        """May `user` `verb` lorarljobs in `namespace` (ALL_NAMESPACES: cluster-wide)?"""
        ...

    def allowed_url(self, user: User, verb: str, path: str) -> bool:
        """May `user` `verb` the non-resource URL `path` (RBAC `nonResourceURLs`)?"""
        ...


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class _TTLCache:
    def __init__(self, ttl: float, clock: Callable[[], float], max_entries: int = 10_000) -> None:
        self._ttl, self._clock, self._max = ttl, clock, max_entries
        self._data: dict[tuple, tuple[float, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Any | None:
        with self._lock:
            hit = self._data.get(key)
            if hit is None or hit[0] <= self._clock():
                return None
            return hit[1]

    def put(self, key: tuple, value: Any) -> None:
        with self._lock:
            now = self._clock()
            if len(self._data) >= self._max:
                self._data = {k: v for k, v in self._data.items() if v[0] > now}
                if len(self._data) >= self._max:
                    self._data.clear()
            self._data[key] = (now + self._ttl, value)


class KubeAuth:
    def __init__(
        self,
        api: KubeApi,
        *,
        ttl: float = 10.0,
        audiences: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._audiences = audiences
        self._cache = _TTLCache(ttl, clock)

    def _post(self, path: str, body: dict) -> dict:
        try:
            return self._api.post(path, body)
        except KubeApiError as exc:
            raise AuthUnavailable(f"the API server could not review the request: {exc}") from exc

    def authenticate(self, token: str) -> User:
        key = ("token", token_hash(token))
        cached = self._cache.get(key)
        if cached is None:
            spec: dict[str, Any] = {"token": token}
            if self._audiences:
                spec["audiences"] = self._audiences
            review = self._post(
                TOKEN_REVIEWS,
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec},
            )
            cached = review.get("status") or {}
            self._cache.put(key, cached)
        if not cached.get("authenticated"):
            reason = cached.get("error") or "the API server did not accept it"
            raise Unauthenticated(f"invalid bearer token: {reason}")
        info = cached.get("user") or {}
        return User(
            username=info.get("username", ""),
            uid=info.get("uid", ""),
            groups=tuple(info.get("groups") or ()),
            extra={k: list(v) for k, v in (info.get("extra") or {}).items()},
            token_hash=key[1],
        )

    def allowed(self, user: User, verb: str, namespace: str) -> bool:
        attributes = {"verb": verb, "group": GROUP, "resource": PLURAL}
        if namespace != ALL_NAMESPACES:
            attributes["namespace"] = namespace
        return self._review(user, ("access", verb, namespace), {"resourceAttributes": attributes})

    def allowed_url(self, user: User, verb: str, path: str) -> bool:
        attributes = {"nonResourceAttributes": {"verb": verb, "path": path}}
        return self._review(user, ("url", verb, path), attributes)

    def _review(self, user: User, question: tuple[str, ...], attributes: dict) -> bool:
        key = (question[0], user.token_hash, *question[1:])
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        review = self._post(
            SUBJECT_ACCESS_REVIEWS,
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": {
                    "user": user.username,
                    "uid": user.uid,
                    "groups": list(user.groups),
                    "extra": user.extra,
                    **attributes,
                },
            },
        )
        status = review.get("status") or {}
        allowed = bool(status.get("allowed")) and not status.get("denied")
        self._cache.put(key, allowed)
        return allowed
