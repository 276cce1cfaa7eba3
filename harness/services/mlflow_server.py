"""A real `mlflow server` subprocess for tracking tests (sqlite backend, artifacts proxied into a
temp folder): started once, waited for only when a test needs it, so it boots while other work
runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from lorarl.local.ports import free_port


@dataclass
class MlflowServer:
    proc: subprocess.Popen
    url: str
    log_path: Path

    def wait_healthy(self, timeout_s: float = 120) -> str:
        """The server's URL once /health answers; raises with its log if it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start: {self.log_path.read_text()}")
            time.sleep(0.3)


@contextmanager
def mlflow_server_process(home: Path) -> Iterator[MlflowServer]:
    """Start the server in `home` (not waited for); killed at exit."""
    port = free_port()
    log = open(home / "server.log", "w")  # noqa: SIM115 (closed at exit)
    # No background job runner: it is a server feature the tests do not use (and needs huey).
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
         "--artifacts-destination", str(home / "artifacts")],
        cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield MlflowServer(proc, f"http://127.0.0.1:{port}", home / "server.log")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(3)
        except subprocess.TimeoutExpired:  # uvicorn waits for idle keep-alive clients
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
