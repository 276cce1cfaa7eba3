"""Ports handed to child processes come from outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from lorarl.local import ports


def test_candidates_lie_below_the_ephemeral_range():
    low, high = ports.candidate_range(7, ephemeral=(32768, 60999))
    assert (low, high) == (ports.LOWEST, 32768 - 7)


def test_candidates_lie_above_a_low_ephemeral_range():
    low, high = ports.candidate_range(5, ephemeral=(1024, 50000))
    assert (low, high) == (50001, 65536 - 5)


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)


def test_block_is_free_and_outside_the_ephemeral_range():
    eph_low, eph_high = ports.ephemeral_range()
    for _ in range(20):
        base = ports.free_port_block(4)
        assert all(not eph_low <= p <= eph_high for p in range(base, base + 4))
        for port in range(base, base + 4):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "candidate_range", lambda size: (taken, taken + 1))
        with pytest.raises(RuntimeError, match="no block of 1 free loopback ports"):
            ports.free_port_block(1, tries=5)


def test_a_port_in_time_wait_is_not_free():
    """A server (with SO_REUSEADDR, as uvicorn sets it) that closed a connection first leaves its
    port in TIME_WAIT: a bind with SO_REUSEADDR takes it, a plain bind fails."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()
        client.recv(1)
        client.close()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", port))
    assert not ports._free(port)
