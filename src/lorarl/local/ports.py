"""Free loopback ports for one local run.

A port found free is handed to a child process that binds it later. Ports are drawn from below
the kernel's ephemeral range, because every outgoing connection and every ``bind(port=0)`` (vLLM's
internal sockets, gloo, Ray) takes one from inside it, and one of those could claim a port we
chose before its owner has bound it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range; Linux's default where it cannot be read."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def candidate_range(size: int, ephemeral: tuple[int, int] | None = None) -> tuple[int, int]:
    """``[low, high)`` for the first port of a block of ``size`` outside the ephemeral range."""
    eph_low, eph_high = ephemeral or ephemeral_range()
    if eph_low - LOWEST >= size + 1000:
        return LOWEST, eph_low - size
    if 65535 - eph_high >= size + 1000:
        return eph_high + 1, 65536 - size
    return LOWEST, 65536 - size


def _free(port: int) -> bool:
    """Whether a plain ``bind`` takes ``port`` now.

    No ``SO_REUSEADDR``: with it a port still in TIME_WAIT from an earlier server looks free, and
    a child that binds without the option (a gloo store, an ad-hoc socket) then fails with
    EADDRINUSE.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(size: int, tries: int = 200) -> int:
    """The first of ``size`` consecutive free loopback ports, outside the ephemeral range."""
    low, high = candidate_range(size)
    rng = random.Random()
    for _ in range(tries):
        base = rng.randrange(low, high)
        if all(_free(p) for p in range(base, base + size)):
            return base
    raise RuntimeError(f"no block of {size} free loopback ports found in [{low}, {high + size})")


def free_port() -> int:
    """One free loopback port, outside the ephemeral range."""
    return free_port_block(1)
