"""A minimal Kubernetes API client: plain httpx against the API server URL + a bearer token.

Why not the official `kubernetes` client: the status API needs four calls (list/get a custom
resource, TokenReview, SubjectAccessReview), all plain JSON; httpx keeps the image small, the
calls visible, and a test's fake API server needs nothing but HTTP.

In a pod, `KubeApi.in_cluster()` uses the service account: `KUBERNETES_SERVICE_HOST`/`_PORT`, the
token and CA under /var/run/secrets/kubernetes.io/serviceaccount. The token file is re-read on
every call because projected tokens rotate.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import httpx

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeApiError(RuntimeError):
    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(message)
        self.status = status  # None: the API server did not answer at all


def segment(value: str) -> str:
    """`value` as one URL path segment: percent-quoted, and never empty, `.` or `..`, which URL
    normalisation would turn into another resource (a `get` of `.` is a `list`)."""
    if value in ("", ".", ".."):
        raise ValueError(f"{value!r} cannot be a path segment of a Kubernetes API URL")
    return quote(value, safe="")


def _check_path(path: str) -> None:
    """Refuse a path httpx would rewrite: dot segments, raw or percent-encoded."""
    parts = unquote(urlsplit(path).path).split("/")
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"refusing Kubernetes API path with a '.' or '..' segment: {path!r}")


class KubeApi:
    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        verify: bool | str = True,
        timeout: float = 5.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._token_file = Path(token_file) if token_file else None
        self._client = httpx.Client(
            base_url=self.base_url, verify=verify, timeout=timeout, trust_env=False
        )

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeApi:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeApiError(None, "KUBERNETES_SERVICE_HOST is not set: not running in a pod")
        host = f"[{host}]" if ":" in host else host
        ca = sa_dir / "ca.crt"
        return cls(
            f"https://{host}:{port}",
            token_file=sa_dir / "token",
            verify=str(ca) if ca.exists() else True,
        )

    def _headers(self) -> dict[str, str]:
        token = self._token
        if self._token_file is not None:
            token = self._token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict:
        _check_path(path)
        try:
            response = self._client.request(method, path, json=body, headers=self._headers())
        except httpx.HTTPError as exc:
            raise KubeApiError(None, f"{method} {path}: API server unreachable: {exc}") from exc
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            raise KubeApiError(
                response.status_code, f"{method} {path}: {response.status_code} {message}"
            )
        try:
            return response.json()
        except ValueError as exc:
            raise KubeApiError(response.status_code, f"{method} {path}: not JSON") from exc

    def get(self, path: str) -> dict:
        return self.request("GET", path)

    def post(self, path: str, body: dict[str, Any]) -> dict:
        return self.request("POST", path, body)

    def close(self) -> None:
        self._client.close()
