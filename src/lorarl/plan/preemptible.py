"""spec.rollout.preemptible: what lets rollout pods run on spot/preemptible nodes.

Only rollout pods: an engine that disappears costs its in-flight requests (retried on another
engine) and a fresh pod, while a lost trainer rank restarts the whole group from its last
checkpoint. The tolerations let a pod onto a spot pool; they do not send it there: the user's
rollout.nodeSelector picks the pool (docs/spec-fields.md lists one selector per cloud).
"""

from __future__ import annotations

from lorarl.api.spec.k8s import Toleration
from lorarl.api.spec.workloads import RolloutSpec

PREEMPTIBLE_LABEL = "lorarl.dev/preemptible"

# The taints the managed clouds put on their spot nodes, each matched exactly (key, value,
# effect), so a pod tolerates nothing else on those nodes:
SPOT_TOLERATIONS = (
    # GKE Standard spot node pools ("Spot VMs" how-to, Taints and tolerations): the node taint
    # cloud.google.com/gke-spot="true":NoSchedule, with the node label of the same name.
    Toleration(
        key="cloud.google.com/gke-spot", operator="Equal", value="true", effect="NoSchedule"
    ),
    # GKE preemptible VMs (the predecessor of Spot VMs, "Preemptible VMs" how-to):
    # cloud.google.com/gke-preemptible="true":NoSchedule.
    Toleration(
        key="cloud.google.com/gke-preemptible", operator="Equal", value="true", effect="NoSchedule"
    ),
    # AKS spot node pools ("Add an Azure Spot node pool"): every node of a `--priority Spot`
    # pool has the taint kubernetes.azure.com/scalesetpriority=spot:NoSchedule and the label
    # kubernetes.azure.com/scalesetpriority=spot.
    Toleration(
        key="kubernetes.azure.com/scalesetpriority",
        operator="Equal",
        value="spot",
        effect="NoSchedule",
    ),
)
# EKS managed spot node groups and Karpenter taint nothing by default (their nodes carry the
# labels eks.amazonaws.com/capacityType=SPOT and karpenter.sh/capacity-type=spot): a
# nodeSelector alone places the pods there, and a custom taint goes in rollout.tolerations.


def _covers(mine: Toleration, spot: Toleration) -> bool:
    """Whether the user's toleration already tolerates that spot taint (Kubernetes' matching:
    Exists with no key tolerates every taint, no effect matches every effect)."""
    if mine.effect is not None and mine.effect != spot.effect:
        return False
    if (mine.operator or "Equal") == "Exists":
        return mine.key is None or mine.key == spot.key
    return mine.key == spot.key and (mine.value or "") == spot.value


def rollout_tolerations(rollout: RolloutSpec) -> list[Toleration]:
    """The user's tolerations, then (with preemptible) each spot one none of them covers."""
    out = list(rollout.tolerations)
    if rollout.preemptible:
        out += [t for t in SPOT_TOLERATIONS if not any(_covers(m, t) for m in rollout.tolerations)]
    return out


def rollout_labels(rollout: RolloutSpec) -> dict[str, str]:
    """Pod labels of a rollout pod: the preemptible mark, so users and the chaos tooling can
    select the pods that may vanish (`kubectl get pods -l lorarl.dev/preemptible=true`)."""
    return {PREEMPTIBLE_LABEL: "true"} if rollout.preemptible else {}
