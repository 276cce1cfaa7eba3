"""The reward service: config and HTTP rules in process, then the real Ray Serve app.

The slow part starts `python -m lorarl.rewards.service.serve` exactly as the plan's reward role
does,
scores over HTTP, and checks that SIGTERM leaves no Ray process behind.
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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from fastapi.testclient import TestClient

from lorarl.api.spec.job import RewardServiceSpec, RewardSpec
from lorarl.local.ports import free_port
from lorarl.rewards import get_reward
from lorarl.rewards.registry import BoundReward, RewardResult
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, authorization_header
from lorarl.rewards.service.serve import (
    ApiLimits,
    BatchSettings,
    RewardTarget,
    cpus_per_replica,
    deployment_options,
    make_api,
    score_requests,
    targets_from_specs,
)

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-reward-key"
AUTH = authorization_header(KEY)


# ---------------------------------------------------------------- configuration


def test_fixed_replicas_when_no_max_replicas():
    opts = deployment_options(RewardServiceSpec(replicas=3), BatchSettings(), 0.5)
    assert opts["num_replicas"] == 3 and "autoscaling_config" not in opts
    assert opts["max_ongoing_requests"] == 256  # far above Serve's default of 5
    assert opts["ray_actor_options"] == {"num_cpus": 0.5}


def test_autoscaling_between_replicas_and_max_replicas():
    spec = RewardServiceSpec(replicas=1, maxReplicas=4)
    opts = deployment_options(spec, BatchSettings(max_batch_size=32), 0.25)
    assert "num_replicas" not in opts
    assert opts["autoscaling_config"] == {
        "min_replicas": 1,
        "initial_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 16,
    }


def test_bad_replica_settings_name_the_field():
    with pytest.raises(ValueError, match=r"spec.reward.service.maxReplicas \(1\) must be >= "):
        deployment_options(
            RewardServiceSpec.model_construct(replicas=2, max_replicas=1), BatchSettings(), 1
        )
    with pytest.raises(ValueError, match=r"max_ongoing_requests .* must be >= max_batch_size"):
        deployment_options(None, BatchSettings(max_batch_size=64, max_ongoing_requests=8), 1)


def test_cpus_are_shared_between_replica_slots():
    assert cpus_per_replica(2, 1) == 1.0
    assert cpus_per_replica(2, 4) == 0.5
    assert cpus_per_replica(1, 3) == 0.33


def test_targets_from_specs():
    specs = {
        "code": RewardSpec(function="python_tests", params={"timeout_seconds": 5}),
        "mine": RewardSpec(entrypoint="my_pkg.rewards:score"),
    }
    targets = targets_from_specs(specs)
    assert targets["code"] == RewardTarget("code", "python_tests", {"timeout_seconds": 5})
    assert targets["mine"].spec == "my_pkg.rewards:score"
    with pytest.raises(ValueError, match="at least one reward"):
        targets_from_specs({})


# ---------------------------------------------------------------- scoring a batch of requests


def test_a_failing_sample_fails_only_its_request():
    reward = get_reward("exact_match")
    good = {"prompt": "", "completion": "Paris", "groundTruth": "paris", "metadata": {}}
    bad = {"prompt": "", "completion": "x", "groundTruth": None, "metadata": {}}
    with ThreadPoolExecutor(2) as pool:
        out = score_requests(reward, [[good], [good, bad], [good]], pool)
    assert [r.score for r in out[0]] == [1.0]
    assert isinstance(out[1], ValueError)
    assert "failed on sample 1" in str(out[1]) and "needs a ground truth" in str(out[1])
    assert [r.score for r in out[2]] == [1.0]


class CountingBatchReward:
    """A reward with a batched path; counts how often each path is taken."""

    def __init__(self) -> None:
        self.batch_calls, self.single_calls = 0, 0

    def score_batch(self, prompts, completions, truths, metadatas):
        self.batch_calls += 1
        if any(c == "boom" for c in completions):
            raise RuntimeError("boom")
        return [RewardResult(float(len(c))) for c in completions]

    def __call__(self, prompt, completion, ground_truth, metadata):
        self.single_calls += 1
        if completion == "boom":
            raise RuntimeError("boom")
        return float(len(completion))


def test_batched_rewards_get_one_call_per_batch_and_fall_back_to_isolate_errors():
    fn = CountingBatchReward()
    reward = BoundReward("len", fn)
    sample = {"prompt": "", "groundTruth": None, "metadata": {}}
    requests = [[{**sample, "completion": "ab"}], [{**sample, "completion": "abcd"}] * 2]
    with ThreadPoolExecutor(2) as pool:
        out = score_requests(reward, requests, pool)
        assert [[r.score for r in o] for o in out] == [[2.0], [4.0, 4.0]]
        assert (fn.batch_calls, fn.single_calls) == (1, 0)
        out = score_requests(reward, [*requests, [{**sample, "completion": "boom"}]], pool)
    assert [r.score for r in out[1]] == [4.0, 4.0] and isinstance(out[2], ValueError)
    assert (fn.batch_calls, fn.single_calls) == (2, 4)


# ---------------------------------------------------------------- HTTP rules with a fake backend


class FakeBackend:
    rewards = ("exact_match", "slow")

    def __init__(self) -> None:
        self.healthy = {"exact_match": True, "slow": True}

    async def score(self, reward, samples):
        if reward == "slow":
            await asyncio.sleep(5)
        if any(s["groundTruth"] is None for s in samples):
            return {"error": "exact_match needs a ground truth"}
        scores = [float(s["completion"] == s["groundTruth"]) for s in samples]
        return {"scores": scores, "infos": [{}] * len(samples), "batch": {"call": 1}}

    async def health(self):
        return dict(self.healthy)


@pytest.fixture()
def api():
    backend = FakeBackend()
    limits = ApiLimits(max_samples_per_request=3, max_body_bytes=2000, request_timeout_s=0.3)
    with TestClient(make_api(backend, limits, api_key=KEY), headers=AUTH) as client:
        yield client, backend


def sample(completion="a", truth="a"):
    return {"prompt": "p", "completion": completion, "groundTruth": truth}


def test_score_and_reward_selection(api):
    client, _ = api
    r = client.post("/score", json={"reward": "exact_match", "samples": [sample(), sample("b")]})
    assert r.status_code == 200
    assert r.json()["scores"] == [1.0, 0.0] and r.json()["reward"] == "exact_match"
    r = client.post("/score", json={"samples": [sample()]})
    assert r.status_code == 400 and "name one of: exact_match, slow" in r.json()["detail"]
    r = client.post("/score", json={"reward": "nope", "samples": [sample()]})
    assert r.status_code == 404 and "unknown reward 'nope'" in r.json()["detail"]
    r = client.post("/score", json={"reward": "exact_match", "samples": []})
    assert r.json() == {"reward": "exact_match", "scores": [], "infos": []}


def test_oversized_requests_get_413(api):
    client, _ = api
    r = client.post("/score", json={"reward": "exact_match", "samples": [sample()] * 4})
    assert r.status_code == 413 and "4 samples in one request; the limit is 3" in r.text
    big = {"reward": "exact_match", "samples": [sample("x" * 3000)]}
    r = client.post("/score", json=big)
    assert r.status_code == 413 and "the limit is 2000" in r.text


def test_malformed_requests_get_clear_errors(api):
    client, _ = api
    r = client.post("/score", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.text
    r = client.post("/score", json={"reward": "exact_match", "samples": [{"prompt": "p"}]})
    assert r.status_code == 422 and "samples.0.completion: Field required" in r.text
    r = client.post("/score", json={"reward": "exact_match", "samples": [sample(truth=None)]})
    assert r.status_code == 422 and "needs a ground truth" in r.text


def test_slow_scoring_gets_504(api):
    client, _ = api
    start = time.monotonic()
    r = client.post("/score", json={"reward": "slow", "samples": [sample()]})
    assert r.status_code == 504 and "longer than 0.3 s" in r.text
    assert time.monotonic() - start < 2


def test_healthz_reports_each_reward(api):
    client, backend = api
    assert client.get("/healthz").json() == {
        "status": "ok",
        "rewards": {"exact_match": True, "slow": True},
    }
    backend.healthy["slow"] = False
    r = client.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


# ---------------------------------------------------------------- reward_model


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    from harness.workloads.tiny_models import make_tokenizer, tiny_config

    path = tmp_path_factory.mktemp("rm")
    config = tiny_config("llama", layers=1, hidden=64)
    config.num_labels = 1
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


def test_reward_model_scores_match_an_unbatched_forward(classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import lorarl.rewards.functions.reward_model  # noqa: F401  (registers reward_model)

    reward = get_reward("reward_model", path=str(classifier_dir), batch_size=2)
    prompts, completions = ["1+1=", "say hi", "x"], ["2", "hello there, friend", "yz"]
    batched = reward.fn.score_batch(prompts, completions)

    tok = AutoTokenizer.from_pretrained(classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    expected = []
    for p, c in zip(prompts, completions, strict=True):
        messages = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        text = tok.apply_chat_template(messages, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            expected.append(model(**ids).logits[0, 0].item())
    assert [r.score for r in batched] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3  # the texts really are scored differently
    single = reward("say hi", "hello there, friend", None, {})
    assert single.score == pytest.approx(expected[1], abs=1e-5)


def test_reward_model_config_errors(classifier_dir, tmp_path):
    import lorarl.rewards.functions.reward_model  # noqa: F401

    with pytest.raises(ValueError, match="is not a directory with a model"):
        get_reward("reward_model", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"label_index 3 out of range 0\.\.0"):
        get_reward("reward_model", path=str(classifier_dir), label_index=3)


# ---------------------------------------------------------------- the real service (Ray Serve)

ADD_TESTS = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4"])
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "def add(a, b):\n    return a - b"
LOOP = "def add(a, b):\n    while True:\n        pass"
FORK_BOMB = "import os\nwhile True:\n    os.fork()"


@dataclass
class Service:
    url: str
    proc: subprocess.Popen
    ray_dir: str
    log: Path


def _ray_pids(ray_dir: str, pgid: int) -> set[int]:
    """Processes in the service's group or whose command line names its Ray temp dir."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            in_group = os.getpgid(pid) == pgid
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (in_group or ray_dir in cmdline):
            found.add(pid)
    return found


