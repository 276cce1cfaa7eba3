"""`python -m lorarl.colocate`: the one container of a colocated trainer pod.

A colocated pod runs three processes on the same devices: the trainer (torchrun), its engine and
the engine's sync sidecar. They share one container because a GPU granted by the device plugin
is visible to the container that requests it and to no other; children of one process see the
same devices. This supervisor gives each process the environment its own container would have
had, restarts a crashed engine or sidecar in place (as a rollout pod's kubelet would: the sidecar
re-applies the weights, a restarted sidecar re-registers), and ends with the trainer: its exit
code is the container's, so a failed trainer fails the pod and the operator restarts the group
from its checkpoint. docs/architecture.md, Placement.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from lorarl.api.placement import COLOCATED_PROCESSES_ENV
from lorarl.api.workloads import SYNC_KEY_ENV
from lorarl.local.env_refs import expand
from lorarl.sync.protocol import SYNC_KEY_CONTAINERS

MAX_RESTARTS = 3
POLL_S = 0.5
GRACE_S = 10.0


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    restarts: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        # Its own session, so stopping it reaches the workers an engine or torchrun forks.
        self.proc = subprocess.Popen(self.argv, env=self.env, start_new_session=True)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


def processes(spec: str, environ: dict[str, str]) -> list[Process]:
    """The planned processes (`[{"name", "command", "env"}]`, trainer last) as they start:
    `$(VAR)` references expanded like the kubelet would, `python` as this interpreter (the image
    holds one), and the sync key only for the sync's two ends (the engine never sees it)."""
    base = {k: v for k, v in environ.items() if k != COLOCATED_PROCESSES_ENV}
    out = []
    for item in json.loads(spec):
        env = {**base, **{k: expand(v, base) for k, v in item["env"].items()}}
        if item["name"] not in SYNC_KEY_CONTAINERS:
            env.pop(SYNC_KEY_ENV, None)
        argv = [expand(a, env) for a in item["command"]]
        if argv and argv[0] == "python":
            argv[0] = sys.executable
        out.append(Process(item["name"], argv, env))
    names = [p.name for p in out]
    if names[-1:] != ["trainer"] or len(set(names)) != len(names):
        raise ValueError(f"{COLOCATED_PROCESSES_ENV}: distinct names, trainer last; got {names}")
    return out


def supervise(procs: list[Process], stop_requested: list[bool]) -> int:
    """Run until the trainer ends (its code) or a helper process fails for good (1)."""
    trainer = procs[-1]
    for p in procs:
        p.start()
    try:
        while not stop_requested:
            code = trainer.poll()
            if code is not None:
                return code
            for p in procs[:-1]:
                code = p.poll()
                if code is None or (code == 0 and p.name == "sidecar"):
                    continue  # a sidecar ends on its own once the trainer closes the channel
                if p.restarts >= MAX_RESTARTS:
                    print(f"colocate: {p.name} exited with {code} after {p.restarts} restarts",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return 1
                p.restarts += 1
                print(f"colocate: {p.name} exited with {code}; restarting ({p.restarts})",
                      file=sys.stderr, flush=True)  # fmt: skip
                p.start()
            time.sleep(POLL_S)
        return 128 + signal.SIGTERM
    finally:
        stop(procs)


def stop(procs: list[Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process group (trainer first: it closes the sync channel), then SIGKILL."""
    for p in reversed(procs):
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
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
