"""The API server's front door for in-cluster clients: TLS, authentication and RBAC, in front of
the emulator (which has none of the three).

A pod's service-account client (the status API's `KubeApi.in_cluster()`) speaks HTTPS to
`KUBERNETES_SERVICE_HOST` with a bearer token and the cluster CA. This front terminates TLS with
a certificate for 127.0.0.1, maps each token to a user (as the token authenticator would),
authorizes every resource request with the RBAC objects stored in the emulator (Roles, Cluster
Roles and their bindings: 401/403 like the API server), answers TokenReview and
SubjectAccessReview itself from the same tables, and forwards the rest to the emulator.
"""

from __future__ import annotations

import json
import re
import ssl
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from tests.support.controlplane import Pki

Obj = dict[str, Any]
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SARS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
_RESOURCE = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$"
)
RBAC = "/apis/rbac.authorization.k8s.io/v1"


@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ("system:authenticated",)


def service_account(namespace: str, name: str) -> User:
    return User(
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"),
    )


def _subject_matches(subject: Obj, user: User, binding_ns: str | None) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.name
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    return False


def _rule_allows(rule: Obj, verb: str, group: str, resource: str, name: str | None) -> bool:
    def has(key: str, value: str) -> bool:
        return value in (rule.get(key) or []) or "*" in (rule.get(key) or [])

    names = rule.get("resourceNames") or []
    return (
        has("apiGroups", group)
        and has("resources", resource)
        and has("verbs", verb)
        and (not names or name in names)
    )


@dataclass
class Authorizer:
    """RBAC as the API server evaluates it, over the emulator's stored objects."""

    emulator_url: str

    def _items(self, path: str) -> list[Obj]:
        return httpx.get(self.emulator_url + path, timeout=10).json().get("items") or []

    def allowed(self, user: User, verb: str, group: str, resource: str, ns: str | None,
                name: str | None = None) -> bool:  # fmt: skip
        roles = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in
                 self._items(f"{RBAC}/roles") + self._items(f"{RBAC}/clusterroles")}  # fmt: skip
        bindings = self._items(f"{RBAC}/clusterrolebindings")
        if ns:
            bindings += self._items(f"{RBAC}/namespaces/{ns}/rolebindings")
        for binding in bindings:
            binding_ns = binding["metadata"].get("namespace")
            if not any(
                _subject_matches(s, user, binding_ns) for s in binding.get("subjects") or []
            ):
                continue
            ref = binding["roleRef"]
            role = roles.get((binding_ns if ref["kind"] == "Role" else None, ref["name"]))
            if role and any(_rule_allows(r, verb, group, resource, name) for r in role["rules"]):
                return True
        return False


@dataclass
class ApiFront:
    emulator_url: str
    users: dict[str, User] = field(default_factory=dict)  # bearer token -> user
    requests: list[tuple[str, str, str, int]] = field(
        default_factory=list
    )  # user, method, path, code

    def __post_init__(self) -> None:
        self.authorizer = Authorizer(self.emulator_url)
        self._dir = Path(tempfile.mkdtemp(prefix="kube-front-"))
        # A CA of its own and a serving certificate for 127.0.0.1 (ca.crt is what clients trust).
        pki = Pki.create(self._dir)
        cert, key = pki.issue("tls", "kube-front", hosts=["127.0.0.1", "localhost"], server=True)
        assert (cert, key) == (self._dir / "tls.crt", self._dir / "tls.key")
        self.ca_file = pki.ca_file
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self._dir / "tls.crt", self._dir / "tls.key")
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- what the API server decides ----------------------------------------------------------
    def review(self, path: str, body: Obj) -> Obj:
        spec = body.get("spec") or {}
        if path == TOKEN_REVIEWS:
            user = self.users.get(spec.get("token", ""))
            status: Obj = {"authenticated": False, "error": "token not recognized"}
            if user:
                found = {"username": user.name, "uid": f"uid-{user.name}", "groups": [*user.groups]}
                status = {"authenticated": True, "user": found}
        else:
            attrs = spec.get("resourceAttributes") or {}
            user = User(spec.get("user", ""), tuple(spec.get("groups") or ()))
            ok = self.authorizer.allowed(
                user, attrs.get("verb", ""), attrs.get("group", ""), attrs.get("resource", ""),
                attrs.get("namespace") or None, attrs.get("name"),
            )  # fmt: skip
            status = {"allowed": ok}
        return {**body, "status": status}

    def permits(self, user: User, method: str, path: str, query: str) -> bool:
        m = _RESOURCE.match(path)
        if m is None:
            return True  # discovery, /version: every authenticated user
        if (method, path) in (("POST", TOKEN_REVIEWS), ("POST", SARS)):
            resource = path.rsplit("/", 1)[1]
            group = path.split("/")[2]
            return self.authorizer.allowed(user, "create", group, resource, None)
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
        if verb is None:
            verb = "watch" if "watch=true" in query else "get" if m["name"] else "list"
        resource = m["plural"] + (f"/{m['sub']}" if m["sub"] else "")
        return self.authorizer.allowed(user, verb, m["group"] or "", resource, m["ns"], m["name"])

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _status(self, code: int, reason: str, message: str) -> None:
                body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                        "reason": reason, "message": message, "code": code}  # fmt: skip
                self._reply(code, json.dumps(body).encode())

            def _handle(self) -> None:
                path, _, query = self.path.partition("?")
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                user = front.users.get(token)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if user is None:
                    code = 401
                    self._status(401, "Unauthorized", "Unauthorized")
                elif not front.permits(user, self.command, path, query):
                    code = 403
                    self._status(403, "Forbidden", f"{user.name} may not {self.command} {path}")
                elif self.command == "POST" and path in (TOKEN_REVIEWS, SARS):
                    code = 201
                    self._reply(201, json.dumps(front.review(path, json.loads(body))).encode())
                else:
                    reply = httpx.request(
                        self.command, front.emulator_url + self.path, content=body or None,
                        headers={"Content-Type": self.headers.get("Content-Type") or
                                 "application/json"}, timeout=30,
                    )  # fmt: skip
                    code = reply.status_code
                    self._reply(code, reply.content, reply.headers.get("Content-Type", ""))
                front.requests.append((user.name if user else "", self.command, self.path, code))

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        return Handler


@contextmanager
def api_front(emulator_url: str, users: dict[str, User]) -> Iterator[ApiFront]:
    front = ApiFront(emulator_url, dict(users))
    try:
        yield front
    finally:
        front.stop()
