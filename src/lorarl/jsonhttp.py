"""A tiny read-only JSON HTTP server for the trainer's /progress and the sidecar's /status.

The stdlib on purpose: three GET routes in the trainer and rollout images should not pull in a
web framework. The stdlib server trusts its clients, so this one bounds them: one request per
connection, which must arrive whole (request line and headers, at most `MAX_REQUEST_BYTES`)
within `request_timeout` seconds in total, not per read, so a client trickling a byte a second
is cut off; the reply must be taken within `request_timeout` too; at most `max_connections`
connections are served at once, the rest are closed unanswered. Only GET is served (the stdlib
answers 501 to any other method).
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = Callable[[], tuple[int, Any]]  # () -> (status code, JSON body or a RawBody)
REQUEST_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 16 * 1024
MAX_CONNECTIONS = 64


class _RequestTooLarge(Exception):
    pass


@dataclass(frozen=True)
class RawBody:
    """A reply that is not JSON (the trainer's Prometheus /metrics text), sent as is."""

    data: bytes
    content_type: str


class _DeadlineReader(io.RawIOBase):
    """The socket's bytes, each read given only what is left of one deadline and one byte budget."""

    def __init__(self, sock: socket.socket, deadline: float, budget: int) -> None:
        self._sock, self._deadline, self._left = sock, deadline, budget

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request did not arrive in time")
        if self._left <= 0:
            raise _RequestTooLarge
        self._sock.settimeout(remaining)
        view = memoryview(buffer)[: self._left]
        n = self._sock.recv_into(view)
        self._left -= n
        return n


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # full: drop it rather than queue threads
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class JsonHttpServer:
    def __init__(
        self,
        routes: dict[str, Route],
        port: int,
        host: str = "0.0.0.0",
        *,
        request_timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                deadline = time.monotonic() + request_timeout
                raw = _DeadlineReader(self.connection, deadline, MAX_REQUEST_BYTES)
                self.rfile = io.BufferedReader(raw)

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                except _RequestTooLarge:
                    self.close_connection = True
                    try:
                        self.connection.settimeout(request_timeout)
                        self.send_error(431, "request line and headers too large")
                    except OSError:  # the client is gone or does not read: nothing to tell
                        pass

            def do_GET(self) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                code, body = route() if route else (404, {"detail": "unknown path"})
                if isinstance(body, RawBody):
                    data, content_type = body.data, body.content_type
                else:
                    data, content_type = json.dumps(body).encode(), "application/json"
                self.connection.settimeout(request_timeout)  # total, for the whole sendall
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server((host, port), Handler, max_connections)
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
