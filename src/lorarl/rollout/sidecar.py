"""The sync sidecar: `python -m lorarl.rollout.sidecar --config job.yaml`.

Runs next to one engine. Receives every adapter version from trainer rank 0, applies it (merged
or adapter mode), acknowledges, and keeps the engine on the latest good version — also after the
engine restarts. `/healthz` and `/status` report what it did.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.lora import rank_here
from lorarl.jsonhttp import JsonHttpServer
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.rollout.applier import UpdateApplier
from lorarl.rollout.engine import EngineError, RolloutEngine
from lorarl.sync.errors import SyncClosed, SyncKeyMissing, SyncRefused, SyncTransportError

log = logging.getLogger("lorarl.sidecar")


@dataclass
class SidecarStatus:
    replica: str | None = None  # rollout-<index>
    version: int | None = None  # what the engine serves
    latest: int | None = None  # the newest version accepted from the trainer
    updates: int = 0
    rejected: int = 0
    bytes_received: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    last_error: str | None = None
    engine_healthy: bool = False
    engine_restarts: int = 0
    reapplied: int = 0
    incarnation: str | None = None  # the sync registration this process answers for

    @property
    def in_sync(self) -> bool:
        """The engine is up and serves the newest weights: safe to generate from. Before the
        first update there are no trainer weights on it yet, so it is not."""
        return self.engine_healthy and self.latest is not None and self.version == self.latest

    def to_json(self) -> dict[str, Any]:
        """camelCase on the wire, like every other lorarl status document."""
        return {**{_camel(k): v for k, v in asdict(self).items()}, "inSync": self.in_sync}


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


class Sidecar:
    def __init__(self, applier: UpdateApplier, receiver, engine: RolloutEngine):
        self.applier, self.receiver, self.engine = applier, receiver, engine
        self.status = SidecarStatus()
        self._lock = threading.Lock()  # one engine update at a time (sync vs. restart replay)
        self._stop = threading.Event()
        self._transport_errors = 0  # in a row
        self.max_transport_errors = 3
        self.transport_retry_s = 1.0

    def handle_one(self) -> bool:
        """Receive, apply, acknowledge one update; False when the trainer closed the channel.

        A broken group (a peer sidecar died mid-sync) is survived: the receiver has already asked
        for a new generation, so dying here would only cascade one pod's crash to all of them.
        Repeated failures in a row (the trainer's store is gone) are raised so the process exits.
        """
        t0 = time.perf_counter()
        try:
            received = self.receiver.recv()
        except SyncClosed:
            return False
        except SyncTransportError as exc:
            self._transport_failed(exc)
            return True
        except SyncRefused as exc:  # a forged or malformed update: reported, nothing applied
            self.status.rejected += 1
            self.status.last_error = str(exc)
            return True
        header, tensors = received.header, received.tensors
        recv_s = time.perf_counter() - t0
        self.status.bytes_received += header.payload_bytes
        try:
            with self._lock:
                if not self.engine.health():
                    return self._defer(header, tensors)
                applied = self.applier.apply(header, tensors)
        except Exception as exc:  # any failure: report, keep serving the last good version
            if isinstance(exc, EngineError) and not self.engine.health():
                with self._lock:  # it died mid-push: deliver when it is back
                    return self._defer(header, tensors)
            self.status.rejected += 1
            self.status.last_error = f"v{header.version}: {exc}"
            log.error("rejected update %s", self.status.last_error)
            self._ack(header.version, ok=False, message=str(exc)[:900])
            return True
        self.status.version = self.status.latest = header.version
        self.status.updates += 1
        self.status.last_error = None
        self.status.seconds = {"receive": recv_s, **applied.seconds}
        if self._ack(header.version, ok=True):
            log.info("applied v%d in %s", header.version, _fmt(self.status.seconds))
        return True

    def _defer(self, header, tensors) -> bool:
        """The engine is down: accept the (valid) update now, apply it when the engine is back.

        The trainer keeps training on the other engines; this one is left out of generation
        (`/healthz` is 503) until it serves this version."""
        self.status.engine_healthy = False
        self.applier.defer(header, tensors)
        self.status.latest = header.version
        log.warning("engine down: v%d accepted, applies when the engine is back", header.version)
        self._ack(header.version, ok=True, message="deferred: engine not ready")
        return True

    def _ack(self, version: int, ok: bool, message: str = "") -> bool:
        try:
            self.receiver.ack(version, ok=ok, message=message)
        except SyncTransportError as exc:
            self._transport_failed(exc)
            return False
        self._transport_errors = 0
        return True

    def _transport_failed(self, exc: SyncTransportError) -> None:
        self._transport_errors += 1
        self.status.last_error = f"sync transport: {exc}"
        log.error(self.status.last_error)
        if self._transport_errors >= self.max_transport_errors:
            raise exc
        time.sleep(self.transport_retry_s)

    def watch_engine(self, poll_s: float = 0.5) -> None:
        """Re-push the latest version when the engine comes back from a restart."""
        was_healthy = self.engine.health()
        while not self._stop.wait(poll_s):
            healthy = self.engine.health()
            if healthy and (not was_healthy or self.applier.stale):
                if not was_healthy:
                    self.status.engine_restarts += 1
                try:
                    with self._lock:
                        applied = self.applier.reapply()
                        if applied is not None:
                            self.status.version = applied.header.version
                            self.status.reapplied += 1
                            log.info("engine restarted; re-applied v%s", self.status.version)
                except Exception as exc:
                    self.status.last_error = f"re-apply after engine restart: {exc}"
                    log.error(self.status.last_error)
                    healthy = False  # try again on the next poll
            self.status.engine_healthy = healthy
            was_healthy = healthy

    def stop(self) -> None:
        self._stop.set()


def _fmt(seconds: dict[str, float]) -> str:
    return " ".join(f"{k}={v * 1000:.0f}ms" for k, v in seconds.items())


class StatusServer(JsonHttpServer):
    def __init__(self, sidecar: Sidecar, port: int, host: str = "0.0.0.0"):
        status = sidecar.status

        def healthz() -> tuple[int, dict]:  # ready to generate from: up and on the newest weights
            body = {"ok": status.in_sync, "version": status.version,
                    "incarnation": status.incarnation}  # fmt: skip
            return (200 if status.in_sync else 503), body

        routes = {"/status": lambda: (200, status.to_json()), "/healthz": healthz}
        super().__init__(routes, port, host)
        self.start()


def make_engine(job: LoRARLJob, url: str, adapter_root: Path) -> RolloutEngine:
    if job.spec.rollout.engine == "vllm":
        from lorarl.rollout.vllm_engine import VLLMEngine, checkpoint_weight_shapes

        return VLLMEngine(
            url,
            api_key=os.environ.get(ENGINE_API_KEY_ENV),
            shm_dir=adapter_root / "merged",
            known_shapes=checkpoint_weight_shapes(job.spec.model.path),
        )
    from lorarl.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(url, api_key=os.environ.get(ENGINE_API_KEY_ENV))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorarl.rollout.sidecar")
    parser.add_argument("--config", default=os.environ.get("LORARL_CONFIG"))
    parser.add_argument("--engine-timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    # A native crash still names its stack. (No __stderr__: faulthandler's default, sys.stderr.)
    faulthandler.enable(sys.__stderr__ or sys.stderr, all_threads=True)
    logging.basicConfig(level=os.environ.get("LORARL_LOG_LEVEL", "INFO"),
                        format="%(asctime)s sidecar %(levelname)s %(message)s")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.config:
        print("lorarl-sidecar: error: --config (or LORARL_CONFIG) is required", file=sys.stderr)
        return 2
    from lorarl.api.validation import ManifestError, load_job_file
    from lorarl.sync.auth import key_from_env
    from lorarl.sync.transport import SyncReceiver, backend_from_env

    try:
        job = load_job_file(args.config)
    except ManifestError as exc:
        print(f"lorarl-sidecar: error: {args.config}: {exc}", file=sys.stderr)
        return 2
    try:
        sync_key = key_from_env()  # before waiting for the engine: no key, no start
    except SyncKeyMissing as exc:
        print(f"lorarl-sidecar: error: {exc}", file=sys.stderr)
        return 2
    env = os.environ
    adapter_root = Path(env.get("LORARL_ADAPTER_DIR", "/dev/shm/lorarl")) / job.name
    engine = make_engine(job, env["LORARL_ENGINE_URL"], adapter_root)
    applier = UpdateApplier(
        engine,
        job.spec.model.path,
        job.spec.rollout.sync_mode,
        expected_rank=rank_here(job.spec.lora),  # None: the adapter's, not here
        engine_dtype=job.spec.model.dtype,
        adapter_root=adapter_root,
    )
    log.info("waiting for the engine at %s", env["LORARL_ENGINE_URL"])
    engine.wait_ready(args.engine_timeout)
    index = int(env["LORARL_ROLLOUT_INDEX"])
    sidecar = Sidecar(applier, None, engine)
    sidecar.status.replica = f"rollout-{index}"
    sidecar.status.engine_healthy = True
    # Up before registering, answering for no registration until there is one: the trainer
    # counts a member live only when this answers as the registration it read.
    server = StatusServer(sidecar, int(env.get("LORARL_SIDECAR_PORT", "8001")))
    receiver = SyncReceiver(
        env["LORARL_SYNC_ADDR"],
        int(env["LORARL_SYNC_PORT"]),
        index,
        backend=backend_from_env(env),  # the plan's choice: the trainer uses the same
        timeout=float(env.get("LORARL_SYNC_TIMEOUT", "600")),
        key=sync_key,
        engine_url=env.get("LORARL_ADVERTISED_ENGINE_URL", ""),
        sidecar_url=env.get("LORARL_ADVERTISED_SIDECAR_URL", ""),
    )
    sidecar.receiver = receiver
    sidecar.status.incarnation = receiver.registration.incarnation
    # Deleted or scaled away (SIGTERM): deregister so the trainer drops this replica at once.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    threading.Thread(target=sidecar.watch_engine, daemon=True).start()
    closed = False
    try:
        while sidecar.handle_one():
            pass
        closed = True
    finally:
        sidecar.stop()
        server.stop()
        if closed:
            receiver.close()
        else:
            receiver.leave()
    log.info("trainer closed the sync channel; exiting")
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
