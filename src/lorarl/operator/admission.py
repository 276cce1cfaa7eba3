"""Pure admission rules: the same validation as `lorarl validate`, plus which spec fields may
change once a job runs (pods are immutable, so other edits would silently not apply)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

from lorarl.api.safe_yaml import excerpt
from lorarl.api.tenancy import TenancyPolicy, output_conflicts, output_location
from lorarl.api.validation import ManifestError, Problem, admin_problems, parse_job

# Read again on every pass, so changing them on a running job means what it says.
MUTABLE = (
    "spec.rollout.replicas",
    "spec.runPolicy.suspend",
    "spec.runPolicy.backoffLimit",
    "spec.runPolicy.activeDeadlineSeconds",
    "spec.runPolicy.ttlSecondsAfterFinished",
)


PRIORITY_CLASS_PATH = "spec.scheduling.priorityClassName"

# What the job trains on: fixed, suspended or not, once a pod has loaded it (status.model, a hub
# id's pinned commit) or a step has been taken (status.checkpoint, status.step). Its checkpoints
# are adapters of that base; resuming them on another would load the wrong weights or shapes.
MODEL_FIXED = ("spec.model.path", "spec.model.revision")
# The shape and scale of those checkpoints: another rank or target set cannot load them, another
# alpha (or rsLoRA) would resume them as a different policy. Dropout, like the rest, may change.
ADAPTER_FIXED = (
    "spec.lora.rank",
    "spec.lora.alpha",
    "spec.lora.useRslora",
    "spec.lora.targetModules",
    "spec.lora.excludeModules",
)
FIXED_ONCE_BEGUN = MODEL_FIXED + ADAPTER_FIXED
_WHY_FIXED = (
    (MODEL_FIXED, "its pods loaded this model and its checkpoints are adapters of it; create a "
     "new job for another model"),
    (ADAPTER_FIXED, "its checkpoints are adapters of this rank, targets and scale; create a new "
     "job (spec.lora.adapterPath can start it from this job's adapter)"),
)  # fmt: skip


def manifest_problems(
    obj: Mapping[str, Any],
    allowed_priority_classes: Collection[str] | None = None,
    policy: TenancyPolicy | None = None,
) -> list[Problem]:
    """Validate what the user wrote (the status is the operator's, not theirs); with an
    allow-list, also the PriorityClass, and with a policy the Secrets and nodes it allows (the
    operator's config, from the chart)."""
    try:
        job = parse_job({k: v for k, v in obj.items() if k != "status"}, cluster=True)
    except ManifestError as exc:
        return exc.problems
    problems: list[Problem] = []
    if allowed_priority_classes is not None:
        problems += priority_class_problems(obj, allowed_priority_classes)
    if policy is not None and not problems:
        problems += admin_problems(job, policy)
    return problems


def user_fields_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether an UPDATE touches what the user wrote (the spec, the labels). One that does not
    (kopf's annotation writes, the finalizer removed on delete) is admitted as it is: it was
    valid when its spec was, and checking it again against a policy tightened since would
    leave a finished job that cannot be deleted."""

    def part(obj: Mapping[str, Any]) -> tuple[Any, Any]:
        return obj.get("spec"), (obj.get("metadata") or {}).get("labels") or {}

    return part(old) != part(new)


def output_dir_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether admitting `new` needs the other jobs checked for its outputDir: on create, and
    on an edit that moves it (kopf's own annotation patches, every few seconds per job, do not)."""
    return old is None or output_location(old) != output_location(new)


def output_dir_problems(
    obj: Mapping[str, Any], others: Iterable[Mapping[str, Any]]
) -> list[Problem]:
    """`others`: the LoRARLJobs of the job's namespace, as listed (itself included or not)."""
    return [Problem(path, message) for path, message in output_conflicts(obj, others)]


def priority_class_problems(obj: Mapping[str, Any], allowed: Collection[str]) -> list[Problem]:
    """A PriorityClass outranks (and can preempt) other workloads: only the admin's list."""
    name = ((obj.get("spec") or {}).get("scheduling") or {}).get("priorityClassName")
    if name is None or name in allowed:
        return []
    choices = ", ".join(sorted(allowed)) if allowed else "none: leave it unset"
    return [
        Problem(
            PRIORITY_CLASS_PATH,
            f"must be a PriorityClass the operator allows ({choices}; the chart's "
            f"webhook.allowedPriorityClasses) (got {excerpt(name)})",
        )
    ]


def changed_paths(old: Any, new: Any, prefix: str) -> list[str]:
    """Dotted paths of every leaf that differs (lists compare whole, like a merge patch); an
    absent section is an empty one, so adding `runPolicy: {suspend: true}` names the leaf."""
    if isinstance(old, Mapping) and new is None:
        new = {}
    if isinstance(new, Mapping) and old is None:
        old = {}
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        out: list[str] = []
        for key in sorted(set(old) | set(new)):
            out += changed_paths(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [prefix]


def _suspended(obj: Mapping[str, Any]) -> bool:
    return bool(((obj.get("spec") or {}).get("runPolicy") or {}).get("suspend"))


def _begun(old: Mapping[str, Any]) -> bool:
    status = old.get("status") or {}
    return bool(status.get("model") or status.get("checkpoint") or status.get("step"))


def immutable_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Spec paths changed that may not change now. A suspended job has no pods, so any field
    may change (Kueue edits suspended jobs; the pods are rendered anew on resume), except the
    model and the adapter's shape once the job has begun (`FIXED_ONCE_BEGUN`)."""
    changed = changed_paths(old.get("spec") or {}, new.get("spec") or {}, "spec")
    if _suspended(old) and _suspended(new):
        return [p for p in changed if p in FIXED_ONCE_BEGUN] if _begun(old) else []
    return [p for p in changed if not any(p == m or p.startswith(m + ".") for m in MUTABLE)]


def update_refusal(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    bad = immutable_changes(old, new)
    if not bad:
        return None
    for fixed, why in _WHY_FIXED if _begun(old) else ():
        hit = [p for p in bad if p in fixed]
        if hit:
            begun = "cannot be changed once the job has begun, suspended or not"
            return f"{', '.join(hit)}: {begun}: {why}"
    fields = ", ".join(bad)
    allowed = ", ".join(MUTABLE)
    return (
        f"{fields}: cannot be changed on a running job (only {allowed} can); suspend the job "
        "(spec.runPolicy.suspend: true) to edit it, or create a new job"
    )
