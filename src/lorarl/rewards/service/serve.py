"""The reward service: one batched Ray Serve deployment per reward behind a FastAPI ingress.

    python -m lorarl.rewards.service.serve --config job.yaml --port 8000

HTTP API (what `lorarl.rewards.service.client` speaks):
- `POST /score` `{"reward": name?, "samples": [{prompt, completion, groundTruth, metadata}]}`
  -> `{"reward", "scores", "infos", "batch": {replica, call, requests, samples}}`. `batch` tells
  which reward-function call scored the request, so batching is observable from outside.
  413: body or sample count over the limit; 404: unknown reward; 422: malformed samples or the
  reward raised on them (not worth retrying); 504: over the per-request timeout; 503: no
  replica could serve it.
- `GET /healthz`: 200 when every reward deployment answers, else 503.

Every route but `/healthz` needs `Authorization: Bearer <key>` with the job's reward key
(`LORARL_REWARD_API_KEY`, from the environment only; `lorarl.rewards.service.auth`): 401 otherwise,
checked before the body is read. Without the key the service does not start.

A request's scoring is cancelled when its deadline (`spec.reward.service.timeoutSeconds`) passes
or its caller goes away (the HTTP client disconnected, the ingress gave up): its sandboxes are
SIGKILLed and its samples not yet started never start (`lorarl.rewards.sandbox.cancel`), so a slow
or
hostile sample does not keep the replica's workers busy after its answer was a 504.

Requests from concurrent callers are merged by `@serve.batch`, so a reward with a batched path
(`score_batch`, e.g. a reward model) runs one forward per batch; per-sample rewards (sandboxes)
run on a thread pool inside the replica. `max_ongoing_requests` is raised well above Serve's
default of 5, which collapses under concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lorarl.rewards.registry import BoundReward, RewardResult, get_reward, to_result
from lorarl.rewards.sandbox.cancel import CancelScope, ScoringCancelled
from lorarl.rewards.service.auth import (
    REWARD_API_KEY_ENV,
    BearerAuth,
    RewardKeyMissing,
    service_key,
)

__all__ = [
    "ApiLimits",
    "BatchSettings",
    "RewardTarget",
    "ScoreBackend",
    "build_app",
    "deployment_options",
    "main",
    "make_api",
    "score_requests",
    "targets_from_specs",
]

log = logging.getLogger("lorarl.rewards.service.serve")

APP_NAME = "rewards"
GRACEFUL_SHUTDOWN_S = 10.0  # in-flight batches get this long to finish on shutdown


# ---------------------------------------------------------------- configuration (pure)


@dataclass(frozen=True)
class RewardTarget:
    """One reward to serve: a registry spec (name or module:function) and its params."""

    name: str
    spec: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchSettings:
    max_batch_size: int = 64
    batch_wait_timeout_s: float = 0.01
    max_ongoing_requests: int = 256
    workers: int = 4  # threads scoring per-sample rewards inside one replica


@dataclass(frozen=True)
class ApiLimits:
    max_samples_per_request: int = 4096
    max_body_bytes: int = 64 * 1024 * 1024
    request_timeout_s: float = 60.0


def targets_from_specs(specs: Mapping[str, Any]) -> dict[str, RewardTarget]:
    """name -> RewardSpec (function/entrypoint + params) to targets; one job has one reward
    today (`{name: job.spec.reward}`), a multi-reward config passes several."""
    targets = {}
    for name, spec in specs.items():
        source = spec.function or spec.entrypoint
        if not source:
            raise ValueError(f"reward {name!r}: set exactly one of function or entrypoint")
        targets[name] = RewardTarget(name=name, spec=source, params=dict(spec.params))
    if not targets:
        raise ValueError("the reward service needs at least one reward")
    return targets


def deployment_options(
    service: Any | None, batch: BatchSettings, cpus_per_replica: float
) -> dict[str, Any]:
    """Serve options for one reward deployment from `spec.reward.service`: autoscaling between
    `replicas` and `maxReplicas` when they differ, a fixed replica count otherwise."""
    replicas = service.replicas if service is not None else 1
    max_replicas = service.max_replicas if service is not None else None
    if max_replicas is not None and max_replicas < replicas:
        raise ValueError(
            f"spec.reward.service.maxReplicas ({max_replicas}) must be >= replicas ({replicas})"
        )
    if batch.max_ongoing_requests < batch.max_batch_size:
        raise ValueError(
            f"max_ongoing_requests ({batch.max_ongoing_requests}) must be >= max_batch_size "
            f"({batch.max_batch_size}) or batches can never fill"
        )
    options: dict[str, Any] = {
        "max_ongoing_requests": batch.max_ongoing_requests,
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        "max_constructor_retry_count": 3,  # a bad reward config fails the same way every time
        "ray_actor_options": {"num_cpus": cpus_per_replica},
    }
    if max_replicas is not None and max_replicas > replicas:
        options["autoscaling_config"] = {
            "min_replicas": replicas,
            "initial_replicas": replicas,
            "max_replicas": max_replicas,
            # one replica should hold about half a full batch before another is added
            "target_ongoing_requests": max(2, batch.max_batch_size // 2),
        }
    else:
        options["num_replicas"] = replicas
    return options


def cpus_per_replica(total_cpus: float, replica_slots: int) -> float:
    """Share the local Ray instance's CPUs so every replica (up to maxReplicas) can be placed."""
    return max(0.01, min(1.0, round(total_cpus / max(1, replica_slots), 2)))


