"""Faults injected into a job on the process-kubelet cluster (harness.cluster.cluster), and what
is read back to judge them (shared by tests/e2e/test_cluster_chaos.py and bench/chaos.py).

Injectors act as the thing that fails would: a container's main process SIGKILLed (its PID 1 in
the pod's PID namespace, as an OOM kill does), one torchrun worker SIGKILLed, a pod deleted with
kubectl (gracefully, or with grace 0 after its processes are killed, as a reclaimed node), the
operator's pod killed (its container restarted by the kubelet, or the pod replaced by its
ReplicaSet), the API server or etcd restarted, `kubectl scale`.

Probes read what a person could: the pods in the API server, each sidecar's `/status` and the
trainer's `/progress` from inside the pod's own network namespace (no NetworkPolicy between a
pod and its own loopback), the step history and checkpoints on the output claim. `Watcher`
polls the API server and the kubelet every 0.2 s for two live pods of one role and index.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from harness.cluster.cluster import NS, Cluster
from harness.cluster.jobs import JOB_LABEL, job_pods
from harness.kubelet.pod import PodRun
from lorarl.operator.builders import INDEX_LABEL, ROLE_LABEL
from lorarl.trainer.checkpoint.manager import STEP_RE, CheckpointManager

Obj = dict[str, Any]
ROLE, INDEX = ROLE_LABEL, INDEX_LABEL


# -- probes ------------------------------------------------------------------------------------


def pod_run(c: Cluster, pod: str, namespace: str = "default") -> PodRun:
    run = c.kubelet.pod(namespace, pod)
    assert run is not None and run.net is not None, f"pod {pod} is not running here"
    return run


def port_of(run: PodRun, name: str) -> int:
    for container in run.pod["spec"]["containers"]:
        for port in container.get("ports") or []:
            if port.get("name") == name:
                return int(port["containerPort"])
    raise AssertionError(f"pod {run.key} has no port named {name}")


def get_in_pod(c: Cluster, pod: str, port_name: str, path: str) -> Obj | None:
    """GET http://127.0.0.1:<port>/<path> inside the pod's netns; None if it does not answer."""
    run = c.kubelet.pod("default", pod)
    if run is None or run.net is None or run.stopping:
        return None
    url = f"http://127.0.0.1:{port_of(run, port_name)}{path}"
    try:
        done = subprocess.run(["ip", "netns", "exec", run.net.netns, "curl", "-sf", "-m", "3",
                               url], capture_output=True, text=True, timeout=30)  # fmt: skip
    except subprocess.TimeoutExpired:  # a box so loaded a process start takes that long
        return None
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout)
    except ValueError:
        return None


def sidecar_status(c: Cluster, pod: str) -> Obj | None:
    return get_in_pod(c, pod, "sidecar", "/status")


def trainer_progress(c: Cluster, name: str) -> Obj | None:
    return get_in_pod(c, f"{name}-trainer-0", "progress", "/progress")


def running(pod: Obj) -> bool:
    """Running, not being deleted, every container running."""
    status = pod.get("status") or {}
    states = [cs.get("state") or {} for cs in status.get("containerStatuses") or []]
    return (
        status.get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
        and bool(states)
        and all("running" in s for s in states)
    )


def fleet_healthy(c: Cluster, name: str, expected: dict[str, int]) -> str | None:
    """None when every expected pod runs once with all its containers and every rollout
    sidecar serves the newest version it accepted; else what is not yet so."""
    pods = job_pods(c, name)
    for role, count in expected.items():
        for i in range(count):
            mine = [p for p in pods if p["metadata"]["labels"].get(ROLE) == role
                    and p["metadata"]["labels"].get(INDEX) == str(i)]  # fmt: skip
            if len(mine) != 1 or not running(mine[0]):
                return f"{role}-{i}: not one running pod"
            if role == "rollout":
                status = sidecar_status(c, mine[0]["metadata"]["name"])
                if not status or not status.get("inSync"):
                    return f"{role}-{i}: sidecar not in sync ({status})"
    extra = [p["metadata"]["name"] for p in pods if running(p)
             and int(p["metadata"]["labels"][INDEX]) >= expected.get(
                 p["metadata"]["labels"][ROLE], 0)]  # fmt: skip
    return f"still running: {extra}" if extra else None


