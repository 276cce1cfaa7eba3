"""Issue 34's low finding on the reward service, each part of which worked against the old code:

- `POST /score` had no authentication: anyone who reached the reward pod could make it run code
  (python_tests) and read the scores. Now every route but `/healthz` needs the job's reward key
  (`Authorization: Bearer`, compared in constant time; 401 otherwise, before the body is read),
  a service without a key does not start, and the trainer's client sends it. The key is its
  own (not the engine key, never the sync key) and reaches only the service and the trainer,
  through the environment.
- A request that timed out (504) or whose client went away kept the replica's workers scoring:
  its sandboxes ran to their own wall-clock limit and its queued samples still started, while the
  replica's next batch waited. Now the request's scoring is cancelled: sandboxes SIGKILLed, queued
  samples never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from fastapi.testclient import TestClient

from lorarl.api.validation import parse_job
from lorarl.colocate import processes
from lorarl.local import LocalRun
from lorarl.local.ports import free_port
from lorarl.operator import builders
from lorarl.plan import LocalAddressing, plan
from lorarl.rewards import get_reward
from lorarl.rewards.functions import code as code_reward
from lorarl.rewards.sandbox import run as sandbox
from lorarl.rewards.sandbox.cancel import CancelScope, ScoringCancelled
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, authorization_header
from lorarl.rewards.service.client import RewardServiceClient, RewardServiceError, ScoreSample
from lorarl.rewards.service.serve import ApiLimits, make_api, score_requests

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
KEY = "s3cret-reward-key-for-tests"
AUTH = authorization_header(KEY)

# --- the HTTP rules ------------------------------------------------------------------------------


class RecordingBackend:
    """Scores exact matches and counts how often it was asked."""

    rewards = ("exact_match",)

    def __init__(self) -> None:
        self.calls = 0

    async def score(self, reward, samples):
        self.calls += 1
        scores = [float(s["completion"] == s["groundTruth"]) for s in samples]
        return {"scores": scores, "infos": [{}] * len(samples), "batch": {"call": self.calls}}

    async def health(self):
        return {"exact_match": True}


BODY = {"samples": [{"prompt": "p", "completion": "a", "groundTruth": "a"}]}


@pytest.fixture()
def api() -> Iterator[tuple[TestClient, RecordingBackend]]:
    backend = RecordingBackend()
    limits = ApiLimits(max_body_bytes=1024 * 1024)
    with TestClient(make_api(backend, limits, api_key=KEY)) as client:
        yield client, backend


def test_score_without_a_key_is_401_and_scores_nothing(api):
    client, backend = api
    r = client.post("/score", json=BODY)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "reward key" in r.json()["detail"]
    assert backend.calls == 0


@pytest.mark.parametrize(
    "header",
    [
        {"Authorization": "Bearer not-the-key"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": "Bearer "},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"X-Api-Key": KEY},
    ],
    ids=["wrong", "longer", "prefix", "empty", "basic-scheme", "no-scheme", "other-header"],
)
def test_a_wrong_key_is_401(api, header):
    client, backend = api
    r = client.post("/score", json=BODY, headers=header)
    assert r.status_code == 401, r.text
    assert backend.calls == 0


def test_two_authorization_headers_are_refused(api):
    client, backend = api
    headers = [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")]
    r = client.post("/score", json=BODY, headers=httpx.Headers(headers))
    assert r.status_code == 401 and backend.calls == 0


def test_the_right_key_scores(api):
    client, backend = api
    r = client.post("/score", json=BODY, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["scores"] == [1.0] and backend.calls == 1
    # the scheme is case-insensitive (RFC 7235), the key is not
    r = client.post("/score", json=BODY, headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200
    r = client.post("/score", json=BODY, headers={"Authorization": f"Bearer {KEY.upper()}"})
    assert r.status_code == 401


def test_health_stays_open(api):
    client, _ = api
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_every_other_route_needs_the_key(api):
    client, _ = api
    for method, path in [
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/nope"),
        ("GET", "/score"),
        ("GET", "/healthz/"),
        ("POST", "/healthz"),
    ]:
        r = client.request(method, path)
        assert r.status_code == 401, (method, path, r.status_code)


def test_the_key_is_checked_before_the_body_is_read(api):
    client, backend = api
    huge = b"x" * (4 * 1024 * 1024)  # over max_body_bytes: 413 for a caller with the key
    r = client.post("/score", content=huge, headers={"Content-Type": "application/json"})
    assert r.status_code == 401
    r = client.post("/score", content=huge, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and backend.calls == 0


def test_an_app_without_a_key_cannot_be_built():
    with pytest.raises(Exception, match="needs its key"):
        make_api(RecordingBackend(), ApiLimits(), api_key="")


def test_the_service_does_not_start_without_a_key(tmp_path):
    job = _job_yaml(tmp_path / "job.yaml")
    env = {k: v for k, v in os.environ.items() if k != REWARD_API_KEY_ENV}
    cmd = [
        sys.executable,
        "-m",
        "lorarl.rewards.service.serve",
        "--config",
        str(job),
        "--port",
        "9",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"reward service: {REWARD_API_KEY_ENV} is not set"), last
    assert "Traceback" not in proc.stderr


# --- the trainer's client sends the key ----------------------------------------------------------


@pytest.fixture()
def live_api() -> Iterator[tuple[str, RecordingBackend]]:
    """make_api under a real uvicorn on 127.0.0.1, so the client's own headers are what count."""
    backend = RecordingBackend()
    port = free_port()
    config = uvicorn.Config(
        make_api(backend, ApiLimits(), api_key=KEY), host="127.0.0.1", port=port, log_level="error"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield url, backend
    server.should_exit = True
    thread.join(10)


def test_the_client_sends_the_key_from_the_trainers_environment(live_api, monkeypatch):
    url, backend = live_api
    sample = ScoreSample("p", "a", "a")
    monkeypatch.setenv(REWARD_API_KEY_ENV, KEY)
    with RewardServiceClient(url, max_retries=0) as client:
        assert [r.score for r in client.score([sample])] == [1.0]
    assert backend.calls == 1
    wrong = RewardServiceClient(url, max_retries=0, api_key="wrong")
    with wrong, pytest.raises(RewardServiceError, match=r"HTTP 401.*is not the service's"):
        wrong.score([sample])
    monkeypatch.delenv(REWARD_API_KEY_ENV)
    with RewardServiceClient(url, max_retries=3, backoff_s=5) as client:
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match=rf"HTTP 401.*{REWARD_API_KEY_ENV} is not set"):
            client.score([sample])
        assert time.monotonic() - start < 3  # a 401 is not retried
        assert client.healthy()  # the readiness wait needs no key
    assert backend.calls == 1