# ---------------------------------------------------------------- scoring (pure-ish)


def _register_service_rewards() -> None:
    # The sandbox and reward-model rewards live outside the registry's built-in modules.
    from lorarl.rewards.functions import code, reward_model  # noqa: F401


def score_requests(
    reward: BoundReward,
    requests: Sequence[Sequence[Mapping[str, Any]]],
    pool: ThreadPoolExecutor,
    scopes: Sequence[CancelScope | None] | None = None,
) -> list[list[RewardResult] | Exception]:
    """Score a batch of requests; a failing sample fails only its own request.

    `scopes`: one per request (or None); a request whose scope is cancelled gets
    `ScoringCancelled`, its running sandboxes killed and its other samples not started."""
    scopes = list(scopes) if scopes is not None else [None] * len(requests)
    if len(scopes) != len(requests):
        raise ValueError(f"{len(scopes)} cancel scopes for {len(requests)} requests")
    flat = [(s, scope) for r, scope in zip(requests, scopes, strict=True) for s in r]
    outcomes = _score_flat(reward, flat, pool)
    results: list[list[RewardResult] | Exception] = []
    start = 0
    for req, scope in zip(requests, scopes, strict=True):
        part = outcomes[start : start + len(req)]
        start += len(req)
        if scope is not None and scope.cancelled:
            results.append(ScoringCancelled(f"scoring cancelled: {scope.reason}"))
            continue
        failure = next(((i, o) for i, o in enumerate(part) if isinstance(o, Exception)), None)
        if failure is None:
            results.append(part)  # type: ignore[arg-type]
        else:
            i, exc = failure
            results.append(
                ValueError(
                    f"reward {reward.name!r} failed on sample {i}: {type(exc).__name__}: {exc}"
                )
            )
    return results


_Item = tuple[Mapping[str, Any], CancelScope | None]


def _score_flat(
    reward: BoundReward, items: Sequence[_Item], pool: ThreadPoolExecutor
) -> list[RewardResult | Exception]:
    batched = getattr(reward.fn, "score_batch", None)
    live = [i for i, (_, scope) in enumerate(items) if scope is None or not scope.cancelled]
    if batched is not None and live:
        samples = [items[i][0] for i in live]
        try:  # one in-process call (a model forward): not interruptible once started
            out = batched(
                [s["prompt"] for s in samples],
                [s["completion"] for s in samples],
                [s["groundTruth"] for s in samples],
                [s["metadata"] for s in samples],
            )
            results: list[RewardResult | Exception] = [
                ScoringCancelled("scoring cancelled before it started")
            ] * len(items)
            for i, v in zip(live, out, strict=True):
                results[i] = to_result(v, reward.name)
            return results
        except Exception:  # find the culprit sample(s) one by one
            log.debug("batched %s failed; retrying sample by sample", reward.name, exc_info=True)
    return list(pool.map(lambda item: _score_one(reward, *item), items))


def _score_one(
    reward: BoundReward, s: Mapping[str, Any], scope: CancelScope | None = None
) -> RewardResult | Exception:
    if scope is None:
        try:
            value = reward(s["prompt"], s["completion"], s["groundTruth"], s["metadata"])
            return to_result(value, reward.name)
        except Exception as exc:
            return exc
    try:
        scope.check()  # queued behind other samples: a cancelled request's never start
        with scope.active():  # every sandbox this sample starts is killed on cancel
            value = reward(s["prompt"], s["completion"], s["groundTruth"], s["metadata"])
        scope.check()  # cancelled meanwhile: whatever it scored is not an answer
        return to_result(value, reward.name)
    except ScoringCancelled as exc:
        return exc
    except Exception as exc:
        return ScoringCancelled(f"scoring cancelled: {scope.reason}") if scope.cancelled else exc


