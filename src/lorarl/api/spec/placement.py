"""`spec.rollout.placement`: where the engines run, and the rules a colocated job must keep.

separate: rollout pods of their own (engines and trainer overlap in time with offPolicySteps 1,
and each side scales alone). colocated: every trainer pod also runs one engine and its sync
sidecar on the same devices, and generation and the update take turns on them (on GPUs the
engine releases its memory during the update). docs/architecture.md, Placement, says when each
wins. A colocated engine has no pod of its own, so the rollout fields that shape a pod are
refused rather than ignored: the trainer's fields shape the one pod.
"""

from __future__ import annotations

from typing import Any, Literal

from lorarl.api.rules import Rule

Placement = Literal["separate", "colocated"]
PLACEMENTS: tuple[Placement, ...] = ("separate", "colocated")
# A colocated GPU engine shares the devices with the trainer: vLLM's and SGLang's own defaults
# (0.9, ~0.88) would leave the trainer too little to start. Used when memoryFraction is unset.
COLOCATED_MEMORY_FRACTION = 0.5

# The processes of a colocated trainer pod's one container, for `python -m lorarl.colocate`.
COLOCATED_PROCESSES_ENV = "LORARL_COLOCATED_PROCESSES"

_COLOCATED = (
    "has(self.rollout) && has(self.rollout.placement) && self.rollout.placement == 'colocated'"
)
_ROLLOUT_REPLICAS = "(has(self.rollout.replicas) ? self.rollout.replicas : 1)"
_TRAINER_REPLICAS = "(has(self.trainer) && has(self.trainer.replicas) ? self.trainer.replicas : 1)"
_ROLLOUT_GPUS = "(has(self.rollout.gpusPerReplica) ? self.rollout.gpusPerReplica : 1)"
_TRAINER_GPUS = (
    "(has(self.trainer) && has(self.trainer.gpusPerReplica) ? self.trainer.gpusPerReplica : 1)"
)
_OFF_POLICY = (
    "(has(self.training) && has(self.training.offPolicySteps) ? self.training.offPolicySteps : 0)"
)
# Rollout fields that describe a pod of its own; a colocated engine lives in the trainer's.
_POD_FIELDS = (
    ("image", "has(self.rollout.image)"),
    ("resources", "has(self.rollout.resources) && (size(self.rollout.resources.requests) > 0 "
     "|| size(self.rollout.resources.limits) > 0)"),
    ("nodeSelector", "has(self.rollout.nodeSelector) && size(self.rollout.nodeSelector) > 0"),
    ("tolerations", "has(self.rollout.tolerations) && size(self.rollout.tolerations) > 0"),
    ("env", "has(self.rollout.env) && size(self.rollout.env) > 0"),
    ("preemptible", "has(self.rollout.preemptible) && self.rollout.preemptible"),
)  # fmt: skip


def colocated(spec: Any) -> bool:
    return spec.rollout.placement == "colocated"


def releases_engine_memory(spec: Any) -> bool:
    """Whether the engines hand their GPU memory back for each update (vLLM sleep mode, SGLang
    memory occupation release): colocated on GPUs. On CPU the engine's threads simply idle."""
    return colocated(spec) and spec.trainer.gpus_per_replica > 0


def _pod_fields_set(spec: Any) -> bool:
    r = spec.rollout
    return bool(
        r.image
        or r.resources.requests
        or r.resources.limits
        or r.node_selector
        or r.tolerations
        or r.env
        or r.preemptible
    )


_REPLICAS_RULE = Rule(
    cel=f"!({_COLOCATED}) || {_ROLLOUT_REPLICAS} == {_TRAINER_REPLICAS}",
    message="must equal trainer.replicas when placement is colocated: each trainer pod runs "
    "one engine",
    check=lambda m: not colocated(m) or m.rollout.replicas == m.trainer.replicas,
    field="rollout.replicas",
)
_GPUS_RULE = Rule(
    cel=f"!({_COLOCATED}) || {_ROLLOUT_GPUS} == {_TRAINER_GPUS}",
    message="must equal trainer.gpusPerReplica when placement is colocated: the engine runs on "
    "the trainer pod's devices",
    check=lambda m: not colocated(m) or m.rollout.gpus_per_replica == m.trainer.gpus_per_replica,
    field="rollout.gpusPerReplica",
)
_POD_FIELDS_RULE = Rule(
    cel=f"!({_COLOCATED}) || !(" + " || ".join(f"({c})" for _, c in _POD_FIELDS) + ")",
    message="image, resources, nodeSelector, tolerations, env and preemptible shape a rollout "
    "pod, and a colocated engine runs in the trainer pod: set them on trainer",
    check=lambda m: not colocated(m) or not _pod_fields_set(m),
    field="rollout",
)
_TAKE_TURNS_RULE = Rule(
    cel=f"!({_COLOCATED}) || {_TRAINER_GPUS} == 0 || {_OFF_POLICY} == 0",
    message="must be 0 when placement is colocated on GPUs: generation and the update take "
    "turns on the same devices",
    check=lambda m: (
        not colocated(m) or m.trainer.gpus_per_replica == 0 or m.training.off_policy_steps == 0
    ),
    field="training.offPolicySteps",
)
PLACEMENT_SPEC_RULES = (_REPLICAS_RULE, _GPUS_RULE, _POD_FIELDS_RULE, _TAKE_TURNS_RULE)
