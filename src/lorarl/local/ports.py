"""A free block of loopback ports for one local run."""

from __future__ import annotations

import random
import socket


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(size: int, low: int = 20000, high: int = 60000, tries: int = 200) -> int:
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high - size)
        if all(_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free loopback ports found")
