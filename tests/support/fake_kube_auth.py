"""A tiny Kubernetes API server for the status API's tests: a real HTTP server on 127.0.0.1.

It implements just what `KubeStore` and `KubeAuth` call:
- POST /apis/authentication.k8s.io/v1/tokenreviews     (tokens configured by the test)
- POST /apis/authorization.k8s.io/v1/subjectaccessreviews (grants: (user, verb, namespace);
  namespace "" grants every namespace, like a ClusterRoleBinding; (user, verb, "/path") grants a
  non-resource URL)
- GET  /apis/lorarl.dev/v1alpha1/lorarljobs, .../namespaces/<ns>/lorarljobs[/<name>]
Every call must carry the server's own service-account token, as a real API server demands.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_JOBS = re.compile(r"^/apis/lorarl\.dev/v1alpha1(?:/namespaces/([^/]+))?/lorarljobs(?:/([^/]+))?$")
_TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
_SARS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


def job_object(namespace: str, name: str, *, phase: str = "Running", step: int = 3) -> dict:
    return {
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "resourceVersion": "7",
            "generation": 1,
            "creationTimestamp": "2025-01-01T00:00:00Z",
        },
        "spec": {
            "model": {"path": "/models/tiny"},
            "data": {"trainFiles": ["/data/train.jsonl"]},
            "lora": {"rank": 16, "alpha": 32},
            "rollout": {"engine": "vllm", "replicas": 2, "syncMode": "adapter"},
        },
        "status": {
            "phase": phase,
            "step": step,
            "totalSteps": 100,
            "metrics": {"rewardMean": 0.25},
            "lastSync": {"version": step, "seconds": 0.4, "mode": "adapter"},
            "conditions": [{"type": "Running", "status": "True", "reason": "TrainerReady"}],
        },
    }


class FakeKubeApi:
    def __init__(self, server_token: str = "server-sa-token") -> None:
        self.server_token = server_token
        self.users: dict[str, str] = {}  # bearer token -> username
        self.grants: set[tuple[str, str, str]] = set()  # (username, verb, namespace)
        self.jobs: dict[tuple[str, str], dict] = {}
        self.calls: Counter[str] = Counter()  # "tokenreview", "sar", "list", "get"
        self.sar_log: list[dict] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_user(self, token: str, username: str, *grants: tuple[str, str]) -> None:
        """grants: (verb, namespace) pairs; namespace "" means all namespaces."""
        self.users[token] = username
        self.grants |= {(username, verb, ns) for verb, ns in grants}

    def add_job(self, namespace: str, name: str, **kw: object) -> dict:
        obj = job_object(namespace, name, **kw)  # type: ignore[arg-type]
        self.jobs[(namespace, name)] = obj
        return obj

    def _token_review(self, body: dict) -> dict:
        username = self.users.get(body.get("spec", {}).get("token", ""))
        status = (
            {
                "authenticated": True,
                "user": {"username": username, "uid": f"uid-{username}", "groups": ["team"]},
            }
            if username
            else {"authenticated": False, "error": "token not recognized"}
        )
        return {**body, "status": status}

    def _sar(self, body: dict) -> dict:
        spec = body.get("spec", {})
        attrs = spec.get("resourceAttributes", {})
        self.sar_log.append(spec)
        if "nonResourceAttributes" in spec:  # granted as (user, verb, "/path")
            url = spec["nonResourceAttributes"]
            grant = (spec.get("user"), url.get("verb"), url.get("path"))
            return {**body, "status": {"allowed": grant in self.grants}}
        ok = (attrs.get("group"), attrs.get("resource")) == ("lorarl.dev", "lorarljobs") and any(
            (spec.get("user"), attrs.get("verb"), ns) in self.grants
            for ns in {"", attrs.get("namespace", "")}
        )
        return {**body, "status": {"allowed": ok}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._send(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "reason": reason,
                        "message": message,
                        "code": code,
                    },
                )

            def _authorized(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {fake.server_token}":
                    return True
                self._status(401, "Unauthorized", "Unauthorized")
                return False

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with fake._lock:
                    if self.path == _TOKEN_REVIEWS:
                        fake.calls["tokenreview"] += 1
                        return self._send(201, fake._token_review(body))
                    if self.path == _SARS:
                        fake.calls["sar"] += 1
                        return self._send(201, fake._sar(body))
                self._status(404, "NotFound", f"{self.path} not found")

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                match = _JOBS.match(self.path)
                if match is None:
                    return self._status(404, "NotFound", f"{self.path} not found")
                namespace, name = match.groups()
                with fake._lock:
                    if name is not None:
                        fake.calls["get"] += 1
                        obj = fake.jobs.get((namespace, name))
                        if obj is None:
                            msg = f'lorarljobs.lorarl.dev "{name}" not found'
                            return self._status(404, "NotFound", msg)
                        return self._send(200, obj)
                    fake.calls["list"] += 1
                    items = [
                        o
                        for (ns, _), o in sorted(fake.jobs.items())
                        if namespace is None or ns == namespace
                    ]
                self._send(
                    200,
                    {
                        "apiVersion": "lorarl.dev/v1alpha1",
                        "kind": "LoRARLJobList",
                        "metadata": {"resourceVersion": "9"},
                        "items": items,
                    },
                )

        return Handler

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
