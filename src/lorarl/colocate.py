"""`python -m lorarl.colocate`: the one container of a colocated trainer pod.

A colocated pod runs three processes on the same devices: the trainer (torchrun), its engine and
the engine's sync sidecar. They share one container because a GPU granted by the device plugin
is visible to the container that requests it and to no other; children of one process see the
same devices. This supervisor gives each process the environment its own container would have
had (and no more: the trainer's tracker keys stay the trainer's), starts the trainer once the
engine listens when they share GPUs (vLLM measures free GPU memory while it starts), restarts a
crashed engine or sidecar in place with a back-off, its whole process group killed first (an
engine's workers would otherwise keep the GPU memory), reaps orphans (it is PID 1), and ends
with the trainer: its exit code is the container's, so a failed trainer fails the pod and the
operator restarts the group from its checkpoint. Unlike a kubelet it gives up on a helper that
keeps crashing (MAX_RESTARTS within RESET_AFTER_S): a pod that cannot generate fails, and the
group restart counts against backoffLimit. docs/architecture.md, Placement.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from lorarl.api.spec.placement import COLOCATED_PROCESSES_ENV
from lorarl.api.spec.workloads import SYNC_KEY_ENV
from lorarl.local.env_refs import expand
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, REWARD_KEY_CONTAINERS
from lorarl.sync.protocol import SYNC_KEY_CONTAINERS

MAX_RESTARTS = 3
RESET_AFTER_S = 600.0  # a helper that ran this long has its restart count cleared (as a kubelet)
BACKOFF_S = (1.0, 5.0, 15.0)  # before restart 1, 2, 3
POLL_S = 0.5
GRACE_S = 10.0
READY_TIMEOUT_S = 1800.0  # an engine loading a large model from a volume takes minutes


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    # 127.0.0.1 ports that must accept connections before this process starts
    wait_for_ports: list[int] = field(default_factory=list)
    restarts: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # when a crashed process is due to start again
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        # Its own session, so stopping it reaches the workers an engine or torchrun forks.
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)
        self.started_at = time.monotonic()
        self.restart_at = None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


def exit_status(code: int) -> int:
    """A child's `poll()` code as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - code if code < 0 else code


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def reap_orphans(tracked: list[Process]) -> None:
    """As PID 1 the container inherits every orphan (an engine's workers whose server died):
    reap them, but never a tracked child, whose exit code its Popen must read."""
    mine = {p.proc.pid for p in tracked if p.proc is not None}
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in mine:
            return  # nothing exited, or a tracked child: its poll() reaps it next round
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


def processes(spec: str, environ: dict[str, str]) -> list[Process]:
    """The planned processes (`[{"name", "command", "env", "unsetEnv"?, "waitForPorts"?}]`,
    trainer last) as they start: `$(VAR)` references expanded like the kubelet would, `python`
    as this interpreter (the image holds one), the sync key only for the sync's two ends (the
    engine never sees it), the reward key only for the trainer, and the container's variables
    named in `unsetEnv` removed."""
    base = {k: v for k, v in environ.items() if k != COLOCATED_PROCESSES_ENV}
    out = []
    for item in json.loads(spec):
        env = {**base, **{k: expand(v, base) for k, v in item["env"].items()}}
        if item["name"] not in SYNC_KEY_CONTAINERS:
            env.pop(SYNC_KEY_ENV, None)
        if item["name"] not in REWARD_KEY_CONTAINERS:  # the engine and sidecar never score
            env.pop(REWARD_API_KEY_ENV, None)
        for name in item.get("unsetEnv", ()):  # the container's, not this process's
            env.pop(name, None)
        argv = [expand(a, env) for a in item["command"]]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        out.append(Process(item["name"], argv, env, list(item.get("waitForPorts", ()))))
    names = [p.name for p in out]
    if names[-1:] != ["trainer"] or len(set(names)) != len(names):
        raise ValueError(f"{COLOCATED_PROCESSES_ENV}: distinct names, trainer last; got {names}")
    return out


def supervise(procs: list[Process], stop_requested: list[bool]) -> int:
    """Run until the trainer ends (its code) or a helper process fails for good (1)."""
    trainer, helpers = procs[-1], procs[:-1]
    for p in helpers:
        p.start()
    waiting_since = time.monotonic()
    try:
        while not stop_requested:
            if trainer.proc is None:
                if all(listening(port) for port in trainer.wait_for_ports):
                    trainer.start()
                elif time.monotonic() - waiting_since > READY_TIMEOUT_S:
                    print(f"colocate: nothing listens on {trainer.wait_for_ports} after "
                          f"{READY_TIMEOUT_S:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
                    return 1
            code = trainer.poll()
            if code is not None:
                return exit_status(code)
            for p in helpers:
                if not _keep_running(p):
                    return 1
            reap_orphans(procs)
            time.sleep(POLL_S)
        code = trainer.poll()
        return 128 + signal.SIGTERM if code is None else exit_status(code)
    finally:
        stop(procs)


def _keep_running(p: Process) -> bool:
    """Restart `p` if it crashed (after its back-off); False once it crashed too often."""
    now = time.monotonic()
    if p.restart_at is not None:  # crashed, waiting out its back-off
        if now >= p.restart_at:
            p.start()
        return True
    code = p.poll()
    if code is None or (code == 0 and p.name == "sidecar"):
        return True  # a sidecar ends on its own once the trainer closes the channel
    if now - p.started_at >= RESET_AFTER_S:
        p.restarts = 0
    if p.restarts >= MAX_RESTARTS:
        print(f"colocate: {p.name} exited with {exit_status(code)} after {p.restarts} restarts",
              file=sys.stderr, flush=True)  # fmt: skip
        return False
    p.signal(signal.SIGKILL)  # what the dead process left behind (an engine's workers)
    delay = BACKOFF_S[min(p.restarts, len(BACKOFF_S) - 1)]
    p.restarts += 1
    p.restart_at = now + delay
    print(f"colocate: {p.name} exited with {exit_status(code)}; restarting in {delay:.0f} s "
          f"({p.restarts})", file=sys.stderr, flush=True)  # fmt: skip
    return True


def stop(procs: list[Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process group (trainer first: it closes the sync channel), then SIGKILL."""
    for p in reversed(procs):
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    started = [p for p in procs if p.proc is not None]
    while time.monotonic() < deadline and any(p.poll() is None for p in started):
        time.sleep(0.05)
    for p in procs:
        p.signal(signal.SIGKILL)
        if p.proc is not None:
            p.proc.wait()


def main() -> int:
    spec = os.environ.get(COLOCATED_PROCESSES_ENV)
    if not spec:
        print(f"colocate: {COLOCATED_PROCESSES_ENV} is not set", file=sys.stderr)
        return 2
    procs = processes(spec, dict(os.environ))
    stop_requested: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    return supervise(procs, stop_requested)


if __name__ == "__main__":
    sys.exit(main())