# ---------------------------------------------------------------- HTTP API


class WireSample(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    prompt: str = ""
    completion: str
    ground_truth: str | None = Field(default=None, alias="groundTruth")
    metadata: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: str | None = None
    samples: list[WireSample]


class ScoreBackend(Protocol):
    rewards: Sequence[str]

    async def score(self, reward: str, samples: list[dict[str, Any]]) -> dict[str, Any]: ...

    async def health(self) -> dict[str, bool]: ...


class _HttpError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


def make_api(backend: ScoreBackend, limits: ApiLimits, *, api_key: str) -> FastAPI:
    """The FastAPI app; the backend is Serve handles in production, a fake in unit tests.
    Every route but `/healthz` needs `Authorization: Bearer <api_key>`."""
    if not api_key:
        raise RewardKeyMissing("the reward service needs its key (make_api(api_key=...))")
    app = FastAPI(title="lorarl reward service", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BearerAuth, key=api_key)

    @app.exception_handler(_HttpError)
    async def _http_error(_: Request, exc: _HttpError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        try:
            states = await asyncio.wait_for(backend.health(), timeout=limits.request_timeout_s)
        except asyncio.TimeoutError:
            states = dict.fromkeys(backend.rewards, False)
        ok = bool(states) and all(states.values())
        body = {"status": "ok" if ok else "unavailable", "rewards": states}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        doc = await _read_json(request, limits.max_body_bytes)
        n = len(doc.get("samples") or []) if isinstance(doc, dict) else 0
        if n > limits.max_samples_per_request:
            raise _HttpError(
                413, f"{n} samples in one request; the limit is {limits.max_samples_per_request}"
            )
        try:
            req = ScoreRequest.model_validate(doc)
        except ValidationError as exc:
            raise _HttpError(422, _validation_message(exc)) from exc
        name = _pick_reward(req.reward, backend.rewards)
        samples = [s.model_dump(by_alias=True) for s in req.samples]
        if not samples:
            return JSONResponse({"reward": name, "scores": [], "infos": []})
        try:
            out = await asyncio.wait_for(
                backend.score(name, samples), timeout=limits.request_timeout_s
            )
        except asyncio.TimeoutError as exc:
            raise _HttpError(
                504, f"scoring took longer than {limits.request_timeout_s:g} s"
            ) from exc
        except _HttpError:
            raise
        except Exception as exc:  # a replica died or Serve refused: worth a retry
            raise _HttpError(
                503, f"reward {name!r} unavailable: {type(exc).__name__}: {exc}"
            ) from exc
        if "cancelled" in out:  # the replica's own deadline passed first
            raise _HttpError(504, out["cancelled"])
        if "error" in out:
            raise _HttpError(422, out["error"])
        return JSONResponse({"reward": name, **out})

    return app


async def _read_json(request: Request, max_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _HttpError(413, f"request body of {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _HttpError(413, f"request body over the limit of {max_bytes} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError as exc:
        raise _HttpError(400, f"request body is not valid JSON: {exc}") from exc


def _pick_reward(requested: str | None, known: Sequence[str]) -> str:
    if requested is None:
        if len(known) == 1:
            return known[0]
        raise _HttpError(400, f"several rewards are served; name one of: {', '.join(known)}")
    if requested not in known:
        raise _HttpError(404, f"unknown reward {requested!r}; served: {', '.join(known)}")
    return requested


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


# ---------------------------------------------------------------- Serve deployments
# The deployment classes are built by functions so that importing this module (for the HTTP
# rules, the config helpers or the CLI's --help) does not import Ray.


def build_app(
    targets: Mapping[str, RewardTarget],
    service: Any | None = None,
    *,
    batch: BatchSettings | None = None,
    limits: ApiLimits | None = None,
    total_cpus: float = 2.0,
    api_key: str,
) -> Any:
    """The Serve application: an ingress plus one deployment per reward. `api_key`: what every
    request but `/healthz` must carry (the ingress replica gets it as an argument, in Ray's
    object store: it never appears on a command line)."""
    from ray import serve

    if not api_key:
        raise RewardKeyMissing("the reward service needs its key (build_app(api_key=...))")

    batch = batch or BatchSettings()
    limits = limits or ApiLimits()
    slots = len(targets) * ((service.max_replicas or service.replicas) if service else 1)
    options = deployment_options(service, batch, cpus_per_replica(total_cpus, slots))
    # deployment()(cls), not deployment(cls): the same Deployment, in the form Ray annotates.
    reward_cls = serve.deployment()(_reward_deployment_class())
    ingress_cls = serve.deployment()(serve.ingress()(_ingress_class()))
    handles = {
        name: reward_cls.options(name=_deployment_name(name), **options).bind(target, batch)
        for name, target in targets.items()
    }
    return ingress_cls.options(
        name="ingress",
        max_ongoing_requests=batch.max_ongoing_requests * max(1, len(targets)),
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        graceful_shutdown_wait_loop_s=0.5,
    ).bind(handles, limits, api_key)


def _deployment_name(reward: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in reward)
    return f"reward-{safe}"


def _reward_deployment_class() -> type:
    from ray import serve

    class RewardDeployment:
        """Scores batches for one reward; `calls` counts reward-function invocations."""

        def __init__(self, target: RewardTarget, batch: BatchSettings) -> None:
            _register_service_rewards()
            bound = get_reward(target.spec, **dict(target.params))
            self.reward = BoundReward(target.name, bound.fn, bound.params)
            self.pool = ThreadPoolExecutor(max_workers=batch.workers)
            self.replica = serve.get_replica_context().replica_id.unique_id
            self.calls = 0
            # Ray documents these setters on the @serve.batch wrapper; its annotation says Callable.
            self._score_batch.set_max_batch_size(batch.max_batch_size)  # type: ignore[attr-defined]
            self._score_batch.set_batch_wait_timeout_s(batch.batch_wait_timeout_s)  # type: ignore[attr-defined]

        async def score(
            self, samples: list[dict[str, Any]], timeout_s: float | None = None
        ) -> dict[str, Any]:
            """One request: batched with others, cancelled (sandboxes killed, queued samples
            dropped) when `timeout_s` passes or the caller cancels it."""
            scope = CancelScope()
            timer = None
            if timeout_s is not None:
                timer = asyncio.get_running_loop().call_later(
                    timeout_s, scope.cancel, f"over the request's deadline of {timeout_s:g} s"
                )
            try:
                return await self._score_batch((samples, scope))
            except asyncio.CancelledError:
                scope.cancel("the caller went away (timed out or disconnected)")
                raise
            finally:
                if timer is not None:
                    timer.cancel()

        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.01)
        async def _score_batch(
            self, items: list[tuple[list[dict[str, Any]], CancelScope]]
        ) -> list[dict[str, Any]]:
            requests = [samples for samples, _ in items]
            scopes = [scope for _, scope in items]
            self.calls += 1
            meta = {
                "replica": self.replica,
                "call": self.calls,
                "requests": len(requests),
                "samples": sum(len(r) for r in requests),
            }
            outcomes = await asyncio.get_running_loop().run_in_executor(
                None, score_requests, self.reward, requests, self.pool, scopes
            )
            return [_wire_outcome(o, meta) for o in outcomes]

        def ping(self) -> bool:
            return True

    return RewardDeployment


def _wire_outcome(outcome: list[RewardResult] | Exception, meta: dict[str, Any]) -> dict[str, Any]:
    if isinstance(outcome, ScoringCancelled):
        return {"cancelled": str(outcome), "batch": meta}
    if isinstance(outcome, Exception):
        return {"error": str(outcome), "batch": meta}
    return {
        "scores": [r.score for r in outcome],
        "infos": [_jsonable(r.info) for r in outcome],
        "batch": meta,
    }


def _jsonable(info: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(info), default=str))


def _ingress_class() -> type:
    class RewardIngress:
        """HTTP front: limits, routing by reward name, per-request timeouts."""

        def __init__(self, handles: Mapping[str, Any], limits: ApiLimits, api_key: str) -> None:
            self.handles = dict(handles)
            self.rewards: Sequence[str] = sorted(self.handles)
            self.limits = limits
            self._api_key = api_key

        def __serve_build_asgi_app__(self) -> FastAPI:
            return make_api(self, self.limits, api_key=self._api_key)

        async def score(self, reward: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
            # The replica enforces the same deadline itself: its scoring stops even if this
            # cancellation never reaches it.
            response = self.handles[reward].score.remote(samples, self.limits.request_timeout_s)
            try:
                return await response
            except asyncio.CancelledError:
                # timed out here, or the HTTP client went away (Serve cancels the handler):
                # the replica cancels the request's scoring (lorarl.rewards.sandbox.cancel)
                response.cancel()
                raise

        async def health(self) -> dict[str, bool]:
            async def one(handle: Any) -> bool:
                try:
                    return bool(await asyncio.wait_for(handle.ping.remote(), timeout=5.0))
                except Exception:
                    return False

            states = await asyncio.gather(*(one(h) for h in self.handles.values()))
            return dict(zip(self.handles, states, strict=True))

    return RewardIngress


# ---------------------------------------------------------------- process entry point


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m lorarl.rewards.service.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("--config", required=True, help="the rendered LoRARLJob manifest (job.yaml)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--num-cpus", type=float, default=min(4, os.cpu_count() or 1))
    p.add_argument(
        "--ray-temp-dir",
        default=os.environ.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "lorarl-ray"),
        help="Ray's session dir root; keep it short (Ray's socket paths must fit in 107 bytes)",
    )
    d, a = BatchSettings(), ApiLimits()
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--batch-wait-timeout-s", type=float, default=d.batch_wait_timeout_s)
    p.add_argument("--max-ongoing-requests", type=int, default=d.max_ongoing_requests)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--max-samples-per-request", type=int, default=a.max_samples_per_request)
    p.add_argument("--max-body-bytes", type=int, default=a.max_body_bytes)
    return p.parse_args(argv)


def _load_reward_config(path: str) -> tuple[dict[str, RewardTarget], Any]:
    from lorarl.api.validation import ManifestError, load_documents, parse_job

    try:
        (_, doc), *rest = load_documents(path)
        if rest:
            raise ManifestError([])
        job = parse_job(doc)
    except ManifestError as exc:
        raise SystemExit(
            f"reward service: {path}: {exc or 'expected exactly one LoRARLJob'}"
        ) from exc
    reward = job.spec.reward
    name = reward.function or reward.entrypoint
    if name is None:  # the spec's rules require one of them
        raise SystemExit(f"reward service: {path}: spec.reward sets no function or entrypoint")
    return targets_from_specs({name: reward}), reward.service


def _deploy_failure(exc: Exception) -> str:
    """The replica's own error (e.g. a bad reward param) instead of Serve's generic message."""
    from ray import serve

    try:
        app = serve.status().applications[APP_NAME]
    except Exception:
        return str(exc)
    for name, dep in app.deployments.items():
        if dep.message:
            lines = [ln for ln in dep.message.strip().splitlines() if ln.strip()]
            return f"deployment {name} failed: {lines[-1] if lines else dep.message}"
    return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:  # before anything starts: never an open service
        api_key = service_key(os.environ)
    except (RewardKeyMissing, ValueError) as exc:
        raise SystemExit(f"reward service: {exc}") from exc
    # Out of the environment Ray's workers inherit (in-process rewards run there); the ingress
    # gets it as an argument.
    os.environ.pop(REWARD_API_KEY_ENV, None)
    targets, service = _load_reward_config(args.config)
    batch = BatchSettings(
        max_batch_size=args.max_batch_size,
        batch_wait_timeout_s=args.batch_wait_timeout_s,
        max_ongoing_requests=args.max_ongoing_requests,
        workers=args.workers,
    )
    limits = ApiLimits(
        max_samples_per_request=args.max_samples_per_request,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=service.timeout_seconds if service is not None else 60.0,
    )
    import ray
    from ray import serve

    os.makedirs(args.ray_temp_dir, exist_ok=True)
    ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=False,
        _temp_dir=args.ray_temp_dir,
        namespace="lorarl-reward",
        logging_level=logging.WARNING,
    )
    # After ray.init: Ray's core worker installs a C++ SIGTERM handler that would end the process
    # without shutting Serve and the local Ray instance down.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = build_app(
            targets,
            service,
            batch=batch,
            limits=limits,
            total_cpus=args.num_cpus,
            api_key=api_key,
        )
        try:
            serve.run(app, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise SystemExit(f"reward service: {_deploy_failure(exc)}") from exc
        log.info("reward service ready on %s:%d: %s", args.host, args.port, ", ".join(targets))
        print(f"READY http://{args.host}:{args.port}", flush=True)
        while not stop.wait(0.5):
            pass
        log.info("stopping the reward service")
    finally:
        # Deleting the app lets replicas finish in-flight batches (bounded by
        # graceful_shutdown_timeout_s); serve.shutdown() would add a 30 s proxy drain. The local
        # Ray instance is ours alone, so ray.shutdown() then stops every Ray process.
        try:
            serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    # Run the imported module's main, not this `__main__` copy: Ray pickles `__main__` code by
    # value, which loses the module globals FastAPI needs to resolve route annotations.
    from lorarl.rewards.service.serve import main as _main

    sys.exit(_main())
