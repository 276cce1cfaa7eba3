"""Core utilisation over a step: the busy share of the machine's CPU time, from `/proc/stat`.

It answers "did generation and update leave cores idle?" (how the local runner shares cores:
docs/architecture.md#local-runs). It is the whole machine's figure: on a local run that is the
run; in a pod it is the node's, other tenants included. None where `/proc/stat` is unreadable.
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")
# /proc/stat's aggregate "cpu" line: user nice system idle iowait irq softirq steal [guest
# guest_nice]; guest time is already inside user/nice, so it is left out of the total.
_IDLE_FIELDS = (3, 4)  # idle, iowait
_COUNTED = 8


def cpu_times(stat_text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies from /proc/stat's text; None when its first line is not `cpu`."""
    first = stat_text.split("\n", 1)[0].split()
    if not first or first[0] != "cpu" or len(first) < 1 + _COUNTED:
        return None
    values = [int(v) for v in first[1 : 1 + _COUNTED]]
    idle = sum(values[i] for i in _IDLE_FIELDS)
    return sum(values) - idle, sum(values)


def utilisation(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Busy fraction between two readings, 0..1; None without both or without time passing."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, min(1.0, (after[0] - before[0]) / (after[1] - before[1])))


def read_cpu_times(path: Path = PROC_STAT) -> tuple[int, int] | None:
    try:
        return cpu_times(path.read_text())
    except (OSError, ValueError):
        return None
