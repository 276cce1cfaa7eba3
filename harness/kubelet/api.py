"""The kubelet's view of the API server: HTTPS with the CA's verification and a client
certificate (the kubelet's `system:node:<name>` one, or an agent's), as any client would."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

Obj = dict[str, Any]
MERGE = {"Content-Type": "application/merge-patch+json"}


class NotFound(LookupError):
    pass


class Api:
    def __init__(self, url: str, ca: Path, cert: tuple[Path, Path]) -> None:
        tls = ssl.create_default_context(cafile=str(ca))
        tls.load_cert_chain(str(cert[0]), str(cert[1]))
        self._http = httpx.Client(base_url=url, verify=tls, timeout=15, trust_env=False)
        self._kinds: dict[tuple[str, str], tuple[str, bool]] = {}

    def close(self) -> None:
        self._http.close()

    def get(self, path: str) -> Obj:
        reply = self._http.get(path)
        if reply.status_code == 404:
            raise NotFound(path)
        reply.raise_for_status()
        return reply.json()

    def items(self, path: str) -> list[Obj]:
        return self.get(path).get("items") or []

    def patch(self, path: str, body: Obj) -> Obj | None:
        """A merge patch; None if the object is gone."""
        reply = self._http.patch(path, json=body, headers=MERGE)
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        return reply.json()

    def create(self, path: str, body: Obj) -> Obj | None:
        """POST; None if it exists already."""
        reply = self._http.post(path, json=body)
        if reply.status_code == 409:
            return None
        reply.raise_for_status()
        return reply.json()

    def delete(self, path: str, **options: Any) -> None:
        """DELETE with DeleteOptions (`gracePeriodSeconds`, `preconditions`, ...)."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background",
                **options}  # fmt: skip
        reply = self._http.request("DELETE", path, json=body)
        if reply.status_code not in (200, 202, 404, 409):  # 409: a newer object of that name
            reply.raise_for_status()

    # -- objects by reference ------------------------------------------------------------------
    def object(self, namespace: str, kind: str, name: str, api_version: str = "v1") -> Obj:
        """GET a namespaced object by apiVersion/kind (raises NotFound)."""
        return self.get(self.path(api_version, kind, namespace, name))

    def path(self, api_version: str, kind: str, namespace: str | None, name: str) -> str:
        base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
        plural = self.plural(api_version, kind)
        where = f"/namespaces/{namespace}" if namespace else ""
        return f"{base}{where}/{plural}/{name}"

    def plural(self, api_version: str, kind: str) -> str:
        return self._discover(api_version, kind)[0]

    def namespaced(self, api_version: str, kind: str) -> bool:
        return self._discover(api_version, kind)[1]

    def _discover(self, api_version: str, kind: str) -> tuple[str, bool]:
        key = (api_version, kind)
        if key not in self._kinds:
            base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            for res in self.get(base).get("resources") or []:
                if "/" not in res["name"]:
                    self._kinds[(api_version, res["kind"])] = (res["name"], bool(res["namespaced"]))
        if key not in self._kinds:
            raise NotFound(f"{api_version} {kind}: not served")
        return self._kinds[key]
