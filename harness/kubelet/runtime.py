"""Containers as processes: start, watch, restart per restartPolicy, kill; and their status.

Each container runs as `ip netns exec <pod netns> unshare --mount --uts --pid --fork --kill-child
--mount-proc python podinit.py <spec>`: the pod's network, a mount/PID namespace of its own. The
container's command is PID 1 there, so SIGKILL of it (or of `unshare`, through --kill-child)
ends every process the container started. Logs go to one file per container run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .containers import Launch

PODINIT = Path(__file__).with_name("podinit.py")
DEFAULT_SHM = "64m"  # what container runtimes give a pod that mounts no /dev/shm of its own
TERMINATION_LOG = "/dev/termination-log"
LOG_TAIL_LINES, LOG_TAIL_BYTES = 80, 2048  # FallbackToLogsOnError, as kubelet cuts the log


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRun:
    """One container of a pod over its restarts."""

    name: str
    image: str
    folder: Path
    launch: Launch | None = None  # None: the container could not be configured
    mounts: list[dict[str, Any]] = field(default_factory=list)
    shm: str = DEFAULT_SHM
    hostname: str = ""
    netns: str = ""
    termination_policy: str = "File"
    waiting: tuple[str, str] | None = None  # (reason, message) while it cannot start
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: str | None = None
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None
    started_once: bool = False
    probe: dict[str, Any] | None = None  # the container's readinessProbe (httpGet only)
    probe_ok: bool = False  # the last readiness probe passed
    probed_at: float = 0.0  # monotonic

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.restarts}.log"

    def start(self) -> None:
        assert self.launch is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        term_log = self.folder / f"{self.restarts}.termination-log"
        term_log.write_text("")
        os.chmod(term_log, 0o666)
        status = self.folder / f"{self.restarts}.status"
        status.write_text("")
        launch = self.launch
        spec = {
            "root": str(self.folder / f"{self.restarts}.root"),
            "hostname": self.hostname,
            "read_only_root": launch.read_only_root,
            "shm_size": self.shm,
            "mounts": [*self.mounts, {"src": str(term_log), "dst": TERMINATION_LOG}],
            "workdir": launch.workdir,
            "uid": launch.uid,
            "gid": launch.gid,
            "groups": launch.groups,
            "no_new_privs": launch.no_new_privs,
            "drop_caps": launch.drop_caps,
            "reachable": launch.reachable,
            "host_paths": launch.host_paths,
            "passwd": launch.passwd,
            "group": launch.group,
            "argv": launch.argv,
            "env": launch.env,
            "status_file": str(status),
        }
        spec_file = self.folder / f"{self.restarts}.spec.json"
        spec_file.write_text(json.dumps(spec))
        os.chmod(spec_file, 0o600)  # it holds the container's env, secrets included
        # --pdeathsig: if this process dies without stopping its pods (a SIGKILLed test run),
        # `unshare` is killed and --kill-child takes the container down with it.
        argv = ["setpriv", "--pdeathsig", "KILL", "--",
                "ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation",
                "private", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc",
                sys.executable, "-I", str(PODINIT), str(spec_file)]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )  # fmt: skip
        self.started_at, self.terminated, self.waiting = now(), None, None
        self.started_once = True

    def poll(self) -> bool:
        """Record the exit if the container just ended; True when it did."""
        if self.proc is None or self.terminated is not None:
            return False
        code = self.proc.poll()
        if code is None:
            return False
        if code < 0:
            code = 128 - code  # killed by a signal: 137 for SIGKILL, as runtimes report
        failure = self._init_failure()
        reason = "Completed" if code == 0 else "Error"
        message = self._termination_message(code)
        if failure is not None:
            reason, message = failure
        self.terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": self.started_at,
            "finishedAt": now(),
            **({"message": message} if message else {}),
        }
        return True

    def _init_failure(self) -> tuple[str, str] | None:
        text = (self.folder / f"{self.restarts}.status").read_text().strip()
        if not text:
            return None
        data = json.loads(text)
        return data["reason"], data["message"]

    def _termination_message(self, code: int) -> str:
        written = (self.folder / f"{self.restarts}.termination-log").read_text(errors="replace")
        if written.strip() or self.termination_policy != "FallbackToLogsOnError" or code == 0:
            return written[:4096]
        return tail(self.log_path)

    def restart(self) -> None:
        self.last_terminated = self.terminated
        self.restarts += 1
        self.restart_at = None
        self.start()

    @property
    def pid1(self) -> int | None:
        """The container's PID 1, seen from here (the child of `unshare`)."""
        if self.proc is None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        except OSError:
            return None
        return int(children.split()[0]) if children.split() else None

    def kill(self, grace: float) -> None:
        """SIGTERM the container's PID 1 (which, like any PID 1, ignores it without a handler),
        then SIGKILL after the grace period: the whole PID namespace goes with it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pid1 = self.pid1
        if pid1 is not None:
            _signal(pid1, signal.SIGTERM)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.proc.poll() is None:
                time.sleep(0.05)
        if self.proc.poll() is None:
            pid1 = self.pid1
            _signal(self.proc.pid, signal.SIGKILL)  # --kill-child takes PID 1 along
            if pid1 is not None:
                _signal(pid1, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.poll()

    def state(self) -> dict[str, Any]:
        if self.waiting is not None:
            reason, message = self.waiting
            return {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        if self.terminated is not None:
            if self.restart_at is not None:
                return {"waiting": {"reason": "CrashLoopBackOff", "message": (
                    f"back-off restarting failed container {self.name}")}}  # fmt: skip
            return {"terminated": self.terminated}
        if self.proc is not None:
            return {"running": {"startedAt": self.started_at}}
        return {"waiting": {"reason": "ContainerCreating"}}

    def status(self) -> dict[str, Any]:
        state = self.state()
        out = {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "state": state,
            "ready": "running" in state and (self.probe is None or self.probe_ok),
            "started": "running" in state,
            "restartCount": self.restarts,
        }
        if self.last_terminated is not None:
            out["lastState"] = {"terminated": self.last_terminated}
        return out


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def tail(path: Path) -> str:
    """The last lines of a log, as FallbackToLogsOnError reports it (80 lines, 2048 bytes)."""
    try:
        with open(path, errors="replace") as f:
            text = "".join(deque(f, maxlen=LOG_TAIL_LINES))
    except OSError:
        return ""
    return text[-LOG_TAIL_BYTES:]
