"""What a job may reach besides its own spec: Secrets, output folders, nodes (issue 34, 4).

Jobs in one namespace share its Secrets, claims and nodes, and a manifest author is not trusted
with the other jobs there. Three rules, each checked where the facts are known:

- A job's generated Secret (`<job>-engine-key`: its engines' API key and its sync key) is that
  job's alone. Needs the manifest only: the model enforces it on every cluster validation
  (`lorarl validate`, the webhook, the operator with the webhook off).
- Any other Secret a job reads must be on the cluster admin's allow-list (the chart's
  `webhook.allowedSecrets`), and its pods may not target control-plane nodes unless the chart
  allows it (`webhook.allowControlPlaneNodes`). Needs the admin's policy: the webhook has it,
  `lorarl validate` checks what it is told (`--allowed-secrets`, `--allow-control-plane-nodes`).
- A job's outputDir may not overlap the one of another live job on the same claim. Needs the
  other jobs: the webhook lists them.

A rule returns findings, (field path, message) pairs; the callers turn them into `Problem`s
(this module sits below `validation`, which imports the model that imports it).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lorarl.api.safe_yaml import excerpt
from lorarl.api.spec.k8s import DNS1123_LABEL, DNS1123_SUBDOMAIN, Toleration
from lorarl.api.spec.training import TrainingSpec

if TYPE_CHECKING:
    from lorarl.api.resource import LoRARLJob
    from lorarl.api.spec.job import LoRARLJobSpec

Finding = tuple[str, str]

# The one Secret the operator creates per job (operator/builders.py names it with this).
ENGINE_KEY_SUFFIX = "-engine-key"
# The node labels and taint keys of control-plane nodes (kubeadm's current name, and the one
# clusters made before Kubernetes 1.24 still carry).
CONTROL_PLANE_KEYS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# A job in one of these phases has stopped writing to its outputDir.
FINISHED_PHASES = ("Succeeded", "Failed")
ALLOWED_SECRETS_VALUE = "the chart's webhook.allowedSecrets"
CONTROL_PLANE_VALUE = "the chart's webhook.allowControlPlaneNodes"
_SECRET_FIELDS = (
    ("mlflow", "tokenSecret", "token_secret"),
    ("mlflow", "usernameSecret", "username_secret"),
    ("mlflow", "passwordSecret", "password_secret"),
    ("wandb", "apiKeySecret", "api_key_secret"),
)


def engine_key_secret_name(job: str) -> str:
    return f"{job}{ENGINE_KEY_SUFFIX}"


def secret_refs(spec: LoRARLJobSpec) -> list[tuple[str, str]]:
    """(field path, Secret name) of every Secret the spec reads: the spec has no envFrom, Secret
    volumes or imagePullSecrets, so env secretKeyRefs and the tracker credentials are all."""
    refs = []
    for role in ("trainer", "rollout"):
        for i, env in enumerate(getattr(spec, role).env):
            if env.value_from is not None:
                path = f"spec.{role}.env[{i}].valueFrom.secretKeyRef.name"
                refs.append((path, env.value_from.secret_key_ref.name))
    for backend, field, attr in _SECRET_FIELDS:
        settings = getattr(spec.logging, backend)
        selector = getattr(settings, attr) if settings is not None else None
        if selector is not None:
            refs.append((f"spec.logging.{backend}.{field}.name", selector.name))
    return refs


def foreign_job_secret(job: LoRARLJob) -> tuple[str, str] | None:
    """The first reference to a Secret lorarl generated for another job, if any. Every name
    ending in -engine-key but this job's own counts: a job of that name may exist now or later."""
    own = engine_key_secret_name(job.name)
    for path, name in secret_refs(job.spec):
        if name.endswith(ENGINE_KEY_SUFFIX) and name != own:
            return path, name
    return None


def foreign_secret_message(job_name: str) -> str:
    return (
        f"must not name another job's Secret: lorarl makes <job>{ENGINE_KEY_SUFFIX} for each "
        f"job, and a job may use only its own ({engine_key_secret_name(job_name)})"
    )


# --------------------------------------------------------------------------- the admin's policy


def parse_allowed_secrets(entries: Iterable[str]) -> tuple[str, ...]:
    """The allow-list's entries: `name` (in any namespace), `namespace/name`, `namespace/*`
    (every Secret of that namespace) or `*` (any Secret). Raises ValueError on a bad entry."""
    out = []
    for raw in entries:
        entry = raw.strip()
        if not entry:
            continue
        namespace, _, name = entry.rpartition("/")
        if "/" in entry and not re.fullmatch(DNS1123_LABEL, namespace):
            raise ValueError(f"{entry[:80]!r}: {namespace[:80]!r} is not a namespace name")
        if name != "*" and (len(name) > 253 or not re.fullmatch(DNS1123_SUBDOMAIN, name)):
            raise ValueError(f"{entry[:80]!r}: not a Secret name, namespace/name or namespace/*")
        out.append(entry)
    return tuple(out)


def secret_allowed(allowed: Iterable[str], namespace: str, name: str) -> bool:
    return any(e in ("*", name, f"{namespace}/{name}", f"{namespace}/*") for e in allowed)


