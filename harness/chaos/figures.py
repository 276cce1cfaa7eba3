"""One fault's figures for issue #17's matrix: a job's summary, several jobs combined, and
the acceptance verdict (harness/chaos/run.py runs the jobs that produce them)."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # run.py imports this module
    from harness.chaos.faults import Watcher
    from harness.chaos.run import Fault, Injection

Obj = dict[str, Any]

TRAINER_FAULTS = ("trainer_rank_kill",)
# Loose "the reward curve continues": the 5 steps after recovery average no lower than the 5
# before the fault minus this (a step's mean over 128 samples moves ~0.05 on its own).
REWARD_SLACK = 0.2
# A rollout-side fault may cost the trainer a slower step, never a stall: the issue's "a removed
# engine is dropped without failing the step, its requests retried elsewhere".
STALL_LIMIT_S = 60.0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summary(fault: Fault, done: list[Injection], phase: str, w: Watcher, status: Obj,
            latest: str, bad: list[str]) -> Obj:  # fmt: skip
    recover = [i.seconds_to_recover for i in done if i.seconds_to_recover is not None]
    next_step = [i.seconds_to_next_step for i in done if i.seconds_to_next_step is not None]
    compared = [i for i in done if i.reward_before is not None and i.reward_after is not None]
    lags = [i.scale_up_lag_steps for i in done if i.scale_up_lag_steps is not None]
    dups = [d for d in w.duplicates if "watcher error" not in d]
    return {
        "fault": fault.name,
        "what": fault.what,
        "runs": len(done),
        "succeeded": sum(i.recovered for i in done) if phase == "Succeeded" else 0,
        "phase": phase,
        "steps_lost_max": max((i.steps_lost for i in done), default=0),
        "trainer_restarts": max(w.max_restarts, status.get("restarts", 0)),
        "rollout_restarts": status.get("rolloutRestarts"),
        "rollout_preemptions": status.get("rolloutPreemptions"),
        "checkpoints_bad": len(bad),
        "checkpoints_bad_detail": bad,
        "duplicate_children": len(dups),
        "duplicate_detail": dups[:5],
        "engines_on_latest": latest.startswith("ok"),
        "engines_on_latest_detail": latest,
        "reward_continues": bool(compared)
        and all(i.reward_after >= i.reward_before - REWARD_SLACK for i in compared),  # type: ignore[operator]
        "seconds_to_recover_p50": _pct(recover, 0.5),
        "seconds_to_recover_p95": _pct(recover, 0.95),
        "seconds_to_next_step_p50": _pct(next_step, 0.5),
        "seconds_to_next_step_p95": _pct(next_step, 0.95),
        **(
            {"scale_up_lag_steps_max": max(lags) if lags else None} if fault.name == "scale" else {}
        ),
        "injections": [asdict(i) for i in done],
    }


def combine(runs: list[Obj]) -> Obj:
    """One fault's figures over the jobs it took: counts add up, worst cases win, percentiles
    are over every injection."""
    if len(runs) == 1:
        return {**runs[0], "job_runs": 1}
    injections = [i for r in runs for i in r["injections"]]
    for k, inj in enumerate(injections):
        inj["index"] = k

    def values(key: str) -> list[float]:
        return [i[key] for i in injections if i.get(key) is not None]

    def total(key: str) -> int | None:
        found = [r[key] for r in runs if r.get(key) is not None]
        return sum(found) if found else None

    failed = [r["phase"] for r in runs if r["phase"] != "Succeeded"]
    out = {
        **runs[0],
        "runs": len(injections),
        "succeeded": sum(r["succeeded"] for r in runs),
        "phase": failed[0] if failed else "Succeeded",
        "steps_lost_max": max(r["steps_lost_max"] for r in runs),
        "trainer_restarts": sum(r["trainer_restarts"] for r in runs),
        "rollout_restarts": total("rollout_restarts"),
        "rollout_preemptions": total("rollout_preemptions"),
        "checkpoints_bad": sum(r["checkpoints_bad"] for r in runs),
        "checkpoints_bad_detail": [d for r in runs for d in r["checkpoints_bad_detail"]],
        "duplicate_children": sum(r["duplicate_children"] for r in runs),
        "duplicate_detail": [d for r in runs for d in r["duplicate_detail"]][:5],
        "engines_on_latest": all(r["engines_on_latest"] for r in runs),
        "engines_on_latest_detail": " | ".join(r["engines_on_latest_detail"] for r in runs),
        "reward_continues": all(r["reward_continues"] for r in runs),
        "seconds_to_recover_p50": _pct(values("seconds_to_recover"), 0.5),
        "seconds_to_recover_p95": _pct(values("seconds_to_recover"), 0.95),
        "seconds_to_next_step_p50": _pct(values("seconds_to_next_step"), 0.5),
        "seconds_to_next_step_p95": _pct(values("seconds_to_next_step"), 0.95),
        "injections": injections,
        "seconds": round(sum(r["seconds"] for r in runs), 1),
        "total_steps": sum(r["total_steps"] for r in runs),
        "job_runs": len(runs),
    }
    if "scale_up_lag_steps_max" in runs[0]:
        lags = values("scale_up_lag_steps")
        out["scale_up_lag_steps_max"] = max(lags) if lags else None
    tails = [r["trainer_log_tail"] for r in runs if "trainer_log_tail" in r]
    out.pop("trainer_log_tail", None)
    if tails:
        out["trainer_log_tail"] = tails[0]
    return out


def acceptance(result: Obj, checkpoint_interval: int) -> list[str]:
    """What issue #17 requires of one fault's figures; empty when all hold."""
    trainer_side = result["fault"] in TRAINER_FAULTS
    problems = []
    requested = result.get("injections_requested", result["runs"])
    if result["runs"] < requested:
        problems.append(f"{result['runs']} of {requested} injections made")
    if result["phase"] != "Succeeded" or result["succeeded"] != result["runs"]:
        problems.append(f"succeeded {result['succeeded']}/{result['runs']}, job {result['phase']}")
    allowed = checkpoint_interval if trainer_side else 0
    if result["steps_lost_max"] > allowed:
        problems.append(f"steps lost {result['steps_lost_max']} > {allowed}")
    if not trainer_side and result["trainer_restarts"]:
        problems.append(f"{result['trainer_restarts']} trainer restarts")
    for key in ("checkpoints_bad", "duplicate_children"):
        if result[key]:
            problems.append(f"{key} {result[key]}: {result[f'{key}_detail']}")
    if not result["engines_on_latest"]:
        problems.append(f"engines not on latest: {result['engines_on_latest_detail']}")
    if not result["reward_continues"]:
        fell = [(i.get("reward_before"), i.get("reward_after")) for i in result["injections"]
                if i.get("reward_before") is not None and i.get("reward_after") is not None
                and i["reward_after"] < i["reward_before"] - REWARD_SLACK]  # fmt: skip
        problems.append(f"the reward fell more than {REWARD_SLACK} across a fault: {fell}")
    stalls = [
        s
        for i in result["injections"]
        for s in (i["seconds_to_next_step"], i.get("scale_down_next_step_s"))
        if s is not None and s > STALL_LIMIT_S
    ]
    if not trainer_side and result["fault"] != "reward_kill" and stalls:
        problems.append(f"the trainer recorded no step for {max(stalls):.0f} s after a fault")
    if result.get("scale_up_lag_steps_max") is not None and result["scale_up_lag_steps_max"] > 1:
        problems.append(f"third engine served {result['scale_up_lag_steps_max']} steps late")
    return problems
