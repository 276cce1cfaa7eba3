"""The chaos matrix's verdict: what counts as a pass for issue #17, and how a fault that took
several jobs (one ended before all its injections) is reported."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from harness.chaos.figures import acceptance, combine
from harness.chaos.run import step_in_progress


def _run(injections: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    base = {
        "fault": "engine_kill", "what": "kill", "runs": len(injections),
        "succeeded": len(injections), "phase": "Succeeded", "steps_lost_max": 0,
        "trainer_restarts": 0, "rollout_restarts": 1, "rollout_preemptions": None,
        "checkpoints_bad": 0, "checkpoints_bad_detail": [], "duplicate_children": 0,
        "duplicate_detail": [], "engines_on_latest": True, "engines_on_latest_detail": "ok: v9",
        "reward_continues": True, "injections": injections, "seconds": 100.0, "total_steps": 40,
    }  # fmt: skip
    return base | over


def _inj(recover: float, next_step: float) -> dict[str, Any]:
    return {"index": 0, "seconds_to_recover": recover, "seconds_to_next_step": next_step}


def test_a_fault_over_two_jobs_counts_every_injection_and_keeps_the_worst_case() -> None:
    first = _run([_inj(50, 2), _inj(60, 3)], steps_lost_max=0, rollout_restarts=2)
    second = _run([_inj(90, 4)], steps_lost_max=1, engines_on_latest=False,
                  engines_on_latest_detail="NO: v3", checkpoints_bad=1,
                  checkpoints_bad_detail=["step-3: digest"])  # fmt: skip
    out = combine([first, second])
    assert (out["runs"], out["succeeded"], out["job_runs"]) == (3, 3, 2)
    assert [i["index"] for i in out["injections"]] == [0, 1, 2]
    assert out["steps_lost_max"] == 1 and out["rollout_restarts"] == 3
    assert out["engines_on_latest"] is False and "NO: v3" in out["engines_on_latest_detail"]
    assert out["checkpoints_bad"] == 1 and out["checkpoints_bad_detail"] == ["step-3: digest"]
    assert out["seconds_to_recover_p50"] == 60 and out["seconds_to_recover_p95"] == 90
    assert out["seconds"] == 200.0 and out["total_steps"] == 80


def test_a_failed_job_among_several_fails_the_fault() -> None:
    out = combine([_run([_inj(50, 2)]), _run([_inj(50, 2)], phase="Failed", succeeded=0)])
    out["injections_requested"] = 2
    assert out["phase"] == "Failed"
    assert any("succeeded 1/2" in p for p in acceptance(out, 3))


def test_fewer_injections_than_asked_is_not_a_pass() -> None:
    out = combine([_run([_inj(50, 2)] * 7)])
    out["injections_requested"] = 10
    assert acceptance(out, 3) == ["7 of 10 injections made"]
    out["injections_requested"] = 7
    assert acceptance(out, 3) == []


def test_a_rollout_fault_may_not_restart_the_trainer_nor_stall_it() -> None:
    out = combine([_run([_inj(50, 75)], trainer_restarts=1)])
    problems = acceptance(out, 3)
    assert "1 trainer restarts" in problems
    assert any("no step for 75 s" in p for p in problems)
    trainer = combine([_run([_inj(50, 75)], fault="trainer_rank_kill", trainer_restarts=1,
                            steps_lost_max=3)])  # fmt: skip
    assert acceptance(trainer, 3) == []
    assert acceptance(trainer | {"steps_lost_max": 4}, 3) == ["steps lost 4 > 3"]


def test_a_reward_that_falls_across_a_fault_is_not_a_pass() -> None:
    fell = _inj(50, 2) | {"reward_before": 0.9, "reward_after": 0.4}
    out = combine([_run([_inj(50, 2), fell], reward_continues=False)])
    assert acceptance(out, 3) == ["the reward fell more than 0.2 across a fault: [(0.9, 0.4)]"]


def test_no_injection_is_made_too_close_to_the_jobs_end_to_see_it_recover() -> None:
    from harness.chaos.run import FAULTS, FINAL_READ_STEPS, room_needed

    fault = FAULTS["engine_kill"]
    assert room_needed(fault, 0) == fault.steps_per_injection + FINAL_READ_STEPS
    slow = 2 * fault.steps_per_injection  # a recovery twice as long as estimated
    assert room_needed(fault, slow) == 3 * fault.steps_per_injection + FINAL_READ_STEPS


def test_a_job_is_sized_for_its_injections_and_the_last_ones_recovery() -> None:
    from harness.chaos.run import FAULTS, MAX_JOB_STEPS, job_steps, room_needed

    fault = FAULTS["sidecar_kill"]
    steps = job_steps(fault, 10, first_at=4)
    # injections every steps_per_injection from step 4: the 10th still has room to recover
    last = 4 + 9 * fault.steps_per_injection
    assert steps - last == fault.steps_per_injection + room_needed(fault, 0)
    assert job_steps(FAULTS["scale"], 20, first_at=4) == MAX_JOB_STEPS  # the rest: next job


def test_the_step_in_progress_comes_from_the_trainers_row_times_not_the_polled_count() -> None:
    """Rows of steps 4-6 written at t=10, 11, 12, step 5 redone at 20 after a restart: at t=10.5
    the trainer ran step 5, at t=15 (between the crash and the redo) step 5 again."""
    w = SimpleNamespace(records={4: {10.0: {}}, 5: {11.0: {}, 20.0: {}}, 6: {12.0: {}, 21.0: {}}})
    assert step_in_progress(w, 10.5) == 5
    assert step_in_progress(w, 15.0) == 5
    assert step_in_progress(w, 9.0) == 4
    assert step_in_progress(w, 30.0) is None  # nothing written after it yet


def test_a_jobs_post_mortem_keeps_its_rows_in_time_order_and_only_its_pods_logs(tmp_path) -> None:
    from harness.chaos.run import Injection, _keep_history
    from harness.cluster.jobs import JOB_LABEL

    def pod(job: str, key: str) -> SimpleNamespace:
        folder = tmp_path / "node" / key / "engine"
        (folder / "0.root").mkdir(parents=True)  # a restart's rootfs sits beside its log
        (folder / "0.root" / "hostname").write_text("pod\n")
        (folder / "0.log").write_text(f"{key} first\n")
        (folder / "1.log").write_text(f"{key} after a restart\n")
        ctr = SimpleNamespace(name="engine", log_path=folder / "1.log")
        meta = {"labels": {JOB_LABEL: job}}
        return SimpleNamespace(key=key, pod={"metadata": meta}, containers=[ctr])

    pods = {1: pod("j", "default/j-r0"), 2: pod("other", "default/o-r0")}
    c = SimpleNamespace(kubelet=SimpleNamespace(pods=pods))

    def row(step: int, t: float) -> dict[float, dict[str, float]]:
        return {t: {"step": step, "time": t}}

    w = SimpleNamespace(records={2: row(2, 20.0), 1: row(1, 10.0) | row(1, 30.0)})
    _keep_history(tmp_path / "out" / "j", c, w, [Injection(0, 1, 15.0, "kill")])
    kept = json.loads((tmp_path / "out" / "j" / "history.json").read_text())
    assert [r["time"] for r in kept["history"]] == [10.0, 20.0, 30.0]  # the redone step 1 too
    assert kept["injections"][0]["detail"] == "kill"
    logs = tmp_path / "out" / "j" / "logs"
    assert sorted(p.relative_to(logs).as_posix() for p in logs.rglob("*") if p.is_file()) == [
        "default/j-r0/engine/0.log", "default/j-r0/engine/1.log"]  # fmt: skip