@dataclass(frozen=True)
class TenancyPolicy:
    """The cluster admin's rules. `allowed_secrets` None: not known here (`lorarl validate`
    without --allowed-secrets), so not checked; empty: no Secret but the job's own."""

    allowed_secrets: tuple[str, ...] | None = None
    allow_control_plane_nodes: bool = False


def _tolerates_control_plane(t: Toleration) -> bool:
    """Whether `t` tolerates a control-plane taint (key above, empty value, NoSchedule), by
    Kubernetes' matching: Exists without a key tolerates every taint."""
    if t.effect not in (None, "NoSchedule"):
        return False
    if (t.operator or "Equal") == "Exists":
        return t.key is None or t.key in CONTROL_PLANE_KEYS
    return t.key in CONTROL_PLANE_KEYS


def control_plane_findings(spec: LoRARLJobSpec) -> list[Finding]:
    """Pods sent to, or let onto, control-plane nodes (the spec has no affinity field)."""
    out = []
    for role in ("trainer", "rollout"):
        pod = getattr(spec, role)
        for key in pod.node_selector:
            if key in CONTROL_PLANE_KEYS:
                out.append(
                    (
                        f"spec.{role}.nodeSelector",
                        f"must not select control-plane nodes unless the operator allows it "
                        f"({CONTROL_PLANE_VALUE}) (got {excerpt(key)})",
                    )
                )
        for i, toleration in enumerate(pod.tolerations):
            if _tolerates_control_plane(toleration):
                out.append(
                    (
                        f"spec.{role}.tolerations[{i}]",
                        "must not tolerate the control-plane taint unless the operator allows "
                        f"it ({CONTROL_PLANE_VALUE}) (got {excerpt(toleration.wire())})",
                    )
                )
    return out


def policy_findings(job: LoRARLJob, policy: TenancyPolicy) -> list[Finding]:
    """What the admin's policy refuses in a job that passed validation."""
    out: list[Finding] = []
    if policy.allowed_secrets is not None:
        own = engine_key_secret_name(job.name)
        for path, name in secret_refs(job.spec):
            if name != own and not secret_allowed(policy.allowed_secrets, job.namespace, name):
                out.append(
                    (
                        path,
                        f"must be a Secret the operator lets jobs read ({ALLOWED_SECRETS_VALUE}) "
                        f"(got {excerpt(name)})",
                    )
                )
    if not policy.allow_control_plane_nodes:
        out += control_plane_findings(job.spec)
    return out


# --------------------------------------------------------------------------- output folders


def _training(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = doc.get("spec")
    training = spec.get("training") if isinstance(spec, Mapping) else None
    return training if isinstance(training, Mapping) else {}


def output_location(doc: Mapping[str, Any]) -> tuple[str, str] | None:
    """(claim, folder on the claim) of a job's outputDir, from its manifest as stored (other
    jobs are read raw: one that no longer validates still writes where it writes). The folder
    is relative to the claim's root ("" for the root), so two jobs mounting one claim at
    different paths compare right; None without a claim or outside it."""
    training = _training(doc)
    volume = training.get("volume")
    if not isinstance(volume, Mapping):
        return None
    claim, mount = volume.get("claimName"), volume.get("mountPath")
    out = training.get("outputDir", TrainingSpec.model_fields["output_dir"].default)
    if not (isinstance(claim, str) and isinstance(mount, str) and isinstance(out, str)):
        return None
    if not (claim and mount and out):
        return None
    rel = posixpath.relpath(posixpath.normpath(out), posixpath.normpath(mount))
    if rel == ".":
        return claim, ""
    if rel == ".." or rel.startswith("../"):
        return None
    return claim, rel


def _overlap(a: str, b: str) -> bool:
    """One folder is the other or holds it ("" is the claim's root, which holds everything)."""
    return a == b or not a or not b or a.startswith(b + "/") or b.startswith(a + "/")


def live(doc: Mapping[str, Any]) -> bool:
    meta = doc.get("metadata") or {}
    status = doc.get("status") or {}
    phase = status.get("phase") if isinstance(status, Mapping) else None
    return not meta.get("deletionTimestamp") and phase not in FINISHED_PHASES


def output_conflicts(doc: Mapping[str, Any], others: Iterable[Mapping[str, Any]]) -> list[Finding]:
    """The live jobs (of the same namespace) whose outputDir overlaps this job's on its claim:
    two trainers in one folder resume from, and prune, each other's checkpoints."""
    mine = output_location(doc)
    if mine is None:
        return []
    name = (doc.get("metadata") or {}).get("name")
    clashes = []
    for other in others:
        other_name = (other.get("metadata") or {}).get("name")
        if other_name == name or not live(other):
            continue
        theirs = output_location(other)
        if theirs is not None and theirs[0] == mine[0] and _overlap(mine[1], theirs[1]):
            clashes.append(other_name)
    if not clashes:
        return []
    shown = ", ".join(excerpt(n) for n in sorted(clashes, key=str)[:5])  # read raw: typed Any
    return [
        (
            "spec.training.outputDir",
            f"overlaps the outputDir of live job {shown} on claim {excerpt(mine[0])}: "
            "each job needs a folder of its own (its checkpoints are resumed and pruned there)",
        )
    ]
