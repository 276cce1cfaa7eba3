"""A tiny read-only JSON HTTP server for the trainer's /progress and the sidecar's /status.

The stdlib on purpose: three GET routes in the trainer and rollout images should not pull in a
web framework.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = Callable[[], tuple[int, Any]]  # () -> (status code, JSON body)


class JsonHttpServer:
    def __init__(self, routes: dict[str, Route], port: int, host: str = "0.0.0.0"):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                code, body = route() if route else (404, {"detail": "unknown path"})
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> JsonHttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