def _job_yaml(path: Path, **params) -> Path:
    job = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    job["spec"]["reward"] = {
        "function": "python_tests",
        "params": {"timeout_seconds": 3, "test_timeout_seconds": 1, "memory_mb": 256, **params},
        "service": {"replicas": 1, "timeoutSeconds": 30},
    }
    path.write_text(yaml.safe_dump(job))
    return path


def _start(run: Path, job: Path, *extra: str) -> Service:
    ray_dir = tempfile.mkdtemp(prefix="lr-ray-")  # short: Ray's socket paths have a length cap
    port = free_port()
    log = run / "service.log"
    cmd = [
        sys.executable, "-m", "lorarl.rewards.service.serve", "--config", str(job),
        "--port", str(port), "--host", "127.0.0.1", "--ray-temp-dir", ray_dir, "--num-cpus", "2",
        *extra,
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
    return Service(f"http://127.0.0.1:{port}", proc, ray_dir, log)


def _stop(svc: Service) -> None:
    """SIGTERM, then make sure: kill the group and anything still naming our Ray dir."""
    if svc.proc.poll() is None:
        svc.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            svc.proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(svc.proc.pid, signal.SIGKILL)
    for pid in _ray_pids(svc.ray_dir, svc.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(svc.ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    run = tmp_path_factory.mktemp("reward-service")
    svc = _start(
        run, _job_yaml(run / "job.yaml"), "--workers", "2",
        "--max-samples-per-request", "64", "--max-body-bytes", str(256 * 1024),
    )  # fmt: skip
    try:
        _wait_healthy(svc, timeout=75)
        yield svc
    finally:
        _stop(svc)


def _wait_healthy(svc: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            pytest.fail(
                f"reward service exited {svc.proc.returncode}:\n{svc.log.read_text()[-3000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{svc.url}/healthz", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"reward service not healthy after {timeout} s:\n{svc.log.read_text()[-3000:]}")


def _sample(completion: str) -> dict:
    return {"prompt": "write add", "completion": completion, "groundTruth": ADD_TESTS}


@pytest.mark.slow
def test_service_health(service):
    r = httpx.get(f"{service.url}/healthz", timeout=10)
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "rewards": {"python_tests": True}}


@pytest.mark.slow
def test_concurrent_requests_are_batched(service):
    n = 16

    async def fire():
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            body = {"samples": [_sample(GOOD), _sample(WRONG)]}
            return await asyncio.gather(
                *(client.post(f"{service.url}/score", json=body) for _ in range(n))
            )

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * n
    docs = [r.json() for r in responses]
    assert all(d["scores"] == [1.0, 0.0] for d in docs)
    assert docs[1]["infos"][1]["failures"][0]["error"].startswith("AssertionError")
    batches: dict[tuple[str, int], list[dict]] = {}
    for d in docs:
        batches.setdefault((d["batch"]["replica"], d["batch"]["call"]), []).append(d["batch"])
    assert len(batches) < n, "every request got its own reward call: no batching"
    for members in batches.values():  # each batch saw exactly the requests that report it
        assert members[0]["requests"] == len(members)
        assert members[0]["samples"] == 2 * len(members)


@pytest.mark.slow
def test_oversized_and_unknown_requests_are_refused(service):
    url = f"{service.url}/score"
    r = httpx.post(url, json={"samples": [_sample(GOOD)] * 65}, timeout=10, headers=AUTH)
    assert r.status_code == 413 and "the limit is 64" in r.json()["detail"]
    big = {"samples": [_sample("x" * (300 * 1024))]}
    r = httpx.post(url, json=big, timeout=10, headers=AUTH)
    assert r.status_code == 413 and "the limit is 262144" in r.json()["detail"]
    r = httpx.post(url, json={"reward": "nope", "samples": []}, timeout=10, headers=AUTH)
    assert r.status_code == 404


@pytest.mark.slow
def test_hostile_samples_score_zero_and_the_service_survives(service):
    from lorarl.rewards.service.client import RewardServiceClient

    samples = [_sample(LOOP), _sample(FORK_BOMB), _sample(GOOD)]
    with RewardServiceClient(service.url, timeout_s=30, max_retries=0, api_key=KEY) as client:
        results = client.score(samples)
        assert [r.score for r in results] == [0.0, 0.0, 1.0]
        assert "timed out" in results[0].info["failures"][0]["error"]
        assert results[1].info["reason"] == (
            "solution failed: PermissionError: [Errno 1] Operation not permitted"
        )
        assert client.healthy()
        assert [r.score for r in client.score([_sample(GOOD)])] == [1.0]


@pytest.mark.slow
def test_sigterm_stops_every_ray_process(service):
    pgid = service.proc.pid
    assert _ray_pids(service.ray_dir, pgid), "expected Ray processes while the service runs"
    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(45) == 0
    deadline = time.monotonic() + 10
    while _ray_pids(service.ray_dir, pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_pids(service.ray_dir, pgid) == set()


@pytest.mark.slow
def test_bad_reward_params_fail_startup_with_the_reason(tmp_path):
    svc = _start(tmp_path, _job_yaml(tmp_path / "job.yaml", memory_mb=4))
    try:
        assert svc.proc.wait(60) == 1
        last = svc.log.read_text().strip().splitlines()[-1]
        # Refused when the job is read, before any deployment starts (as `lorarl validate` does)
        assert last.startswith("reward service: ") and (
            "spec.reward.params: python_tests: memory_mb must be an integer >= 32 (got 4)" in last
        )
        assert _ray_pids(svc.ray_dir, svc.proc.pid) == set()
    finally:
        _stop(svc)
