"""Day-to-day commands on jobs: `lorarl list`, `status`, `logs`, `stop`, `resume`, `delete`, and
`lorarl dashboard` over past local runs.

With --local they act on the run folders `lorarl run --local` leaves under runs/
(lorarl.local.runs); without, on the LoRARLJobs of the current cluster through the Kubernetes API
(lorarl.cluster), as `lorarl run` does. Errors are one line (a UserError, which the CLI prints
as `Error: ...` with exit 1).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import click

from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.errors import UserError
from lorarl.local.runs import DEFAULT_RUNS_DIR, ROLE_CONTAINERS

ROLES = tuple(ROLE_CONTAINERS)


def _where(fn):
    """--local/--runs-dir for run folders; -n/--kubeconfig for the cluster."""
    options = [
        click.option("--local", is_flag=True, help="The runs of `lorarl run --local` here."),
        click.option(
            "--runs-dir",
            type=click.Path(file_okay=False),
            default=DEFAULT_RUNS_DIR,
            show_default=True,
            help="With --local: where the run folders are.",
        ),
        click.option("-n", "--namespace", help="Namespace (default: the context's)."),
        click.option("--kubeconfig", type=click.Path(dir_okay=False)),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _cluster(namespace, kubeconfig):
    from lorarl.cluster import Cluster

    return Cluster(namespace, kubeconfig)


def _local_only_options(local: bool, namespace, kubeconfig) -> None:
    if local and (namespace or kubeconfig):
        raise click.UsageError("--namespace/--kubeconfig are for a cluster; drop them with --local")


# ------------------------------------------------------------------ formatting


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _row(name: str, phase: str | None, status: LoRARLJobStatus, age: float | None) -> dict:
    return {
        "name": name,
        "phase": phase or "-",
        "step": status.step,
        "totalSteps": status.total_steps,
        "rewardMean": status.metrics.reward_mean if status.metrics else None,
        "evalAccuracy": status.eval.accuracy if status.eval else None,
        "ageSeconds": age,
    }


def _table(rows: list[dict], extra: tuple[str, ...] = ()) -> None:
    header = ["NAME", "PHASE", "STEPS", "REWARD", "EVAL", "AGE", *(e.upper() for e in extra)]
    lines = [header]
    for r in rows:
        steps = "-" if r["totalSteps"] is None else f"{r['step'] or 0}/{r['totalSteps']}"
        cells = [r["name"], r["phase"], steps, _fmt(r["rewardMean"]), _fmt(r["evalAccuracy"])]
        lines.append([*cells, _age(r["ageSeconds"]), *(str(r.get(e) or "") for e in extra)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for line in lines:
        click.echo("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def _progress_line(name: str, phase: str | None, st: LoRARLJobStatus) -> str:
    parts = [name, phase or "Pending"]
    if st.total_steps is not None:
        parts.append(f"step {st.step or 0}/{st.total_steps}")
    m = st.metrics
    if m is not None and m.reward_mean is not None:
        std = f" ± {m.reward_std:.3f}" if m.reward_std is not None else ""
        parts.append(f"reward {m.reward_mean:.3f}{std}")
        if m.kl is not None:
            parts.append(f"kl {m.kl:.4f}")
        if m.tokens_per_second:
            parts.append(f"{m.tokens_per_second:.0f} tok/s")
    if st.last_sync is not None and st.last_sync.seconds is not None:
        parts.append(f"sync {st.last_sync.seconds * 1000:.0f} ms")
    return " · ".join(parts)


def _print_status(name: str, phase: str | None, st: LoRARLJobStatus, where: str) -> None:
    click.echo(_progress_line(name, phase, st))
    click.echo(f"  where:      {where}")
    if st.conditions:
        click.echo("  conditions:")
        for c in st.conditions:
            message = f": {c.message}" if c.message else ""
            when = f" (since {c.last_transition_time})" if c.last_transition_time else ""
            click.echo(f"    {c.type}={c.status} {c.reason}{message}{when}")
    if st.baseline_eval is not None:
        click.echo(f"  {st.baseline_eval.line()}")
    click.echo(f"  last {st.eval.line()}" if st.eval is not None else "  last eval:  none yet")
    if st.model is not None:
        click.echo(f"  model:      {st.model.source} at commit {st.model.revision}")
    if st.checkpoint is not None:
        click.echo(f"  checkpoint: step {st.checkpoint.step}")
    if st.adapter_path:
        click.echo(f"  adapter:    {st.adapter_path}")


def _status_of(obj: dict) -> LoRARLJobStatus:
    try:
        return LoRARLJobStatus.model_validate(obj.get("status") or {})
    except ValueError:
        return LoRARLJobStatus()  # written by another lorarl version: show the name at least


def _created_age(obj: dict) -> float | None:
    from lorarl.server.views import parse_rfc3339

    created = parse_rfc3339((obj.get("metadata") or {}).get("creationTimestamp"))
    return None if created is None else max(0.0, time.time() - created)


def _total_steps(obj: dict, st: LoRARLJobStatus) -> LoRARLJobStatus:
    if st.total_steps is None:  # not reconciled yet: the spec says it
        total = ((obj.get("spec") or {}).get("training") or {}).get("totalSteps")
        st = st.model_copy(update={"total_steps": total})
    return st


# ------------------------------------------------------------------ commands


@click.command("list")
@_where
@click.option("-A", "--all-namespaces", is_flag=True, help="Cluster: every namespace.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job, in a list.")
def list_cmd(local, runs_dir, namespace, kubeconfig, all_namespaces, as_json) -> None:
    """List jobs: phase, steps done of total, last reward, last eval accuracy, age."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import list_runs

        runs = list_runs(runs_dir)
        if as_json:
            click.echo(json.dumps([r.summary() for r in runs], indent=1))
            return
        if not runs:
            click.echo(f"no runs under {runs_dir}/")
            return
        now = time.time()
        rows = []
        for r in runs:
            age = None if r.started_at is None else now - r.started_at
            rows.append({**_row(r.name, r.phase, r.status, age), "pid": r.pid})
        _table(rows, extra=("pid",))
        return
    cluster = _cluster(namespace, kubeconfig)
    objs = cluster.list(all_namespaces)
    rows = []
    for obj in objs:
        st = _total_steps(obj, _status_of(obj))
        row = _row(obj["metadata"]["name"], st.phase, st, _created_age(obj))
        rows.append({**row, "namespace": obj["metadata"].get("namespace")})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    elif not rows:
        where = "any namespace" if all_namespaces else f"namespace {cluster.namespace!r}"
        click.echo(f"no LoRARLJobs in {where}")
    else:
        _table(rows, extra=("namespace",) if all_namespaces else ())


