"""The run folders `lorarl run --local` leaves under runs/: found, listed, stopped, deleted and
resumed by name (`lorarl list/status/logs/stop/delete/resume --local`).

Besides the trainer's files (progress.json, history.jsonl, checkpoints/, logs/), a session writes

    runs/<job>/manifest.yaml   the job as the user gave it (what `lorarl resume` runs again)
    runs/<job>/run.json        the `lorarl run` process: pid (and its start time, so a reused
                               pid is not taken for it), status API URL, start; on exit the
                               end time and exit code.

A folder without run.json (an older lorarl) still lists, from its progress.json alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from lorarl.api import safe_yaml
from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import Condition, LoRARLJobStatus, ModelStatus
from lorarl.api.resource import LoRARLJob
from lorarl.errors import UserError

MANIFEST_FILE = "manifest.yaml"
STATE_FILE = "run.json"
LOGS_DIR = "logs"
DEFAULT_RUNS_DIR = "runs"
INTERRUPTED = 130  # `lorarl run` exit code after Ctrl-C or SIGTERM (a stop)

# --role: which children's logs (their files are logs/<replica>-<container>.log).
ROLE_CONTAINERS = {
    "trainer": ("trainer",),
    "rollout": ("engine",),
    "sidecar": ("sidecar",),
    "reward": ("reward",),
}


class RunNotFound(UserError):
    pass


# ------------------------------------------------------------------ what a session writes


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def record_start(run_dir: Path, job: LoRARLJob, status_url: str | None = None) -> None:
    """Keep the manifest and this process's identity in the run folder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    body = job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})
    tmp = run_dir / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(safe_yaml.dump(body, sort_keys=False, width=100))
    os.replace(tmp, run_dir / MANIFEST_FILE)
    pid = os.getpid()
    state = {"pid": pid, "pidStart": _process_start(pid), "startedAt": time.time()}
    if status_url:
        state["statusUrl"] = status_url
    _write_json(run_dir / STATE_FILE, state)


def record_status_url(run_dir: Path, url: str) -> None:
    state = read_state(run_dir)
    if state is not None:
        _write_json(run_dir / STATE_FILE, {**state, "statusUrl": url})


def record_end(run_dir: Path, exit_code: int) -> None:
    state = read_state(run_dir) or {}
    state.pop("statusUrl", None)  # the status API ends with the session
    _write_json(run_dir / STATE_FILE, {**state, "endedAt": time.time(), "exitCode": exit_code})


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def load_manifest(run_dir: Path) -> LoRARLJob:
    from lorarl.api.validation import ManifestError, load_documents, parse_job

    path = run_dir / MANIFEST_FILE
    if not path.is_file():
        raise UserError(
            f"{run_dir} has no {MANIFEST_FILE} (run by an older lorarl?): run the job again "
            f"with `lorarl run JOB.yaml --local --run-dir {run_dir}`"
        )
    try:
        return parse_job(load_documents(str(path))[0][1], cluster=False)
    except ManifestError as exc:
        raise UserError(f"{path}: {'; '.join(str(p) for p in exc.problems)}") from exc


# ------------------------------------------------------------------ finding runs


def _is_run(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).exists() for f in (MANIFEST_FILE, STATE_FILE, run_files.PROGRESS_FILE)
    )


def run_names(runs_dir: Path) -> list[str]:
    if not runs_dir.is_dir():
        return []
    return sorted(p.name for p in runs_dir.iterdir() if _is_run(p))


def find_run(name: str, runs_dir: str | Path = DEFAULT_RUNS_DIR) -> Path:
    runs_dir = Path(runs_dir)
    path = runs_dir / name
    if _is_run(path):
        return path
    names = run_names(runs_dir)
    known = f"runs: {', '.join(names)}" if names else "no runs there yet"
    raise RunNotFound(f"no run named {name!r} under {runs_dir}/; {known}")


# ------------------------------------------------------------------ state of one run


@dataclass
class RunInfo:
    name: str
    run_dir: Path
    phase: str  # the status's, or Stopped / Failed when the run's process is gone
    status: LoRARLJobStatus
    pid: int | None  # the `lorarl run` process, while it runs
    status_url: str | None
    started_at: float | None
    checkpoint_steps: list[int]

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def summary(self, now: float | None = None) -> dict:
        st, now = self.status, now or time.time()
        return {
            "name": self.name,
            "where": "local",
            "runDir": str(self.run_dir),
            "phase": self.phase,
            "step": st.step,
            "totalSteps": st.total_steps,
            "rewardMean": st.metrics.reward_mean if st.metrics else None,
            "evalAccuracy": st.eval.accuracy if st.eval else None,
            "ageSeconds": None if self.started_at is None else max(0.0, now - self.started_at),
            "pid": self.pid,
            "statusUrl": self.status_url,
            "checkpointSteps": self.checkpoint_steps,
        }


