"""Spec fields that only a cluster acts on, and which of them a job sets.

A local run starts the plan's containers as processes: there is no image to pull, no pod to
size or place, no claim to mount and no controller to restart, expire or queue the job. Those
fields are right for the job's cluster runs, so they are not refused; `lorarl run --local` names
the ones a job sets in one warning line instead of ignoring them silently.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from lorarl.api.resource import LoRARLJob

# Spec paths in the manifest's spelling. Locally: this interpreter and .venv-engine instead of
# images; no pod limits or placement; model.path and data files as local paths, outputs in the
# run directory; a failed trainer ends the run, no deadline, TTL, suspension or queue.
CLUSTER_ONLY: tuple[str, ...] = (
    "trainer.image",
    "trainer.resources",
    "trainer.nodeSelector",
    "trainer.tolerations",
    "rollout.image",
    "rollout.resources",
    "rollout.nodeSelector",
    "rollout.tolerations",
    "rollout.preemptible",
    "rollout.cacheVolume",  # locally: the user's cache (engines/vllm.py)
    "reward.service.resources",
    "reward.configMap",
    "agent.configMap",
    "model.volume",
    "model.hub.tokenSecret",  # locally: HF_TOKEN or `hf auth login`
    "data.volume",
    "training.volume",
    "training.outputDir",
    "runPolicy.backoffLimit",
    "runPolicy.activeDeadlineSeconds",
    "runPolicy.ttlSecondsAfterFinished",
    "runPolicy.cleanPodPolicy",
    "runPolicy.suspend",
    "scheduling.queueName",
    "scheduling.gang",
    "scheduling.priorityClassName",
)


def _field(model: BaseModel, alias: str) -> tuple[str, Any]:
    for name, info in type(model).model_fields.items():
        if (info.alias or name) == alias:
            return name, info
    raise KeyError(alias)


def set_cluster_fields(job: LoRARLJob) -> list[str]:
    """The CLUSTER_ONLY paths whose value differs from the default, in table order."""
    out = []
    for path in CLUSTER_ONLY:
        model: Any = job.spec
        *parents, leaf = path.split(".")
        for alias in parents:
            model = getattr(model, _field(model, alias)[0]) if model is not None else None
        if model is None:
            continue
        name, info = _field(model, leaf)
        if getattr(model, name) != info.get_default(call_default_factory=True):
            out.append(path)
    return out


def local_warning(job: LoRARLJob) -> str | None:
    """One line naming the cluster-only fields the job sets, or None."""
    fields = set_cluster_fields(job)
    if not fields:
        return None
    return (
        "not used by a local run (cluster only): "
        + ", ".join(f"spec.{f}" for f in fields)
        + "; outputs go to the run directory, processes take this machine as it is"
    )
