"""Running the status API: refuse to expose an unauthenticated server beyond loopback."""

from __future__ import annotations

import ipaddress

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
