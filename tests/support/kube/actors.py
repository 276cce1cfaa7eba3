"""What the kubelet and the garbage collector would do, as pure functions tests can trigger."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .store import Key, Obj

POD_PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")


def pod_status(
    pod: Mapping[str, Any],
    phase: str,
    now: str,
    exit_code: int | None = None,
    reason: str | None = None,
    message: str | None = None,
) -> Obj:
    """The pod's new `.status` after its containers reach `phase` (every container alike)."""
    if phase not in POD_PHASES:
        raise ValueError(f"phase must be one of {', '.join(POD_PHASES)}, got {phase!r}")
    finished = phase in ("Succeeded", "Failed")
    if exit_code is not None and not finished:
        raise ValueError(f"exit_code only applies to Succeeded/Failed pods, not {phase!r}")
    if exit_code is None and finished:
        exit_code = 0 if phase == "Succeeded" else 1
    old = dict(pod.get("status") or {})
    previous = {s.get("name"): s for s in old.get("containerStatuses") or []}
    started_at = old.get("startTime") or now
    statuses = []
    for container in (pod.get("spec") or {}).get("containers") or []:
        name = container.get("name")
        if phase == "Running":
            state: Obj = {"running": {"startedAt": now}}
        elif finished:
            terminated: Obj = {
                "exitCode": exit_code,
                "startedAt": started_at,
                "finishedAt": now,
                "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            }
            if message is not None:
                terminated["message"] = message
            state = {"terminated": terminated}
        else:
            waiting: Obj = {"reason": reason or "ContainerCreating"}
            if message is not None:
                waiting["message"] = message
            state = {"waiting": waiting}
        statuses.append(
            {
                "name": name,
                "image": container.get("image", ""),
                "imageID": "",
                "state": state,
                "ready": phase == "Running",
                "started": phase == "Running",
                "restartCount": (previous.get(name) or {}).get("restartCount", 0),
            }
        )
    ready = "True" if phase == "Running" else "False"
    return {
        **old,
        "phase": phase,
        "startTime": started_at,
        "containerStatuses": statuses,
        "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": now}],
    }


def orphans(objects: Iterable[tuple[Key, Obj]]) -> tuple[list[Key], dict[Key, list[Any]]]:
    """Objects whose owners are all gone (to delete), and those that lost only some (new refs).

    Objects already being deleted are left alone: their finalizers decide.
    """
    objects = list(objects)
    live = {obj["metadata"].get("uid") for _, obj in objects}
    to_delete: list[Key] = []
    to_trim: dict[Key, list[Any]] = {}
    for key, obj in objects:
        refs = obj["metadata"].get("ownerReferences") or []
        kept = [ref for ref in refs if ref.get("uid") in live]
        if not refs or len(kept) == len(refs) or obj["metadata"].get("deletionTimestamp"):
            continue
        if kept:
            to_trim[key] = kept
        else:
            to_delete.append(key)
    return to_delete, to_trim