def engines_on_latest(c: Cluster, name: str) -> tuple[bool, str]:
    """One consistent read: the trainer's last synced version, then every running rollout
    pod's sidecar, then the trainer again (unchanged, or the read is not consistent)."""
    before = trainer_progress(c, name)
    if not before or not before.get("lastSync"):
        return False, f"trainer progress unreadable: {before}"
    version = before["lastSync"]["version"]
    served = {}
    for pod in job_pods(c, name):
        if pod["metadata"]["labels"].get(ROLE) == "rollout" and running(pod):
            status = sidecar_status(c, pod["metadata"]["name"])
            served[pod["metadata"]["name"]] = status and status.get("version")
    after = trainer_progress(c, name)
    if not after or (after.get("lastSync") or {}).get("version") != version:
        return False, "the trainer synced during the read"
    ok = bool(served) and all(v == version for v in served.values())
    return ok, f"trainer v{version}, sidecars {served}"


def checkpoints_bad(c: Cluster, name: str) -> list[str]:
    """Every `step-*` on the output claim that fails its manifest (checkpoint.py's verify)."""
    root = c.kubelet.claim_dir("default", "outputs") / name / "checkpoints"
    manager = CheckpointManager(root)
    bad = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if STEP_RE.match(path.name) and (reason := manager.verify(path)) is not None:
            bad.append(f"{path.name}: {reason}")
    return bad


def read_history(c: Cluster, name: str) -> list[Obj]:
    path = c.kubelet.claim_dir("default", "outputs") / name / "history.jsonl"
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):  # a line being appended
            rows.append(json.loads(line))
    return rows


# -- injectors ---------------------------------------------------------------------------------


def _signal(pid: int | None, sig: int = signal.SIGKILL) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_container(c: Cluster, pod: str, container: str, namespace: str = "default") -> str:
    """SIGKILL the container's main process (its PID 1): the kernel ends the PID namespace."""
    (run,) = [r for r in pod_run(c, pod, namespace).containers if r.name == container]
    pid = run.pid1
    assert _signal(pid), f"{pod}/{container}: no main process to kill"
    return f"SIGKILL {pod}/{container} pid {pid}"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def kill_trainer_rank(c: Cluster, name: str, rank: int) -> str:
    """SIGKILL one torchrun worker (found by its RANK) in the trainer pod."""
    (run,) = [r for r in pod_run(c, f"{name}-trainer-0").containers if r.name == "trainer"]
    torchrun = run.pid1
    assert torchrun is not None, "no trainer process"
    workers = {int(_env_of(p).get("RANK", "-1")): p for p in _children(torchrun)}
    assert rank in workers, f"no worker of rank {rank} under torchrun {torchrun}: {workers}"
    _signal(workers[rank])
    return f"SIGKILL trainer rank {rank} pid {workers[rank]}"


def delete_pod(c: Cluster, pod: str, *, preempt: bool = False) -> str:
    """`kubectl delete pod`; `preempt`: as a reclaimed node, its processes die at once and the
    pod is force-deleted with grace 0."""
    if not preempt:
        c.kubectl("delete", "pod", pod, "--wait=false")
        return f"kubectl delete pod {pod}"
    for container in pod_run(c, pod).containers:
        pid1 = container.pid1
        _signal(container.proc.pid if container.proc else None)  # --kill-child takes PID 1
        _signal(pid1)
    c.kubectl("delete", "pod", pod, "--grace-period=0", "--force", "--wait=false")
    return f"preempted {pod} (SIGKILL, delete --grace-period=0 --force)"


def scale(c: Cluster, name: str, replicas: int) -> str:
    c.kubectl("scale", "lrj", name, f"--replicas={replicas}")
    return f"kubectl scale lrj {name} --replicas={replicas}"


