"""What every benchmark records about where it ran: numbers from a shared 2-core box mean little
without the CPU, the load and the library versions next to them."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(**extra: Any) -> dict[str, Any]:
    """Machine description for a results file; `extra` adds benchmark-specific facts."""
    import torch

    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if hasattr(os, "getloadavg"):
        info["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)
    return {**info, **extra}


def write_results(path: Path, report: dict[str, Any]) -> None:
    """Atomically: an interrupted benchmark leaves the previous results file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
