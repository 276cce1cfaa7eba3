"""`lorarl run --local` on a run folder that already holds a run: refuse, --resume or --fresh,
with the job's training.resume (local/prior_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from lorarl.api.reports import run_files
from lorarl.api.reports.progress import Progress
from lorarl.api.validation import load_job_file
from lorarl.errors import UserError
from lorarl.local import session
from lorarl.local.prior_run import find_prior_run, prepare_run_dir
from lorarl.local.runner import RUN_UID_FILE


def _earlier_run(run_dir, step=12, total=30, checkpoints=(10,), phase="Failed"):
    run_dir.mkdir(parents=True)
    (run_dir / RUN_UID_FILE).write_text("local-earlier\n")
    progress = Progress(job=run_dir.name, phase=phase, step=step, total_steps=total)
    (run_dir / run_files.PROGRESS_FILE).write_text(progress.model_dump_json(by_alias=True))
    for s in checkpoints:
        (run_dir / "checkpoints" / f"step-{s:06d}").mkdir(parents=True)
    return run_dir


def test_a_folder_with_nothing_done_is_no_run(tmp_path):
    assert find_prior_run(tmp_path / "missing") is None
    started = tmp_path / "started"
    started.mkdir()
    (started / RUN_UID_FILE).write_text("local-x\n")  # a session started, no step done
    assert find_prior_run(started) is None
    assert prepare_run_dir(started) is None


def test_an_earlier_run_is_refused_naming_it_and_both_flags(tmp_path):
    run_dir = _earlier_run(tmp_path / "runs" / "quickstart")
    with pytest.raises(UserError) as err:
        prepare_run_dir(run_dir)
    msg = str(err.value)
    assert f"{run_dir} already holds a run (step 12 of 30, failed, checkpoint at step 10)" in msg
    assert "--resume to continue it" in msg and "--fresh to start over" in msg
    assert str(tmp_path / "runs" / "quickstart.1") in msg
    assert (run_dir / RUN_UID_FILE).read_text() == "local-earlier\n"  # untouched


def test_progress_without_checkpoint_still_counts(tmp_path):
    """Starting again would overwrite its history from step 0: asked too."""
    run_dir = _earlier_run(tmp_path / "r", step=5, checkpoints=())
    with pytest.raises(UserError, match=r"step 5 of 30, failed, no checkpoint yet"):
        prepare_run_dir(run_dir)


def test_resume_keeps_the_folder_and_its_job_uid(tmp_path):
    run_dir = _earlier_run(tmp_path / "r")
    note = prepare_run_dir(run_dir, "resume")
    assert "continuing the run" in note and "step 12 of 30" in note
    assert (run_dir / RUN_UID_FILE).read_text() == "local-earlier\n"


def test_fresh_moves_the_run_aside_and_leaves_the_folder_free(tmp_path):
    run_dir = _earlier_run(tmp_path / "r")
    _earlier_run(tmp_path / "r.1")  # an older one already aside
    note = prepare_run_dir(run_dir, "fresh")
    assert not run_dir.exists()
    moved = tmp_path / "r.2"
    assert str(moved) in note and (moved / RUN_UID_FILE).read_text() == "local-earlier\n"
    assert (moved / "checkpoints" / "step-000010").is_dir()


def test_resume_with_nothing_to_continue_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"--resume: .* holds no run to continue"):
        prepare_run_dir(tmp_path / "none", "resume")


def test_the_jobs_resume_policy_is_honoured(tmp_path):
    run_dir = _earlier_run(tmp_path / "r")
    # required: the manifest asks to continue, no flag needed; nothing to continue is refused
    assert "continuing" in prepare_run_dir(run_dir, "ask", "required")
    with pytest.raises(UserError, match=r"training.resume: required: .* holds no run"):
        prepare_run_dir(tmp_path / "empty", "ask", "required")
    with pytest.raises(UserError, match="--fresh contradicts"):
        prepare_run_dir(run_dir, "fresh", "required")
    # never: --resume contradicts it, and the refusal offers --fresh only
    with pytest.raises(UserError, match="--resume contradicts"):
        prepare_run_dir(run_dir, "resume", "never")
    with pytest.raises(UserError) as err:
        prepare_run_dir(run_dir, "ask", "never")
    assert "training.resume is never: --fresh" in str(err.value)
    assert "--resume" not in str(err.value)
    assert "starting at step 0" in prepare_run_dir(run_dir, "fresh", "never")


def test_a_run_still_running_is_never_continued_or_moved(tmp_path, monkeypatch):
    import lorarl.local.prior_run as prior_run

    run_dir = _earlier_run(tmp_path / "r")
    monkeypatch.setattr(prior_run, "_is_running", lambda d: 4242)
    for existing in ("ask", "resume", "fresh"):
        with pytest.raises(UserError, match=r"still running \(pid 4242"):
            prepare_run_dir(run_dir, existing)
    assert run_dir.is_dir()


def test_run_local_asks_before_anything_starts(tmp_path, monkeypatch):
    job = load_job_file(Path(__file__).parents[3] / "examples" / "quickstart.yaml")
    run_dir = _earlier_run(tmp_path / "r")
    monkeypatch.setattr(session, "check_inputs", lambda job: None)
    monkeypatch.setattr(session, "find_engine_python", lambda *a, **k: "python")
    started = []
    monkeypatch.setattr(session, "LocalRun", lambda *a, **k: started.append(a))
    with pytest.raises(UserError, match="already holds a run"):
        session.run_local(job, run_dir=str(run_dir))
    assert started == []


def test_cli_flags(tmp_path):
    from lorarl.cli.main import main

    runner = CliRunner()
    job = tmp_path / "job.yaml"
    job.write_text("apiVersion: lorarl.dev/v1alpha1\nkind: LoRARLJob\n")
    out = runner.invoke(main, ["run", str(job), "--local", "--resume", "--fresh"])
    assert out.exit_code == 2 and "choose one" in out.output
    out = runner.invoke(main, ["run", str(job), "--fresh"])
    assert out.exit_code == 2 and "--fresh is for --local runs" in out.output