@click.command("status")
@click.argument("job")
@_where
@click.option("--json", "as_json", is_flag=True, help="The full status as JSON.")
def status_cmd(job, local, runs_dir, namespace, kubeconfig, as_json) -> None:
    """A job's progress line, conditions, last eval, checkpoint and adapter."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import find_run, run_info

        info = run_info(find_run(job, runs_dir))
        if as_json:
            click.echo(json.dumps({**info.summary(), "status": info.status.wire()}, indent=1))
            return
        where = f"local run in {info.run_dir}"
        where += f", running (pid {info.pid})" if info.alive else ", not running"
        if info.checkpoint_steps:
            where += f"; checkpoints at steps {', '.join(map(str, info.checkpoint_steps))}"
        _print_status(info.name, info.phase, info.status, where)
        if info.status_url:
            click.echo(f"  dashboard:  {info.status_url}/")
        return
    cluster = _cluster(namespace, kubeconfig)
    obj = cluster.get(job)
    st = _total_steps(obj, _status_of(obj))
    if as_json:
        click.echo(json.dumps({"name": job, "namespace": cluster.namespace, "status": st.wire()}))
        return
    _print_status(job, st.phase, st, f"namespace {cluster.namespace} at {cluster.host}")


@click.command("logs")
@click.argument("job")
@click.option(
    "--role", type=click.Choice(ROLES), default="trainer", show_default=True,
    help="Whose logs: the trainer, the rollout engines, their sync sidecars or the reward "
    "service.",
)  # fmt: skip
@click.option("-f", "--follow", is_flag=True, help="Keep printing until the job's process ends.")
@_where
def logs_cmd(job, role, follow, local, runs_dir, namespace, kubeconfig) -> None:
    """Print a job's logs (of every replica of the role, each line prefixed when several)."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import find_run, log_files

        run_dir = find_run(job, runs_dir)
        _follow_files(run_dir, log_files(run_dir, role), follow)
        return
    cluster = _cluster(namespace, kubeconfig)
    pods, container = cluster.log_pods(job, role)
    prefix = len(pods) > 1
    if not follow:
        for pod in pods:
            for line in cluster.logs(pod, container).splitlines():
                click.echo(f"[{pod}] {line}" if prefix else line)
        return
    lock = threading.Lock()

    def stream(pod: str) -> None:
        buffered = b""
        for chunk in cluster.logs(pod, container, follow=True):
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            with lock:
                for line in lines:
                    text = line.decode(errors="replace")
                    click.echo(f"[{pod}] {text}" if prefix else text)

    threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _follow_files(run_dir: Path, files: list[Path], follow: bool, poll_s: float = 0.2) -> None:
    from lorarl.local.runs import live_pid, read_state

    prefix = len(files) > 1
    handles = {f: open(f, "rb") for f in files}  # noqa: SIM115 (closed below)
    pending = dict.fromkeys(files, b"")
    try:
        while True:
            running = follow and live_pid(read_state(run_dir)) is not None
            for f, handle in handles.items():
                data = pending[f] + handle.read()
                *lines, pending[f] = data.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    click.echo(f"[{f.stem}] {text}" if prefix else text)
            if not running:
                break
            sys.stdout.flush()
            time.sleep(poll_s)
        for f, rest in pending.items():  # a last line without its newline
            if rest:
                text = rest.decode(errors="replace")
                click.echo(f"[{f.stem}] {text}" if prefix else text)
    finally:
        for handle in handles.values():
            handle.close()