def live_pid(state: dict | None) -> int | None:
    """The recorded `lorarl run` process if it still runs (and is the same process)."""
    if not state or "exitCode" in state or not isinstance(state.get("pid"), int):
        return None
    pid = state["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    start = _process_start(pid)
    if state.get("pidStart") and start is not None and start != state["pidStart"]:
        return None  # the pid was reused by another process
    return pid


MODEL_RECORD = "model.json"  # a hub id run's model and commit (local/hub_model.py writes it)


def recorded_model(run_dir: Path) -> ModelStatus | None:
    """The hub id and commit a run loaded (`status.model`), if it loaded one."""
    try:
        record = json.loads((run_dir / MODEL_RECORD).read_text())
        return ModelStatus(source=record["source"], revision=record["revision"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the checkpoints in the folder (complete or not; the trainer verifies them)."""
    steps = []
    for path in (run_dir / "checkpoints").glob("step-*"):
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            steps.append(int(suffix))
    return sorted(steps)


def run_info(run_dir: Path) -> RunInfo:
    from lorarl.server import views

    state = read_state(run_dir)
    pid = live_pid(state)
    try:
        progress: Progress | None = run_files.read_progress(run_dir)
    except run_files.RunFilesError:
        progress = None
    if progress is not None:
        status = views.status_from_progress(progress)
    else:
        status = LoRARLJobStatus(phase="Pending")
        with contextlib.suppress(UserError):
            status.total_steps = load_manifest(run_dir).spec.training.steps
    status.model = recorded_model(run_dir)
    phase: str = status.phase or "Pending"  # a local run may also be "Stopped"
    if pid is None and phase not in ("Succeeded", "Failed"):
        # progress.json says the run goes on, but its process is gone: how it ended
        code = (state or {}).get("exitCode")
        phase, why = {
            None: ("Stopped", "the run's process is gone (killed, or the machine restarted)"),
            INTERRUPTED: ("Stopped", "stopped (Ctrl-C or `lorarl stop`)"),
        }.get(code, ("Failed", f"`lorarl run` exited with code {code}; see logs/"))
        status.conditions = [
            Condition(type=phase, status="True", reason=phase, message=why),
            *[c for c in status.conditions if c.type not in ("Running", phase)],
        ]
    return RunInfo(
        name=run_dir.name,
        run_dir=run_dir,
        phase=phase,
        status=status.with_columns(),
        pid=pid,
        status_url=(state or {}).get("statusUrl") if pid else None,
        started_at=(progress.started_at if progress else None) or (state or {}).get("startedAt"),
        checkpoint_steps=checkpoint_steps(run_dir),
    )


def list_runs(runs_dir: str | Path = DEFAULT_RUNS_DIR) -> list[RunInfo]:
    runs_dir = Path(runs_dir)
    return [run_info(runs_dir / name) for name in run_names(runs_dir)]


# ------------------------------------------------------------------ acting on a run


def stop_run(run_dir: Path, timeout_s: float = 60.0) -> int | None:
    """SIGTERM the `lorarl run` process, which stops its children as on Ctrl-C (each process
    group gets SIGTERM, then SIGKILL after a grace) and records exit code 130; waits for it.
    Returns the pid stopped, None when the run was not running."""
    pid = live_pid(read_state(run_dir))
    if pid is None:
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if live_pid(read_state(run_dir)) is None:
            return pid
        time.sleep(0.1)
    raise UserError(
        f"the run (pid {pid}) did not stop within {timeout_s:.0f} s; `kill -9 {pid}` ends it"
    )


def delete_run(run_dir: Path) -> None:
    pid = live_pid(read_state(run_dir))
    if pid is not None:
        raise UserError(
            f"run {run_dir.name!r} is running (pid {pid}); `lorarl stop {run_dir.name} --local` "
            "first"
        )
    shutil.rmtree(run_dir)


def log_files(run_dir: Path, role: str | None) -> list[Path]:
    """The children's logs of a role (default: the trainer's), oldest replica first."""
    files = sorted((run_dir / LOGS_DIR).glob("*.log"))
    containers = ROLE_CONTAINERS[role or "trainer"]
    chosen = [f for f in files if f.stem.rsplit("-", 1)[-1] in containers]
    if not chosen:
        have = sorted({f.stem.rsplit("-", 1)[-1] for f in files})
        roles = [r for r, names in ROLE_CONTAINERS.items() if set(names) & set(have)]
        raise UserError(
            f"run {run_dir.name!r} has no {role or 'trainer'} logs in {run_dir / LOGS_DIR}"
            + (f"; roles with logs: {', '.join(roles)}" if roles else "")
        )
    return chosen
