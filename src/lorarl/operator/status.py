"""Pure: what pods and the trainer's progress say about a job -> phase, conditions, metrics.

Conditions follow metav1.Condition: `lastTransitionTime` moves only when `status` flips, and
every condition records the generation it was computed from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lorarl.api.reports.progress import Progress
from lorarl.api.reports.status import Condition, LoRARLJobStatus, Phase, StepMetrics
from lorarl.operator.builders import ATTEMPT_LABEL, INDEX_LABEL, JOB_LABEL, ROLE_LABEL
from lorarl.plan.hub import FETCH_CONTAINER

_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
MAX_MESSAGE = 1024


@dataclass(frozen=True)
class PodView:
    """The few facts about a pod the operator decides on (what the pod index keeps)."""

    name: str
    job: str
    role: str
    index: int
    attempt: int
    phase: str
    deleting: bool = False
    reason: str = ""
    message: str = ""
    exit_code: int | None = None
    uid: str = ""
    gated: bool = False  # held by a scheduling gate (e.g. Kueue's, until the job is admitted)
    # The pod's own status.reason (Evicted, Terminated at a node shutdown...), which `reason`
    # hides behind a failed container's, and the reason of a True DisruptionTarget condition
    # (PreemptionByScheduler, DeletionByTaintManager, TerminationByKubelet, DeletionByPodGC...).
    pod_reason: str = ""
    disruption: str = ""
    model_revision: str = ""  # the commit its fetch-model init container fetched (a hub id)

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting


def pod_view(pod: Mapping[str, Any]) -> PodView | None:
    """None for pods that are not a lorarl job's (missing or malformed labels)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        index, attempt = int(labels[INDEX_LABEL]), int(labels.get(ATTEMPT_LABEL, "0"))
        job, role = labels[JOB_LABEL], labels[ROLE_LABEL]
    except (KeyError, ValueError):
        return None
    status = pod.get("status") or {}
    reason, message, exit_code = termination(status)
    return PodView(
        name=meta.get("name", ""),
        job=job,
        role=role,
        index=index,
        attempt=attempt,
        phase=status.get("phase") or "Pending",
        deleting=bool(meta.get("deletionTimestamp")),
        reason=reason or status.get("reason") or "",
        message=message or status.get("message") or "",
        exit_code=exit_code,
        uid=meta.get("uid", ""),
        gated=bool((pod.get("spec") or {}).get("schedulingGates")),
        pod_reason=str(status.get("reason") or ""),
        disruption=_disruption(status),
        model_revision=fetched_revision(status, FETCH_CONTAINER) or "",
    )


def _disruption(status: Mapping[str, Any]) -> str:
    """The reason of the pod's True DisruptionTarget condition (Kubernetes 1.26+ sets it when a
    node, the scheduler or an eviction is about to end the pod), else ""."""
    for cond in status.get("conditions") or []:
        if (
            isinstance(cond, Mapping)
            and cond.get("type") == "DisruptionTarget"
            and cond.get("status") == "True"
        ):
            return str(cond.get("reason") or "DisruptionTarget")
    return ""


def termination(status: Mapping[str, Any]) -> tuple[str, str, int | None]:
    """(reason, message, exit code) of the first container that terminated unsuccessfully, else
    of the first that terminated at all: what a person needs to see why a pod ended."""
    found: list[tuple[str, str, int | None]] = []
    # An init container that failed (a hub download, say) is why the others never ran; one that
    # succeeded is not a reason for anything.
    inits = [(cs, True) for cs in status.get("initContainerStatuses") or []]
    for cs, init in [*inits, *((cs, False) for cs in status.get("containerStatuses") or [])]:
        term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
            "terminated"
        )
        if term and not (init and term.get("exitCode") == 0):
            found.append((term.get("reason", ""), term.get("message", ""), term.get("exitCode")))
    failed = [f for f in found if f[2] not in (0, None)]
    return (failed or found or [("", "", None)])[0]


def fetched_revision(status: Mapping[str, Any], container: str) -> str | None:
    """The commit an init container fetched: its termination message, once it succeeded."""
    for cs in status.get("initContainerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated") or {}
        if cs.get("name") == container and term.get("exitCode") == 0:
            message = str(term.get("message") or "").strip()
            return message if re.fullmatch(r"[0-9a-f]{40}", message) else None
    return None


def final_progress(message: str) -> Progress | None:
    """The trainer's last report, left by rank 0 as its termination message when it succeeds.

    By the time a trainer pod shows Succeeded its progress endpoint is gone with its process, so
    the steps after the operator's last poll would never reach the status (a finished job would
    show Step 22/30). A message that is not such a report (a log tail) is None."""
    text = message.strip()
    if not text.startswith("{"):
        return None
    try:
        return Progress.model_validate_json(text)
    except ValueError:
        return None


def reason_word(text: str, fallback: str) -> str:
    """A metav1.Condition reason (CamelCase word); free text falls back."""
    return text if text and _REASON.match(text) and len(text) <= 1024 else fallback


def set_condition(
    conditions: Iterable[Condition],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
) -> list[Condition]:
    value: Literal["True", "False"] = "True" if status else "False"
    out, seen = [], False
    for cond in conditions:
        if cond.type != type_:
            out.append(cond)
            continue
        seen = True
        moved = cond.status != value
        out.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message[:MAX_MESSAGE],
                last_transition_time=now
                if moved or not cond.last_transition_time
                else cond.last_transition_time,
                observed_generation=generation,
            )
        )
    if not seen:
        out.append(
            Condition(
                type=type_,
                status=value,
                reason=reason,
                message=message[:MAX_MESSAGE],
                last_transition_time=now,
                observed_generation=generation,
            )
        )
    return out


def condition(status: LoRARLJobStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def is_true(status: LoRARLJobStatus, type_: str) -> bool:
    cond = condition(status, type_)
    return cond is not None and cond.status == "True"


def apply_progress(status: LoRARLJobStatus, progress: Progress | None) -> LoRARLJobStatus:
    """Copy what the trainer reported into the status (a missing report changes nothing)."""
    if progress is None:
        return status
    update: dict[str, Any] = {"step": progress.step, "total_steps": progress.total_steps}
    latest = progress.latest
    if latest is not None:
        # Every StepMetrics field is a StepRecord field of the same name: a metric added to both
        # reaches the CR status without an edit here.
        update["metrics"] = StepMetrics(**{f: getattr(latest, f) for f in StepMetrics.model_fields})
    if progress.last_sync is not None:
        update["last_sync"] = progress.last_sync
    if progress.checkpoint is not None:
        update["checkpoint"] = progress.checkpoint
    if progress.eval is not None:
        update["eval"] = progress.eval
    if progress.baseline_eval is not None:
        update["baseline_eval"] = progress.baseline_eval
    if progress.adapter_path:
        update["adapter_path"] = progress.adapter_path
    return status.model_copy(update=update)


def phase_of(
    *,
    trainer_ready: bool,
    rollout_ready: bool,
    any_running: bool,
    restarting: bool,
) -> Phase:
    if restarting and not trainer_ready:
        return "Restarting"
    if trainer_ready and rollout_ready:
        return "Running"
    return "Starting" if any_running else "Pending"