# --- who gets the key ----------------------------------------------------------------------------


EXTERNAL = {"url": "http://rewards.example:8000"}


def _job(service: dict | None = None):
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["reward"]["service"] = {} if service is None else service
    if service is not None and "url" in service:
        doc["spec"]["reward"]["params"] = {}  # an external service takes no params
    return parse_job(doc)


def _secret_refs(pod: dict) -> dict[str, set[str]]:
    return {
        c["name"]: {
            e["valueFrom"]["secretKeyRef"]["key"]
            for e in c["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        for c in pod["spec"]["containers"]
    }


def test_the_reward_key_reaches_the_reward_service_and_the_trainer_only():
    job = _job()
    p = plan(job)
    secret = builders.engine_key_secret(p, "engine", "sync", "reward")
    assert secret["stringData"] == {"api-key": "engine", "sync-key": "sync", "reward-key": "reward"}
    with pytest.raises(ValueError, match="reward key: must not be empty"):
        builders.engine_key_secret(p, "engine", "sync", "")
    refs = {role: _secret_refs(builders.pod(p, job, role, 0)) for role in ("trainer", "rollout")}
    refs["reward"] = _secret_refs(builders.pod(p, job, "reward", 0))
    assert refs == {
        "trainer": {"trainer": {"api-key", "sync-key", "reward-key"}},
        "rollout": {"engine": {"api-key"}, "sidecar": {"api-key", "sync-key"}},
        # untrusted code: its own key only, never the engine or sync key
        "reward": {"reward": {"reward-key"}},
    }
    reward_env = builders.pod(p, job, "reward", 0)["spec"]["containers"][0]["env"]
    assert {e["name"] for e in reward_env if "valueFrom" in e} == {REWARD_API_KEY_ENV}


def test_a_job_with_an_external_service_gives_nobody_a_reward_key():
    job = _job(EXTERNAL)
    p = plan(job)
    for role in ("trainer", "rollout"):
        for keys in _secret_refs(builders.pod(p, job, role, 0)).values():
            assert "reward-key" not in keys


def test_colocated_engine_and_sidecar_processes_drop_the_reward_key():
    spec = json.dumps(
        [
            {"name": "engine", "command": ["python", "-c", "pass"], "env": {}},
            {"name": "sidecar", "command": ["python", "-c", "pass"], "env": {}},
            {"name": "trainer", "command": ["python", "-c", "pass"], "env": {}},
        ]
    )
    procs = processes(spec, {REWARD_API_KEY_ENV: KEY, "PATH": "/usr/bin"})
    assert {p.name: p.env.get(REWARD_API_KEY_ENV) for p in procs} == {
        "engine": None,
        "sidecar": None,
        "trainer": KEY,
    }


def test_a_local_run_passes_the_reward_key_through_the_environment_only(tmp_path, monkeypatch):
    monkeypatch.setenv(REWARD_API_KEY_ENV, "a-key-in-the-users-shell")
    monkeypatch.setenv("LORARL_ENGINE_API_KEY", "an-engine-key-in-the-users-shell")
    run = LocalRun(_job(), tmp_path / "run")
    run.run_dir.mkdir()
    run.plan = plan(run.job, LocalAddressing(30000))
    children = {
        f"{r.role}-{c.name}": run._child(r, c)
        for role in run.plan.roles
        for r in role.replicas
        for c in r.containers
    }
    key = run.reward_api_key
    assert len(key) >= 32 and key not in (run.engine_api_key, run.sync_key)
    have = {name: child.env.get(REWARD_API_KEY_ENV) for name, child in children.items()}
    assert have == {
        "trainer-trainer": key,
        "rollout-engine": None,
        "rollout-sidecar": None,
        "reward-reward": key,
    }
    reward = children["reward-reward"]
    assert "LORARL_ENGINE_API_KEY" not in reward.env and "LORARL_SYNC_KEY" not in reward.env
    for child in children.values():
        assert not any(key in arg for arg in child.argv), child.name


def test_the_plan_refuses_a_reward_key_in_user_env_unless_the_service_is_external():
    doc = yaml.safe_load(QUICKSTART.read_text())
    doc["spec"]["reward"]["service"] = {}
    doc["spec"]["trainer"]["env"] = [{"name": REWARD_API_KEY_ENV, "value": "mine"}]
    with pytest.raises(ValueError, match=f"spec.trainer.env: {REWARD_API_KEY_ENV} is set by"):
        plan(parse_job(doc))
    doc["spec"]["reward"]["service"] = EXTERNAL
    doc["spec"]["reward"]["params"] = {}
    plan(parse_job(doc))  # the key of an external service is the job author's to give
    doc["spec"]["rollout"]["env"] = [{"name": REWARD_API_KEY_ENV, "value": "mine"}]
    with pytest.raises(ValueError, match=f"spec.rollout.env: {REWARD_API_KEY_ENV} is set by"):
        plan(parse_job(doc))


# --- cancelled scoring, in process ---------------------------------------------------------------

LOOP = "while True:\n    pass"
GOOD = "print(int(input()) + 1)"
IO_TESTS = json.dumps([{"input": "1\n", "output": "2\n"}, {"input": "5\n", "output": "6\n"}])


def _io_sample(completion: str) -> dict:
    return {"prompt": "add one", "completion": completion, "groundTruth": IO_TESTS, "metadata": {}}


def _sandbox_pids(root: int | None = None) -> set[int]:
    """Live bubblewrap processes (a sandbox's outer process and its namespace's init) among the
    descendants of `root` (default: this process)."""
    children: dict[int, list[int]] = {}
    comm: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2 :].split()
        if rest[0] != "Z":
            children.setdefault(int(rest[1]), []).append(int(entry.name))
            comm[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found, todo = set(), [os.getpid() if root is None else root]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if comm.get(child) == "bwrap":
                found.add(child)
    return found


@pytest.fixture()
def launches(monkeypatch) -> list[float]:
    """When each sandbox was launched (sandbox.launch wrapped)."""
    started: list[float] = []
    real = sandbox.launch

    def counting(*args, **kwargs):
        started.append(time.monotonic())
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox, "launch", counting)
    return started


def test_cancelling_a_request_kills_its_sandboxes_and_skips_its_queued_samples(launches):
    assert code_reward.python_tests  # registered
    reward = get_reward("python_tests", timeout_seconds=30, test_timeout_seconds=30)
    hostile, other = CancelScope(), CancelScope()
    requests = [[_io_sample(LOOP)] * 3, [_io_sample(GOOD)]]
    with ThreadPoolExecutor(1) as pool:  # one worker: the hostile samples hold it in turn
        start = time.monotonic()
        threading.Timer(1.5, hostile.cancel, ("the caller went away",)).start()
        probe: list[set[int]] = []
        threading.Timer(1.0, lambda: probe.append(_sandbox_pids())).start()
        out = score_requests(reward, requests, pool, [hostile, other])
        took = time.monotonic() - start
    assert probe and probe[0], "a sandbox should have been running before the cancel"
    assert isinstance(out[0], ScoringCancelled) and "the caller went away" in str(out[0])
    assert [r.score for r in out[1]] == [1.0]  # the other request in the batch is unharmed
    # Old behaviour: 30 s per case. Now: the running sandbox is killed at 1.5 s and the hostile
    # request's other samples and cases never start; only the other request's two cases run.
    assert took < 10, took
    assert len(launches) == 3, launches  # 1 hostile case + the other request's 2 cases
    assert _sandbox_pids() == set()
    assert hostile.live == 0 and other.live == 0


def test_a_cancelled_scope_starts_no_sandbox(launches):
    scope = CancelScope()
    scope.cancel("deadline passed")
    with scope.active(), pytest.raises(ScoringCancelled, match="deadline passed"):
        sandbox.run_python("print(1)")
    assert launches == []
    # a scope's deadline cancels it on its own
    late = CancelScope(deadline=time.monotonic() - 1)
    with late.active(), pytest.raises(ScoringCancelled):
        sandbox.run_python("print(1)")
    assert launches == []
    with CancelScope().active():
        assert sandbox.run_python("print(1)").stdout == "1\n"
    assert len(launches) == 1


def test_cancel_while_a_sandbox_runs_returns_at_once_and_leaves_nothing(launches):
    scope = CancelScope()
    limits = sandbox.SandboxLimits(wall_seconds=30, cpu_seconds=30)
    threading.Timer(0.8, scope.cancel, ("test",)).start()
    start = time.monotonic()
    with scope.active():
        result = sandbox.run_python(LOOP, limits=limits)
    assert time.monotonic() - start < 5
    assert result.status == "killed" and result.reason == "cancelled: test"
    assert _sandbox_pids() == set() and scope.live == 0


# --- the real service (Ray Serve): auth through its proxy, cancel on timeout and disconnect ------


def _job_yaml(path: Path, timeout_s: float = 6) -> Path:
    job = yaml.safe_load(QUICKSTART.read_text())
    job["spec"]["reward"] = {
        "function": "python_tests",
        "params": {"timeout_seconds": 60, "test_timeout_seconds": 60, "memory_mb": 256},
        "service": {"replicas": 1, "timeoutSeconds": timeout_s},
    }
    path.write_text(yaml.safe_dump(job))
    return path


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    ray_dir: str
    log: Path


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[Service]:
    run = tmp_path_factory.mktemp("reward-auth")
    ray_dir = tempfile.mkdtemp(prefix="lr-ray-")
    port = free_port()
    log = run / "service.log"
    cmd = [
        sys.executable, "-m", "lorarl.rewards.service.serve",
        "--config", str(_job_yaml(run / "job.yaml")),
        "--port", str(port), "--host", "127.0.0.1", "--ray-temp-dir", ray_dir,
        "--num-cpus", "2", "--workers", "1",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env={**os.environ, REWARD_API_KEY_ENV: KEY},
        )
    svc = Service(f"http://127.0.0.1:{port}", proc, ray_dir, log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"reward service did not come up:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{svc.url}/healthz", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield svc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _wait_no_sandboxes(svc: Service, timeout: float) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := _sandbox_pids(svc.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _good_is_served_promptly(svc: Service) -> float:
    start = time.monotonic()
    r = httpx.post(
        f"{svc.url}/score", json={"samples": [_io_sample(GOOD)]}, headers=AUTH, timeout=60
    )
    assert r.status_code == 200 and r.json()["scores"] == [1.0], r.text
    return time.monotonic() - start


@pytest.mark.slow
def test_the_running_service_needs_the_key(service):
    url = f"{service.url}/score"
    body = {"samples": [_io_sample(GOOD)]}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(url, json=body, headers=wrong, timeout=30).status_code == 401
    assert httpx.get(f"{service.url}/healthz", timeout=30).status_code == 200
    r = httpx.post(url, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["scores"] == [1.0]
    assert KEY not in " ".join(service.proc.args)  # it came through the environment


@pytest.mark.slow
def test_a_timed_out_request_stops_its_scoring(service):
    """The service's deadline is 6 s and a case may run 60 s: after the 504 the sandbox is gone
    and the next request does not wait behind the hostile one."""
    body = {"samples": [_io_sample(LOOP)] * 3}
    with ThreadPoolExecutor(1) as ex:
        start = time.monotonic()
        pending = ex.submit(httpx.post, f"{service.url}/score", json=body, headers=AUTH, timeout=60)
        time.sleep(3)
        assert _sandbox_pids(service.proc.pid), "the hostile sample should be running"
        r = pending.result()
    assert r.status_code == 504 and "longer than 6 s" in r.text, r.text
    assert time.monotonic() - start < 15
    assert _wait_no_sandboxes(service, 5) == set()
    assert _good_is_served_promptly(service) < 10


@pytest.mark.slow
def test_a_client_that_goes_away_stops_its_scoring(service):
    """The client gives up after 1.5 s, well before the service's 6 s deadline: its sandbox is
    killed then, not at the deadline."""
    body = {"samples": [_io_sample(LOOP)] * 3}

    running: list[set[int]] = []

    async def fire_and_leave():
        async with httpx.AsyncClient(headers=AUTH) as client:
            post = asyncio.create_task(client.post(f"{service.url}/score", json=body, timeout=1.5))
            await asyncio.sleep(1.0)
            running.append(_sandbox_pids(service.proc.pid))
            with contextlib.suppress(httpx.TimeoutException):
                await post

    start = time.monotonic()
    asyncio.run(fire_and_leave())
    assert running[0], "the hostile sample should be running when the client leaves"
    left = _wait_no_sandboxes(service, 2.5)
    assert left == set(), f"sandboxes {left} still run {time.monotonic() - start:.1f} s in"
    assert time.monotonic() - start < 5.5  # before the service's own deadline could act
    assert _good_is_served_promptly(service) < 10
