"""Running the status API: refuse to expose an unauthenticated server beyond loopback."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from lorarl.server.app import create_app
from lorarl.server.auth import Authorizer
from lorarl.server.stores.base import JobStore


def check_bind(host: str, auth: Authorizer | None) -> None:
    """Local stores have no auth, so they may only listen on a loopback address."""
    if auth is not None:
        return
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(
            f"host {host!r}: a status API without auth must bind a loopback address "
            "(127.0.0.1); use Kubernetes auth to listen on other interfaces"
        )


def serve(
    store: JobStore, *, auth: Authorizer | None = None, host: str = "127.0.0.1", port: int = 8088
) -> None:
    import uvicorn

    check_bind(host, auth)
    uvicorn.run(create_app(store, auth=auth), host=host, port=port, log_level="info")


def serve_in_thread(
    app: Callable[..., Any], host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0
) -> tuple[str, Callable[[], None]]:
    """Serve an ASGI app from a daemon thread (port 0: any free port); returns (URL, stop)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    bound = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"server on {host}:{bound} did not start")
        time.sleep(0.01)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"http://{host}:{bound}", stop
