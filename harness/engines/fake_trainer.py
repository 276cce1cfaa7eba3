"""A stand-in for trainer rank 0's progress endpoint: a real HTTP server on 127.0.0.1:<ephemeral>.

Serves `GET /progress` (a Progress) and `GET /progress/history` (a list of StepRecord), both in
camelCase exactly as the trainer does. Tests drive it with `step()` / `finish()` and kill it with
`stop()` to play a trainer that went away.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lorarl.api.reports.progress import Progress, StepRecord
from lorarl.api.reports.status import SyncStatus


def make_record(step: int, *, t0: float = 1_700_000_000.0) -> StepRecord:
    """A deterministic, distinguishable record per step (values are functions of the step)."""
    return StepRecord(
        step=step,
        time=t0 + 10.0 * step,
        reward_mean=0.1 * step,
        reward_std=0.05,
        kl=0.001 * step * step,
        entropy=1.0 - 0.01 * step,
        tokens_per_second=500.0 + step,
        sync_seconds=0.2 + 0.01 * step,
        sync_bytes=1000 * step,
        weight_version=step,
    )


class FakeTrainer:
    def __init__(self, job: str = "demo", total_steps: int = 10) -> None:
        self.progress = Progress(
            job=job,
            phase="Starting",
            total_steps=total_steps,
            started_at=time.time() - 30.0,
            updated_at=time.time(),
        )
        self.history: list[StepRecord] = []
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._stopped = False

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        trainer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                with trainer._lock:
                    trainer.requests.append(self.path)
                    if self.path == "/progress":
                        body: object = trainer.progress.wire()
                    elif self.path == "/progress/history":
                        body = [r.wire() for r in trainer.history]
                    else:
                        self.send_error(404)
                        return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler

    def step(self, n: int = 1) -> None:
        """Finish `n` more steps: append records and move the progress along."""
        with self._lock:
            for _ in range(n):
                record = make_record(len(self.history) + 1)
                self.history.append(record)
                self.progress = self.progress.model_copy(
                    update={
                        "phase": "Running",
                        "step": record.step,
                        "latest": record,
                        "last_sync": SyncStatus(
                            version=record.step,
                            seconds=record.sync_seconds,
                            bytes=record.sync_bytes,
                            mode="merged",
                        ),
                        "updated_at": record.time,
                    }
                )

    def finish(self, phase: str = "Succeeded", message: str = "done") -> None:
        with self._lock:
            self.progress = self.progress.model_copy(
                update={"phase": phase, "message": message, "adapter_path": "/out/adapter"}
            )

    def stop(self) -> None:
        if not self._stopped:
            self._stopped = True
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> FakeTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
