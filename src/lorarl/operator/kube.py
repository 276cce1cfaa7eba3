"""A small async Kubernetes client (aiohttp, one session) for the operator's own writes.

kopf's API client is private, so children, status and deletions go through this one. It loads
credentials the way kopf's default login does (in-cluster service account, else kubeconfig via
the `kubernetes` package), so both talk to the same server as the same user.
Create treats 409 AlreadyExists as "exists" and delete treats 404 as "gone": the two facts an
idempotent reconcile needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp
from yarl import URL

from lorarl.api.resource import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"


class KubeError(RuntimeError):
    def __init__(self, status: int | None, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}" if status else message)
        self.status, self.reason = status, reason


def path(
    api_version: str,
    plural: str,
    namespace: str | None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{quote(namespace, safe='')}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{quote(name, safe='')}"
    if subresource is not None:
        base += f"/{subresource}"
    return base


PLURALS = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroups",
}


def object_path(obj: dict[str, Any], *, named: bool = False) -> str:
    key = (obj["apiVersion"], obj["kind"])
    if key not in PLURALS:
        raise ValueError(f"{obj['apiVersion']} {obj['kind']}: not a kind the operator creates")
    meta = obj["metadata"]
    return path(obj["apiVersion"], PLURALS[key], meta["namespace"], meta["name"] if named else None)


def job_path(namespace: str, name: str, subresource: str | None = None) -> str:
    return path(f"{GROUP}/{VERSION}", PLURAL, namespace, name, subresource)


@dataclass(frozen=True)
class Credentials:
    server: str
    verify: bool | str = True
    cert: tuple[str, str] | None = None
    token: str | None = None
    refresh: Any = None  # kubernetes Configuration (token refresh), if loaded through it
    # kubeconfig `tls-server-name`: the name the server's certificate is checked against (and
    # sent as SNI) when `server` is an address the certificate does not name.
    tls_server_name: str | None = None

    def headers(self) -> dict[str, str]:
        if self.refresh is not None:
            # The `kubernetes` package stores tokens (kubeconfig and in-cluster alike) under
            # "BearerToken"; "authorization" is only its legacy alias. Asking for the alias alone
            # sent every write unauthenticated (401 on a real API server).
            value = self.refresh.get_api_key_with_prefix("BearerToken", alias="authorization")
            if value:
                return {"Authorization": value}
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}


def load_credentials() -> Credentials:
    """In a pod: the service account; elsewhere: $KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    verify: bool | str = cfg.ssl_ca_cert or bool(cfg.verify_ssl)
    cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file and cfg.key_file else None
    return Credentials(server=cfg.host.rstrip("/"), verify=verify, cert=cert, refresh=cfg,
                       tls_server_name=getattr(cfg, "tls_server_name", None) or None)  # fmt: skip


def ssl_context(creds: Credentials) -> ssl.SSLContext | bool:
    """The TLS settings as one context: the cluster's CA (or the system's), the client
    certificate when the user has one. False only where the kubeconfig turns checks off."""
    if not creds.server.startswith("https:"):
        return True  # plain HTTP (an API server behind a local proxy): nothing to set
    if creds.verify is False:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    elif isinstance(creds.verify, str):
        ctx = ssl.create_default_context(cafile=creds.verify)
    else:
        ctx = ssl.create_default_context()
    if creds.cert is not None:
        ctx.load_cert_chain(*creds.cert)
    return ctx


# One session, few connections kept alive: the API server answers these small writes in
# milliseconds, and more sockets only add handshakes.
CONNECTIONS = 8
# Tokens rotate in minutes (service-account tokens are re-read after 60 s by the `kubernetes`
# package, exec-plugin tokens carry an expiry); asking every few seconds follows them closely.
AUTH_TTL_S = 5.0


class Reply:
    """Status and parsed body of one answer (read whole: API answers here are small)."""

    __slots__ = ("body", "status", "text")

    def __init__(self, status: int, text: str) -> None:
        self.status, self.text = status, text
        try:
            self.body: Any = json.loads(text) if text else None
        except ValueError:
            self.body = None


class Kube:
    """The session is made on first use: aiohttp binds it to the running event loop."""

    def __init__(self, creds: Credentials, *, timeout: float = 15.0) -> None:
        self._creds = creds
        self._ssl = ssl_context(creds)
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._auth: tuple[float, dict[str, str]] = (-AUTH_TTL_S, {})
        # Requests queue here, before the timeout starts: aiohttp's own wait for a free
        # connection counts against the request's total time, so 1,000 jobs' children queued
        # at once timed out in the queue, never having been sent.
        self._slots = asyncio.Semaphore(CONNECTIONS)

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                trust_env=False,
                connector=aiohttp.TCPConnector(limit=CONNECTIONS, ssl=self._ssl),
                json_serialize=json.dumps,
            )
        return self._session

    def _headers(self) -> dict[str, str]:
        """The credentials' auth header, asked for again every AUTH_TTL_S: the `kubernetes`
        package re-applies its whole config (proxy lookup from the environment included) on
        each ask, a sixth of this client's CPU when asked per request."""
        now = time.monotonic()
        if now - self._auth[0] >= AUTH_TTL_S:
            self._auth = (now, self._creds.headers())
        return self._auth[1]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self, method: str, url: str, body: Any = None, content_type: str = "application/json"
    ) -> Reply:
        headers = {**self._headers(), "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        target = URL(self._creds.server + url, encoded=True)  # path() quoted it already
        try:
            async with self._slots:
                session = self._open()
                async with session.request(
                    method, target, data=data, headers=headers,
                    server_hostname=self._creds.tls_server_name,
                ) as reply:  # fmt: skip
                    return Reply(reply.status, await reply.text())
        except TimeoutError as exc:
            late = f"{method} {url}: no answer within {self._timeout.total:g} s"
            raise KubeError(None, "Unreachable", late) from exc
        except (aiohttp.ClientError, OSError, ssl.SSLError) as exc:
            raise KubeError(None, "Unreachable", f"{method} {url}: {exc!r}") from exc

    @staticmethod
    def _error(reply: Reply, what: str) -> KubeError:
        doc = reply.body if isinstance(reply.body, dict) else {}
        return KubeError(
            reply.status,
            str(doc.get("reason", "")),
            f"{what}: {doc.get('message') or reply.text[:300]}",
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The created object, or None when one of that name exists already (409)."""
        url = object_path(obj)
        reply = await self._call("POST", url, obj)
        if reply.status == 409:
            return None
        if reply.status >= 300:
            raise self._error(reply, f"creating {obj['kind']} {obj['metadata']['name']}")
        return reply.body

    async def delete(self, url: str, *, what: str) -> bool:
        """True if deleted (or marked), False when already gone (404)."""
        reply = await self._call(
            "DELETE",
            url,
            {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
        )
        if reply.status == 404:
            return False
        if reply.status >= 300:
            raise self._error(reply, f"deleting {what}")
        return True

    async def get(self, url: str) -> dict[str, Any] | None:
        reply = await self._call("GET", url)
        if reply.status == 404:
            return None
        if reply.status >= 300:
            raise self._error(reply, f"reading {url}")
        return reply.body

    async def merge_patch(self, url: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        reply = await self._call("PATCH", url, body, MERGE_PATCH)
        if reply.status >= 300:
            raise self._error(reply, f"patching {what}")
        return reply.body
