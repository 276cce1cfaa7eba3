"""Runs an ASGI app under a real uvicorn on 127.0.0.1:<ephemeral> in a thread (for browsers)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from lorarl.server.serve import serve_in_thread


@contextmanager
def live_server(app: object) -> Iterator[str]:
    url, stop = serve_in_thread(app)
    try:
        yield url
    finally:
        stop()
