"""`python -m lorarl.colocate`, the supervisor of a colocated trainer pod's one container: real
child processes, as the pod runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorarl import colocate
from lorarl.api.spec.placement import COLOCATED_PROCESSES_ENV
from lorarl.api.spec.workloads import SYNC_KEY_ENV

# Writes its pid, its env and its argv, then behaves as told: `crash-once` exits 3 the first
# time (a marker file remembers), `exit:N` exits N, `sleep` runs until stopped.
CHILD = """
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
with open(out + ".pids", "a") as f:
    f.write(f"{os.getpid()}\\n")
with open(out + ".json", "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv}, f)
if mode == "crash-once" and not os.path.exists(out + ".crashed"):
    open(out + ".crashed", "w").close()
    sys.exit(3)
if mode == "fork-crash-once" and not os.path.exists(out + ".crashed"):
    open(out + ".crashed", "w").close()  # leaves a worker in its process group, as vLLM would
    worker = __import__("subprocess").Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(out + ".worker", "w").write(str(worker.pid))
    os._exit(3)
if mode.startswith("listen:"):
    time.sleep(1.0)
    s = __import__("socket").create_server(("127.0.0.1", int(mode[7:])))
    open(out + ".listening", "w").write(repr(time.time()))
if mode.startswith("kill:"):
    os.kill(os.getpid(), int(mode[5:]))
if mode.startswith("exit:"):
    time.sleep(float(os.environ.get("CHILD_DELAY", "0")))
    sys.exit(int(mode[5:]))
time.sleep(600)
"""


def spec(tmp: Path, engine: str = "sleep", trainer: str = "exit:0", delay: str = "1.5") -> str:
    def proc(name: str, mode: str, env: dict[str, str] | None = None) -> dict:
        command = ["python", "-c", CHILD, str(tmp / name), mode, "$(LORARL_ENGINE_API_KEY)"]
        return {"name": name, "command": command, "env": env or {}}

    return json.dumps(
        [
            proc("engine", engine, {"VLLM_API_KEY": "$(LORARL_ENGINE_API_KEY)"}),
            proc("sidecar", "sleep"),
            proc("trainer", trainer, {"CHILD_DELAY": delay}),
        ]
    )


def environ() -> dict[str, str]:
    return {**os.environ, "LORARL_ENGINE_API_KEY": "k3y", SYNC_KEY_ENV: "s3cret"}


def seen(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"{name}.json").read_text())


def pids(tmp: Path, name: str) -> list[int]:
    return [int(x) for x in (tmp / f"{name}.pids").read_text().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by a parent that is gone) counts as dead.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_each_process_gets_its_env_and_the_engine_never_the_sync_key(tmp_path):
    procs = colocate.processes(spec(tmp_path), environ())
    assert [p.name for p in procs] == ["engine", "sidecar", "trainer"]
    assert all(p.argv[0] == sys.executable for p in procs)  # the image's one interpreter
    assert procs[0].argv[-1] == "k3y" and procs[0].env["VLLM_API_KEY"] == "k3y"
    assert SYNC_KEY_ENV not in procs[0].env
    assert procs[1].env[SYNC_KEY_ENV] == procs[2].env[SYNC_KEY_ENV] == "s3cret"
    assert all(COLOCATED_PROCESSES_ENV not in p.env for p in procs)
    assert "CHILD_DELAY" not in procs[0].env  # one process's planned env is its own


def test_the_trainer_must_come_last():
    bad = json.dumps([{"name": "trainer", "command": ["true"], "env": {}},
                      {"name": "engine", "command": ["true"], "env": {}}])  # fmt: skip
    with pytest.raises(ValueError, match="trainer last"):
        colocate.processes(bad, {})


@pytest.mark.parametrize("code", [0, 7])
def test_the_container_ends_with_the_trainer_and_stops_the_rest(tmp_path, code):
    procs = colocate.processes(spec(tmp_path, trainer=f"exit:{code}"), environ())
    assert colocate.supervise(procs, []) == code
    for name in ("engine", "sidecar"):
        assert not any(alive(pid) for pid in pids(tmp_path, name))


def test_a_crashed_engine_restarts_in_place_while_the_trainer_runs(tmp_path):
    procs = colocate.processes(spec(tmp_path, engine="crash-once", delay="3"), environ())
    assert colocate.supervise(procs, []) == 0
    assert len(pids(tmp_path, "engine")) == 2 and procs[0].restarts == 1
    assert len(pids(tmp_path, "trainer")) == 1  # the trainer kept going


def test_an_engine_that_keeps_crashing_fails_the_container(tmp_path, monkeypatch):
    monkeypatch.setattr(colocate, "POLL_S", 0.05)
    monkeypatch.setattr(colocate, "BACKOFF_S", (0.1, 0.2))
    procs = colocate.processes(spec(tmp_path, engine="exit:3", delay="30"), environ())
    start = time.monotonic()
    assert colocate.supervise(procs, []) == 1
    assert time.monotonic() - start < 20
    assert len(pids(tmp_path, "engine")) == colocate.MAX_RESTARTS + 1
    assert not any(alive(pid) for pid in pids(tmp_path, "trainer"))


def test_sigterm_stops_every_process(tmp_path):
    env = {**environ(), COLOCATED_PROCESSES_ENV: spec(tmp_path, trainer="sleep")}
    container = subprocess.Popen([sys.executable, "-m", "lorarl.colocate"], env=env)
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"{n}.pids").exists() for n in ("engine", "sidecar", "trainer")):
        assert time.monotonic() < deadline, "the processes did not start"
        time.sleep(0.1)
    container.send_signal(signal.SIGTERM)
    assert container.wait(timeout=30) == 128 + signal.SIGTERM
    for name in ("engine", "sidecar", "trainer"):
        assert not any(alive(pid) for pid in pids(tmp_path, name))
    assert seen(tmp_path, "trainer")["env"][SYNC_KEY_ENV] == "s3cret"


def test_without_its_processes_the_container_fails_with_a_message():
    env = {k: v for k, v in os.environ.items() if k != COLOCATED_PROCESSES_ENV}
    out = subprocess.run([sys.executable, "-m", "lorarl.colocate"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and COLOCATED_PROCESSES_ENV in out.stderr


def test_the_container_drops_the_variables_a_process_must_not_see(tmp_path):
    planned = json.loads(spec(tmp_path))
    planned[0]["unsetEnv"] = ["WANDB_API_KEY"]
    procs = colocate.processes(json.dumps(planned), {**environ(), "WANDB_API_KEY": "w"})
    assert "WANDB_API_KEY" not in procs[0].env
    assert procs[2].env["WANDB_API_KEY"] == "w"  # the trainer's own


def test_the_trainer_starts_only_once_the_engine_listens(tmp_path, monkeypatch):
    from lorarl.local.ports import free_port

    monkeypatch.setattr(colocate, "POLL_S", 0.05)
    port = free_port()
    planned = json.loads(spec(tmp_path, engine=f"listen:{port}", delay="0"))
    planned[2]["waitForPorts"] = [port]
    procs = colocate.processes(json.dumps(planned), environ())
    started = time.time()
    assert colocate.supervise(procs, []) == 0
    listening = float((tmp_path / "engine.listening").read_text())
    assert listening - started >= 0.9  # the engine took a second to listen ...
    assert (tmp_path / "trainer.json").stat().st_mtime >= listening  # ... the trainer waited


def test_a_restart_first_kills_what_the_crashed_engine_left_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(colocate, "BACKOFF_S", (0.1,))
    procs = colocate.processes(spec(tmp_path, engine="fork-crash-once", delay="3"), environ())
    assert colocate.supervise(procs, []) == 0
    worker = int((tmp_path / "engine.worker").read_text())
    assert procs[0].restarts == 1 and not alive(worker)


def test_a_trainer_killed_by_a_signal_ends_the_container_as_a_shell_reports_it(tmp_path):
    procs = colocate.processes(spec(tmp_path, trainer="kill:9"), environ())
    assert colocate.supervise(procs, []) == 128 + 9
    assert colocate.exit_status(-15) == 143 and colocate.exit_status(4) == 4


REAPER = """
import ctypes, os, subprocess, sys, time
from lorarl import colocate
ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans come to us
tracked = colocate.Process("engine", [sys.executable, "-c", "import time; time.sleep(30)"], {})
tracked.start()
# a child that exits at once, leaving its own child (exits in 0.2 s) orphaned to us
subprocess.run([sys.executable, "-c",
                "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(0.2)'])"], check=True)
zombies = lambda: [l for l in os.popen(f"ps -o stat= --ppid {os.getpid()}") if "Z" in l]
deadline = time.monotonic() + 30  # the orphan exits 0.2 s after its start; slower under load
while not zombies() and time.monotonic() < deadline:
    time.sleep(0.1)
before = len(zombies())
colocate.reap_orphans([tracked])
print(before, len(zombies()), tracked.poll())
tracked.signal(9)
"""


def test_orphans_are_reaped_and_tracked_children_are_left_to_their_popen():
    out = subprocess.run([sys.executable, "-c", REAPER], capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    before, after, tracked = out.stdout.split()
    assert (before, after, tracked) == ("1", "0", "None")
