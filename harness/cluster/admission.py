"""A test's own validating admission webhook on the real API server: an HTTPS server on
127.0.0.1 (certificate from the control plane's CA) registered with a
ValidatingWebhookConfiguration, so a test can hold or refuse the requests the code under test
sends, exactly where a real cluster's policy webhooks sit."""

from __future__ import annotations

import base64
import json
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from harness.cluster.controlplane import ControlPlane

Review = dict[str, Any]
Handler = Callable[[Review], Review]


def allow(review: Review) -> Review:
    return {"response": {"uid": review["request"]["uid"], "allowed": True}}


def deny(review: Review, code: int, reason: str, message: str) -> Review:
    status = {"code": code, "reason": reason, "message": message}
    return {"response": {"uid": review["request"]["uid"], "allowed": False, "status": status}}


@contextmanager
def admission_webhook(
    cp: ControlPlane,
    handler: Handler,
    *,
    name: str,
    resources: Sequence[str],
    operations: Sequence[str] = ("CREATE",),
    namespace: str | None = None,
    api_groups: Sequence[str] = ("",),
    timeout_seconds: int = 30,
) -> Iterator[None]:
    """Serve `handler` and register it for `resources` (in `namespace` only, when given);
    unregistered and stopped on exit."""
    cert, key = cp.pki.issue(f"webhook-{name}", "127.0.0.1", hosts=["127.0.0.1"], server=True)

    class _Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
            answer |= handler(body)
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True, name=f"webhook-{name}")
    thread.start()
    port = server.server_address[1]
    webhook: dict[str, Any] = {
        "name": f"{name}.test.lorarl.dev",
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Fail",
        "timeoutSeconds": timeout_seconds,
        "clientConfig": {
            "url": f"https://127.0.0.1:{port}/",
            "caBundle": base64.b64encode(cp.ca_file.read_bytes()).decode(),
        },
        "rules": [
            {
                "apiGroups": list(api_groups),
                "apiVersions": ["*"],
                "operations": list(operations),
                "resources": list(resources),
            }
        ],
    }
    if namespace is not None:
        webhook["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"test-{name}"},
        "webhooks": [webhook],
    }
    cp.kubectl_ok("apply", "-f", "-", input=json.dumps(config))
    try:
        yield
    finally:
        cp.kubectl("delete", "validatingwebhookconfiguration", f"test-{name}", "--wait=true")
        server.shutdown()
        server.server_close()


__all__ = ["admission_webhook", "allow", "deny"]