@click.command("stop")
@click.argument("job")
@_where
def stop_cmd(job, local, runs_dir, namespace, kubeconfig) -> None:
    """Stop a job, keeping its checkpoints (`lorarl resume` continues it).

    Locally: SIGTERM to the `lorarl run` process, which stops every child as on Ctrl-C. In a
    cluster: spec.runPolicy.suspend, so the operator deletes the pods and keeps the job."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import checkpoint_steps, find_run, stop_run

        run_dir = find_run(job, runs_dir)
        pid = stop_run(run_dir)
        if pid is None:
            raise UserError(f"run {job!r} is not running (nothing to stop)")
        steps = checkpoint_steps(run_dir)
        since = f"from the checkpoint of step {steps[-1]}" if steps else "at step 0 (no checkpoint)"
        click.echo(f"stopped {job} (pid {pid}); `lorarl resume {job} --local` continues {since}")
        return
    cluster = _cluster(namespace, kubeconfig)
    st = _status_of(cluster.get(job))
    if st.phase in ("Succeeded", "Failed"):
        raise UserError(f"job {job!r} has finished ({st.phase}); nothing to stop")
    cluster.set_suspend(job, True)
    click.echo(
        f"lorarljob.lorarl.dev/{job} suspended: the operator deletes its pods and keeps its "
        f"checkpoints; `lorarl resume {job}` continues it"
    )


@click.command("resume")
@click.argument("job")
@_where
@click.option(
    "--status-port", type=int, default=8088, show_default=True,
    help="With --local: status API + dashboard on 127.0.0.1 (0: any free port, -1: off).",
)  # fmt: skip
@click.option(
    "--engine-python", type=click.Path(dir_okay=False),
    help="With --local: interpreter for the engines (as for `lorarl run`).",
)  # fmt: skip
def resume_cmd(job, local, runs_dir, namespace, kubeconfig, status_port, engine_python) -> None:
    """Continue a stopped job from its newest checkpoint.

    Locally: runs the manifest saved in the run folder again, in that folder (the trainer
    resumes from its checkpoints). In a cluster: clears spec.runPolicy.suspend."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import find_run, load_manifest, run_info
        from lorarl.local.session import run_local

        run_dir = find_run(job, runs_dir)
        info = run_info(run_dir)
        if info.alive:
            raise UserError(f"run {job!r} is still running (pid {info.pid}); nothing to resume")
        if info.phase == "Succeeded":
            raise UserError(
                f"run {job!r} finished ({info.status.step}/{info.status.total_steps} steps); "
                "nothing to resume"
            )
        manifest = load_manifest(run_dir)
        steps = info.checkpoint_steps
        since = f"the checkpoint of step {steps[-1]}" if steps else "step 0 (no checkpoint)"
        click.echo(f"resuming {job} in {run_dir} from {since}")
        code = run_local(
            manifest,
            run_dir=str(run_dir),
            status_port=status_port,
            engine_python=engine_python,
            existing="resume",  # the folder's own run: continue it (local/prior_run.py)
        )
        sys.exit(code)
    cluster = _cluster(namespace, kubeconfig)
    obj = cluster.get(job)
    suspended = ((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend")
    if not suspended:
        phase = _status_of(obj).phase or "Pending"
        raise UserError(f"job {job!r} is not suspended ({phase}); nothing to resume")
    cluster.set_suspend(job, False)
    click.echo(f"lorarljob.lorarl.dev/{job} resumed: it continues from its newest checkpoint")


@click.command("delete")
@click.argument("job")
@_where
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
def delete_cmd(job, local, runs_dir, namespace, kubeconfig, yes) -> None:
    """Delete a job: locally its run folder (checkpoints, adapter, logs); in a cluster the
    LoRARLJob and its pods (what it wrote on volumes stays)."""
    _local_only_options(local, namespace, kubeconfig)
    if local:
        from lorarl.local.runs import delete_run, find_run, live_pid, read_state

        run_dir = find_run(job, runs_dir)
        pid = live_pid(read_state(run_dir))
        if pid is not None:
            raise UserError(f"run {job!r} is running (pid {pid}): `lorarl stop {job} --local`")
        if not yes:
            click.confirm(f"delete {run_dir} (checkpoints, adapter, logs)?", abort=True)
        delete_run(run_dir)
        click.echo(f"deleted {run_dir}")
        return
    cluster = _cluster(namespace, kubeconfig)
    cluster.get(job)
    if not yes:
        click.confirm(f"delete LoRARLJob {cluster.namespace}/{job} and its pods?", abort=True)
    cluster.delete(job)
    click.echo(f'lorarljob.lorarl.dev "{job}" deleted')


@click.command("dashboard")
@click.option(
    "--runs-dir", type=click.Path(file_okay=False), default=DEFAULT_RUNS_DIR, show_default=True
)
@click.option("--port", type=int, default=8088, show_default=True, help="On 127.0.0.1.")
def dashboard_cmd(runs_dir: str, port: int) -> None:
    """Serve the status API and dashboard for the local runs under runs/ (finished, stopped or
    running: each read from its run folder's files), until Ctrl-C."""
    from lorarl.server.serve import serve

    store, skipped = dashboard_store(Path(runs_dir))
    for line in skipped:
        click.echo(line, err=True)
    click.echo(f"dashboard: http://127.0.0.1:{port}/  ({len(store.list_jobs())} runs)")
    serve(store, host="127.0.0.1", port=port)


def dashboard_store(runs_dir: Path):
    """A LocalStore of every run folder with a saved manifest; the lines for those skipped."""
    from lorarl.local.runs import load_manifest, run_names
    from lorarl.server.stores.local import LocalStore

    store, skipped = LocalStore(), []
    for name in run_names(runs_dir):
        try:
            job = load_manifest(runs_dir / name)
        except UserError as exc:
            skipped.append(f"skipped {name}: {exc}")
            continue
        store.add(job, None, run_dir=runs_dir / name)  # no trainer URL: its files, each read
    if not run_names(runs_dir):
        raise UserError(f"no runs under {runs_dir}/ (run one with `lorarl run JOB.yaml --local`)")
    return store, skipped


COMMANDS = (list_cmd, status_cmd, logs_cmd, stop_cmd, resume_cmd, delete_cmd, dashboard_cmd)