def kill_operator(c: Cluster, replace: bool = False) -> str:
    """The operator's pod dies: its process SIGKILLed (the kubelet restarts the container, as
    after an OOM kill), or with `replace` the pod deleted at once with grace 0 (its ReplicaSet
    makes a new one, as after a node loss)."""
    (pod,) = c.component_pods("operator")
    name = pod["metadata"]["name"]
    if replace:
        for container in pod_run(c, name, NS).containers:
            _signal(container.pid1)
        c.kubectl("delete", "pod", name, "-n", NS, "--grace-period=0", "--force", "--wait=false")
        return f"operator pod {name} deleted (SIGKILL, grace 0)"
    return kill_container(c, name, "operator", NS)


def wait_operator(c: Cluster, timeout: float = 120) -> None:
    """Until the operator's (restarted or new) pod passes its readiness probe again."""
    time.sleep(1.0)  # its Ready condition is stale until the kubelet's next report
    c.wait_ready("operator", timeout)


def restart_control_plane(c: Cluster, component: str) -> str:
    """Stop the API server or etcd (SIGTERM) and start it again: every client, the operator's
    watches and the kubelet included, must ride it out."""
    c.cp.restart(component)
    return f"restarted {component}"


# -- the watcher -------------------------------------------------------------------------------


class Watcher:
    """Polls, every `period` s while a job runs: pods of one role and index alive at once (in
    the API server: not deleting and not finished; on the node: a process still running), and
    the step history, keeping every (step, time) ever recorded so a redone step shows."""

    def __init__(self, c: Cluster, name: str, period: float = 0.2) -> None:
        self.c, self.name, self.period = c, name, period
        self.duplicates: list[str] = []
        self.records: dict[int, dict[float, Obj]] = {}  # step -> record time -> record
        self.max_restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{name}", daemon=True)
        self._last_history = 0.0

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.poll_history()

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.poll_pods()
                if time.monotonic() - self._last_history > 0.5:
                    self.poll_history()
            except Exception as exc:  # the API server is being torn down, a file replaced...
                self.duplicates.append(f"watcher error (not a duplicate): {exc!r}")

    def poll_pods(self) -> None:
        alive: dict[tuple[str, str], list[str]] = {}
        for pod in job_pods(self.c, self.name):
            meta = pod["metadata"]
            phase = (pod.get("status") or {}).get("phase")
            if not meta.get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
                key = (meta["labels"][ROLE], meta["labels"][INDEX])
                alive.setdefault(key, []).append(f"api:{meta['name']}/{meta['uid'][:8]}")
        for run in list(self.c.kubelet.pods.values()):
            labels = run.pod["metadata"].get("labels") or {}
            if labels.get(JOB_LABEL) != self.name:
                continue
            if any(r.proc is not None and r.proc.poll() is None for r in run.containers):
                key = (labels[ROLE], labels[INDEX])
                alive.setdefault(key, []).append(f"node:{run.key}/{run.uid[:8]}")
        for (role, index), seen in alive.items():
            api = [s for s in seen if s.startswith("api:")]
            node = [s for s in seen if s.startswith("node:")]
            if len(api) > 1 or len(node) > 1:
                self.duplicates.append(f"{time.time():.1f} {role}-{index}: {seen}")
        job = self.c.job(self.name) or {}
        self.max_restarts = max(self.max_restarts, (job.get("status") or {}).get("restarts", 0))

    def poll_history(self) -> None:
        self._last_history = time.monotonic()
        for row in read_history(self.c, self.name):
            self.records.setdefault(row["step"], {})[row["time"]] = row

    def step(self) -> int:
        return max(self.records, default=0)

    def first_times(self) -> dict[int, float]:
        return {s: min(times) for s, times in self.records.items()}

    def redone_after(self, t: float) -> int:
        """Steps recorded before wall time `t` and recorded again after it."""
        return sum(1 for times in self.records.values()
                   if min(times) < t and max(times) > t and len(times) > 1)  # fmt: skip

    def rewards(self) -> list[tuple[int, float, float]]:
        """(step, time, rewardMean) of the kept record of every step (the newest)."""
        return sorted((s, max(times), times[max(times)]["rewardMean"])
                      for s, times in self.records.items())  # fmt: skip
