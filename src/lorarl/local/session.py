"""One `lorarl run --local` session: the run, its status API, what the terminal shows, and a
clean stop on success, failure or Ctrl-C."""

from __future__ import annotations

import signal
from pathlib import Path

from rich.console import Console

from lorarl.api.reports import run_files
from lorarl.api.resource import LoRARLJob
from lorarl.local.cluster_fields import local_warning
from lorarl.local.console import LiveView, summary
from lorarl.local.cpu_dtype import emulated_bf16_warning, read_cpuinfo
from lorarl.local.engine_python import find_engine_python
from lorarl.local.hub_model import fetch_job_model, record_model
from lorarl.local.preflight import check_inputs
from lorarl.local.prior_run import prepare_run_dir
from lorarl.local.runner import LocalRun, RunFailed
from lorarl.local.runs import record_end, record_start, record_status_url, recorded_model


def run_local(
    job: LoRARLJob,
    *,
    run_dir: str | None = None,
    status_port: int = 8088,
    engine_python: str | None = None,
    console: Console | None = None,
    existing: str = "ask",
) -> int:
    """Run `job` here until it ends; the exit code. Raises UserError (a missing input file or
    engine interpreter; a run already in the run folder, unless `existing` is "resume" or
    "fresh": local/prior_run.py) before any process starts."""
    console = console or Console()
    check_inputs(job)
    # A hub id: fetched before the run folder changes (a HubError is one line); the warnings
    # below still read the job as written.
    fetched, snapshot = fetch_job_model(job)
    if snapshot is not None:
        console.print(f"model {snapshot.repo} at commit {snapshot.revision}", highlight=False)
    engine_python = find_engine_python(engine_python, module=job.spec.rollout.engine)
    folder = Path(run_dir or Path("runs") / job.name)
    note = prepare_run_dir(folder, existing, job.spec.training.resume)
    if note:
        console.print(note, highlight=False)
    recorded = recorded_model(folder)  # a run continued: its checkpoints are on that commit
    if (
        snapshot is not None
        and recorded is not None
        and (recorded.source, recorded.revision) != (snapshot.repo, snapshot.revision)
        and recorded.source == snapshot.repo
    ):
        fetched, snapshot = fetch_job_model(job, revision=recorded.revision)
        console.print(
            f"the continued run loaded commit {recorded.revision}: it goes on with it",
            highlight=False,
        )
    run = LocalRun(fetched, folder, engine_python=engine_python)
    if snapshot is not None:
        record_model(run.run_dir, snapshot)
    stop_status = None
    code = 1
    # SIGTERM (e.g. from a CI timeout, or `lorarl stop`) takes the same path as Ctrl-C: stop
    # every child.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        record_start(run.run_dir, job)  # for `lorarl status/stop/resume`
        run.start()
        console.print(f"run directory: {run.run_dir} (logs in {run.run_dir / 'logs'})")
        for warning in (
            local_warning(job),
            emulated_bf16_warning(job.spec.model.dtype, read_cpuinfo()),
        ):
            if warning:
                console.print(f"[yellow]{warning}[/]", highlight=False)
        if status_port >= 0:
            stop_status = _start_status_api(job, run, status_port, console)
        with LiveView(console, job.name, job.spec.training.steps) as view:
            result = run.wait(on_poll=lambda r: view.update(r.progress()))
        code = 0
    except RunFailed as exc:
        console.print(f"[red]run failed:[/] {exc}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/]")
        code = 130
        return 130
    finally:
        run.stop()
        if stop_status:
            stop_status()
        record_end(run.run_dir, code)
        signal.signal(signal.SIGTERM, previous)
    summary(console, run_files.read_history(run.run_dir), run_files.read_progress(run.run_dir))
    console.print(f"adapter: {run.run_dir / 'adapter'}  ({result.seconds:.0f} s)")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _start_status_api(job: LoRARLJob, run: LocalRun, port: int, console: Console):
    from lorarl.server.app import create_app
    from lorarl.server.serve import serve_in_thread
    from lorarl.server.stores.local import LocalStore

    store = LocalStore()
    store.add(run.job, run.progress_url, run_dir=run.run_dir)
    try:
        url, stop = serve_in_thread(create_app(store, loopback_only=True), port=port)
    except OSError as exc:
        console.print(f"[yellow]status API not started (port {port}: {exc.strerror})[/]")
        return None
    console.print(f"status API and dashboard: {url}/  (jobs at {url}/v1/jobs)")
    record_status_url(run.run_dir, url)
    return stop
