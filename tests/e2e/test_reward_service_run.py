"""A local run scored by the Ray Serve reward service: the plan's reward role starts the service,
the trainer waits for it and scores every step over HTTP, the reward rises, and no Ray process
outlives the run. If the service dies mid-run, the run fails naming it instead of training on
zeros.
"""

from __future__ import annotations

import functools
import os
import signal
import statistics
import time
from pathlib import Path

import pytest

from harness.workloads.local_jobs import hf_engine, letter_job, read_history
from lorarl.local import LocalRun, RunFailed
from lorarl.local.ports import free_port
from lorarl.local.runner import ray_temp_fits
from lorarl.rewards.service.client import RewardServiceClient, RewardServiceError, ScoreSample
from lorarl.trainer.generation.rewards import score_remote, wait_for_reward_service

SERVICE = {"function": "regex_match", "params": {"metadata_key": "pattern"}}


def service_job(tmp_path: Path, **overrides):
    return letter_job(tmp_path, reward={**SERVICE, "service": {"replicas": 1}}, **overrides)


def ray_pids(ray_dir: Path, pgid: int) -> set[int]:
    """Live processes in the reward child's group or whose command line names its Ray dir."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            in_group = os.getpgid(int(entry.name)) == pgid
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and (in_group or str(ray_dir) in cmdline):
            found.add(int(entry.name))
    return found


def wait_gone(ray_dir: Path, pgid: int, timeout: float = 10.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := ray_pids(ray_dir, pgid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def score_requests_logged(run: LocalRun) -> int:
    """Successful `POST /score` requests in Serve's access logs (kept under the run dir)."""
    roots = [run.run_dir / "logs" / "ray", *run.run_dir.glob("tmp/session_2*/logs")]
    count = 0
    for root in roots:
        for path in root.glob("serve/proxy_*.log"):
            count += sum("POST /score 200" in line for line in path.read_text().splitlines())
    return count


@pytest.mark.slow
def test_a_run_scored_by_the_reward_service_learns(tmp_path: Path):
    job = service_job(tmp_path)
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        reward = next(c for c in run.children if c.name == "learn-reward-0-reward")
        ray_dir, pgid = run.ray_temp_dir, reward.pid
        result = run.wait(timeout_s=900)
        assert ray_pids(ray_dir, pgid), "the reward service's Ray processes should be running"
    assert result.progress is not None and result.progress.phase == "Succeeded"
    # Stopping the run stops the service and its whole local Ray instance.
    assert wait_gone(ray_dir, pgid) == set()
    assert not ray_dir.exists() or ray_dir.is_relative_to(run.run_dir)

    history = read_history(tmp_path / "run")
    assert [h["step"] for h in history] == list(range(1, 31))
    r = [h["rewardMean"] for h in history]
    first, last = statistics.mean(r[:5]), statistics.mean(r[-5:])
    assert last > first + 0.1, f"reward did not rise: first five {r[:5]}, last five {r[-5:]}"
    assert all(h["rewardSeconds"] > 0 for h in history)

    service_log = (tmp_path / "run" / "logs" / "learn-reward-0-reward.log").read_text()
    assert "reward service ready on" in service_log and "READY http://" in service_log
    # Each step's batch (8 prompts x 8 samples, one request) went through Serve's HTTP proxy.
    assert score_requests_logged(run) == 30


@pytest.mark.slow
def test_the_run_fails_clearly_when_the_reward_service_dies(tmp_path: Path):
    job = service_job(tmp_path)
    job.spec.training.total_steps = 200
    engine = functools.partial(hf_engine, model=job.spec.model.path)
    killed: list[int] = []

    def kill_after_first_step(run: LocalRun) -> None:
        progress = run.progress()
        if not killed and progress is not None and (progress.step or 0) >= 1:
            reward = next(c for c in run.children if c.name == "learn-reward-0-reward")
            os.killpg(reward.pid, signal.SIGKILL)
            killed.append(progress.step)

    with LocalRun(job, tmp_path / "run", engine_command=engine) as run:
        run.start()
        ray_dir = run.ray_temp_dir
        pgid = next(c for c in run.children if c.name == "learn-reward-0-reward").pid
        with pytest.raises(RunFailed, match=r"learn-reward-0-reward exited with code -9"):
            run.wait(on_poll=kill_after_first_step, poll_s=0.2, timeout_s=900)
    assert killed
    assert wait_gone(ray_dir, pgid) == set()
    history = read_history(tmp_path / "run")
    assert len(history) <= killed[0] + 2, [h["step"] for h in history]


def test_a_dead_reward_service_fails_scoring_instead_of_scoring_zero(unused_port: int):
    url = f"http://127.0.0.1:{unused_port}"
    with RewardServiceClient(url, max_retries=1, backoff_s=0.01) as client:
        with pytest.raises(RewardServiceError, match=rf"{url} failed after 2 attempt\(s\)"):
            client.score([ScoreSample("after a", "b", None, {"pattern": "b"})])
        # The trainer's scorer waits for a service that went away (a pod restarting), and when
        # it does not come back the step fails: it never scores zero.
        start = time.monotonic()
        with pytest.raises(RewardServiceError, match=rf"{url} was not healthy .* within 0.3 s"):
            score_remote(
                client, ["after a"], ["b"], [None], [{"pattern": "b"}], outage_timeout_s=0.3
            )
        assert 0.3 <= time.monotonic() - start < 5
        with pytest.raises(RewardServiceError, match=rf"{url} was not healthy .* within 0.3 s"):
            wait_for_reward_service(client, timeout_s=0.3, poll_s=0.05)


@pytest.fixture()
def unused_port() -> int:
    return free_port()


def test_ray_temp_dir_must_leave_room_for_rays_socket_paths():
    # The longest suffix Ray adds: a session name with a 7-digit pid, then the plasma socket.
    suffix = "/session_2026-11-21_21-30-37_448123_4194304/sockets/plasma_store.1"
    longest = "/" + "x" * 36
    assert ray_temp_fits(Path(longest)) and not ray_temp_fits(Path(longest + "x"))
    assert len(longest + suffix) <= 107
