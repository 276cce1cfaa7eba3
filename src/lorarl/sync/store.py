"""The sync store's socket: listening on the sender's own address, not on every interface.

`TCPStore(host, ..., is_master=True)` listens on the wildcard address whatever `host` says (host
only tells clients where to connect), so a store started for 127.0.0.1 is reachable from the pod
network. torch lets the master adopt a socket it did not create (`master_listen_fd`, both the
libuv and the classic backend), so the sender binds the socket itself, to `host`'s address: the
pod's address in a cluster (its own DNS name), loopback locally.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch.distributed as dist

from lorarl.sync.errors import SyncTransportError

LISTEN_BACKLOG = 512
RESOLVE_RETRY_S = 1.0


def _resolve(host: str, port: int, timeout: float) -> tuple[int, tuple]:
    """The first address `host` resolves to. A pod's own DNS name can appear a moment after the
    pod starts, so resolution is retried until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            return family, addr
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise SyncTransportError(f"sync address {host!r} does not resolve: {exc}") from exc
            time.sleep(RESOLVE_RETRY_S)


def listening_socket(host: str, port: int, timeout: float) -> socket.socket:
    family, addr = _resolve(host, port, timeout)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise SyncTransportError(f"cannot listen on {host}:{port} ({addr[0]}): {exc}") from exc
    return sock


def host_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """The sender's store, listening only on `host`'s address (port 0 picks a free port)."""
    sock = listening_socket(host, port, timeout)
    bound = sock.getsockname()[1]
    try:
        store = dist.TCPStore(
            host,
            bound,
            None,
            True,
            timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except RuntimeError as exc:
        sock.close()
        raise SyncTransportError(f"cannot start the sync store on {host}:{bound}: {exc}") from exc
    sock.detach()  # the store owns the socket now and closes it when it goes
    return store


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise SyncTransportError(f"cannot reach sync store {host}:{port}: {exc}") from exc
