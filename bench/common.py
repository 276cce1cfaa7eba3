"""What every benchmark records about where it ran (numbers from a shared 2-core box mean little
without the CPU, the load and the library versions next to them), and the operator benchmarks'
shared harness: start the real operator, read its CPU and memory from /proc."""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lorarl.local.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
# glibc set up so that a process's RSS follows its live tensors: with a fixed 64 KiB mmap
# threshold every tensor over it is its own mapping, returned to the OS when freed. With glibc's
# default the threshold grows after the first large free, later tensors come from the heap and
# stay resident once freed, so one update's peak RSS above its start is bimodal run to run (the
# plain update of tests/integration/test_fsdp_memory.py: 190 or 328 MiB; 162 every time with it).
# glibc reads it at start-up: set it in a child's environment.
LIVE_TENSORS_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


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


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (utime and stime of /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


@contextlib.contextmanager
def running_operator(
    kubeconfig: Path,
    *,
    timer_seconds: float,
    progress_url: str,
    profile: str | None = None,
    log: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """The real operator (`python -m lorarl.operator`) against `kubeconfig`, healthy and with
    its watches up; stopped (SIGTERM, then SIGKILL) on exit. `profile` runs it under cProfile
    (several times slower: for finding costs, not for figures); `log` keeps its output."""
    with tempfile.TemporaryDirectory() as tmp:
        health = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "LORARL_WEBHOOK_PORT": "0",
            "LORARL_HEALTH_PORT": str(health),
            "LORARL_METRICS_PORT": "0",
            "LORARL_TIMER_SECONDS": str(timer_seconds),
            "LORARL_PROGRESS_URL": progress_url,
            "HOME": tmp,
        }
        log = log or Path(tmp) / "operator.log"
        prof = ["-m", "cProfile", "-o", profile] if profile else []
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *prof, "-m", "lorarl.operator"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        try:
            deadline = time.monotonic() + 60
            while not _healthy(health):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"operator did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
            time.sleep(1.0)  # let kopf establish its watches
            yield proc
        finally:
            if proc.poll() is None and proc.returncode is None:
                proc.terminate()
            try:
                proc.wait(30)  # cProfile writes its stats on a clean exit
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(port: int) -> bool:
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).is_success
    except httpx.HTTPError:
        return False


def rss_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM, ...), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def trim_heap() -> None:
    """Return freed memory to the OS, so the next peak starts from live objects only."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
