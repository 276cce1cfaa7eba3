"""Pure builders: a JobPlan -> the Kubernetes objects that run it (plain dicts).

Names are deterministic (`<job>`, `<job>-config`, `<job>-engine-key`, `<job>-<role>-<i>`), so
creating them is idempotent: a second create is a 409, never a duplicate. Owner references are
added by the caller (`kopf.adopt`), which owns the live job body.
"""

from __future__ import annotations

import json
from typing import Any

from lorarl.api.resource import LoRARLJob, config_yaml
from lorarl.api.spec.k8s import GPU_RESOURCE, ResourceRequirements
from lorarl.api.spec.placement import COLOCATED_PROCESSES_ENV
from lorarl.api.spec.workloads import JOB_UID_ENV, SYNC_KEY_ENV
from lorarl.api.tenancy import engine_key_secret_name
from lorarl.plan.addressing import CLUSTER_PORTS
from lorarl.plan.build import CONFIG_FILE
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.plan.hub import FETCH_CONTAINER, pinned
from lorarl.plan.model import ContainerPlan, JobPlan, ReplicaPlan, RolePlan, VolumePlan
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, REWARD_KEY_CONTAINERS
from lorarl.sync.protocol import SYNC_KEY_CONTAINERS

Obj = dict[str, Any]

JOB_LABEL = "lorarl.dev/job"
ROLE_LABEL = "lorarl.dev/role"
INDEX_LABEL = "lorarl.dev/replica-index"
ATTEMPT_LABEL = "lorarl.dev/attempt"
# The job's metadata.uid on its pods: the NetworkPolicy selects by it (a name is reused by the
# next job of that name, a uid never is). docs/security.md says what a label cannot stop.
JOB_UID_LABEL = "lorarl.dev/job-uid"
MANAGED_BY = ("app.kubernetes.io/managed-by", "lorarl-operator")
API_KEY_KEY = "api-key"
SYNC_KEY_KEY = "sync-key"  # in the same Secret: signs the weight-sync channel
REWARD_KEY_KEY = "reward-key"  # and the reward service's: its only client is the trainer
RUN_AS = 10001
TMP_DIR = "/tmp"

KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP = "kueue.x-k8s.io/pod-group-name"
KUEUE_TOTAL = "kueue.x-k8s.io/pod-group-total-count"
# Kueue keeps a pod group's quota until every pod has succeeded, or until all have ended and one
# says the group will not be retried: set on every pod once the job has finished.
KUEUE_RETRIABLE = "kueue.x-k8s.io/retriable-in-group"
COSCHEDULING_GROUP = "scheduling.x-k8s.io/pod-group"
VOLCANO_GROUP = "scheduling.k8s.io/group-name"
VOLCANO_SCHEDULER = "volcano"
PROGRESS_PORT = "progress"
# The common Prometheus pod-annotation convention (the community chart's kubernetes-pods job):
# set on the pod that serves the trainer's GET /metrics (rank 0). A scraper still needs the
# NetworkPolicy to admit it (examples/autoscaling/prometheus.yaml).
SCRAPE_ANNOTATIONS = ("prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path")
OPERATOR_COMPONENTS = ("operator", "status-api")


def config_map_name(job: str) -> str:
    return f"{job}-config"


def secret_name(job: str) -> str:
    return engine_key_secret_name(job)


def rollout_selector(job: str) -> str:
    return f"{JOB_LABEL}={job},{ROLE_LABEL}=rollout"


def total_pods(plan: JobPlan) -> int:
    return sum(len(r.replicas) for r in plan.roles)


def _meta(plan: JobPlan, name: str, **extra: Any) -> Obj:
    return {"name": name, "namespace": plan.namespace, "labels": dict(plan.labels), **extra}


def service(plan: JobPlan) -> Obj:
    """Headless, and publishing not-ready pods: rank 0 must resolve before it is Ready."""
    ports = [
        {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
        for name, port in sorted(CLUSTER_PORTS.items(), key=lambda kv: kv[1])
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(plan, plan.service_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: plan.name},
            "ports": ports,
        },
    }


def config_data(plan: JobPlan) -> dict[str, str]:
    return {CONFIG_FILE: config_yaml(plan.config)}


def config_map(plan: JobPlan, data: dict[str, str] | None = None) -> Obj:
    """`data`: `config_data(plan)` when the caller rendered it already (YAML is not cheap)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(plan, config_map_name(plan.name)),
        "data": config_data(plan) if data is None else data,
    }


def engine_key_secret(
    plan: JobPlan, api_key: str, sync_key: str, reward_key: str | None = None
) -> Obj:
    """The job's keys: the engines' API key, the weight-sync channel's HMAC key and the reward
    service's key (the operator always makes one; a plan with a reward service needs it, or
    its trainer and reward pods wait on the missing key)."""
    if not api_key:
        raise ValueError("engine API key: must not be empty")
    if not sync_key:
        raise ValueError("sync key: must not be empty")
    data = {API_KEY_KEY: api_key, SYNC_KEY_KEY: sync_key}
    if reward_key is not None:
        if not reward_key:
            raise ValueError("reward key: must not be empty")
        data[REWARD_KEY_KEY] = reward_key
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _meta(plan, secret_name(plan.name)),
        "stringData": data,
    }


def network_policy(plan: JobPlan, operator_namespace: str, job_uid: str = "") -> Obj:
    """Ingress to the job's pods: anything from the job's own pods, on any port (gloo and NCCL
    connect on ephemeral ports besides the rendezvous and sync ports), and the progress port
    from the operator and status API. Nothing else gets in. The job's pods are the ones with
    its uid label (`job_uid`, what `pod` sets): a pod of another job of the same name is not."""
    labels = {JOB_LABEL: plan.name, MANAGED_BY[0]: MANAGED_BY[1]}
    if job_uid:
        labels[JOB_UID_LABEL] = job_uid
    selector = {"matchLabels": labels}
    operator_pods = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
        "podSelector": {
            "matchLabels": {"app.kubernetes.io/name": "lorarl"},
            "matchExpressions": [
                {
                    "key": "app.kubernetes.io/component",
                    "operator": "In",
                    "values": list(OPERATOR_COMPONENTS),
                }
            ],
        },
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(plan, plan.name),
        "spec": {
            "podSelector": selector,
            "policyTypes": ["Ingress"],
            "ingress": [
                # No `ports`: every port and protocol, but only from this job's pods (a
                # podSelector without a namespaceSelector means the policy's own namespace).
                {"from": [{"podSelector": selector}]},
                {
                    "from": [operator_pods],
                    "ports": [{"port": CLUSTER_PORTS[PROGRESS_PORT], "protocol": "TCP"}],
                },
            ],
        },
    }


def pod_group(plan: JobPlan, job: LoRARLJob) -> Obj | None:
    """A gang: nothing starts until every pod of the job can be placed."""
    gang = job.spec.scheduling.gang
    if gang == "none":
        return None
    if gang == "scheduler-plugins":
        return {
            "apiVersion": "scheduling.x-k8s.io/v1alpha1",
            "kind": "PodGroup",
            "metadata": _meta(plan, plan.name),
            "spec": {"minMember": total_pods(plan)},
        }
    spec: Obj = {"minMember": total_pods(plan)}
    if job.spec.scheduling.priority_class_name:
        spec["priorityClassName"] = job.spec.scheduling.priority_class_name
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "PodGroup",
        "metadata": _meta(plan, plan.name),
        "spec": spec,
    }


def pod(
    plan: JobPlan,
    job: LoRARLJob,
    role: str,
    index: int,
    *,
    attempt: int = 0,
    job_uid: str = "",
    model_revision: str | None = None,
) -> Obj:
    """One replica's Pod. `attempt` tells pods of a restarted trainer group from older ones;
    `job_uid` (the job's metadata.uid) labels the pod for the NetworkPolicy and reaches every
    container as LORARL_JOB_UID, which the trainer stamps into its checkpoints;
    `model_revision` (status.model.revision) pins a hub id's fetch to the job's commit."""
    role_plan = plan.role(role)  # type: ignore[arg-type]
    if role_plan is None or not 0 <= index < len(role_plan.replicas):
        raise ValueError(f"job {plan.name} has no {role} replica {index}")
    replica = role_plan.replicas[index]
    labels = {
        **plan.labels,
        **role_plan.labels,
        ROLE_LABEL: role,
        INDEX_LABEL: str(index),
        ATTEMPT_LABEL: str(attempt),
    }
    if job_uid:
        labels[JOB_UID_LABEL] = job_uid
    annotations: dict[str, str] = {}
    progress = next(
        (c.ports[PROGRESS_PORT] for c in replica.containers if PROGRESS_PORT in c.ports), None
    )
    if progress is not None:
        annotations |= dict(
            zip(SCRAPE_ANNOTATIONS, ("true", str(progress), "/metrics"), strict=True)
        )
    sched = job.spec.scheduling
    spec: Obj = {
        "hostname": replica.name,
        "subdomain": plan.service_name,
        # A trainer rank that dies takes its group down and the operator restarts the group
        # from a checkpoint: Never. A rollout pod holds two processes that outlive each other's
        # crashes (the sidecar re-applies the weights to a restarted engine, a restarted sidecar
        # re-registers), so the kubelet restarts a crashed one in place: Always. With Never the
        # pod would stay Running with a dead engine or sidecar, and nothing would replace it.
        "restartPolicy": "Always" if role == "rollout" else "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # The reward service runs untrusted code (python_tests): it never gets the engine key.
        "containers": [_colocated_container(plan, replica, job_uid)]
        if len(replica.containers) > 1 and role == "trainer"
        else [
            _container(plan, c, engine_key=role != "reward", job_uid=job_uid)
            for c in replica.containers
        ],
        "volumes": [_volume(v) for v in role_plan.volumes] + [_tmp_volume()],
    }
    if replica.init_containers:
        spec["initContainers"] = [
            _container(plan, _pinned(c, model_revision), engine_key=False, job_uid=job_uid)
            for c in replica.init_containers
        ]
    if role_plan.node_selector:
        spec["nodeSelector"] = dict(role_plan.node_selector)
    if role_plan.tolerations:
        spec["tolerations"] = [t.wire() for t in role_plan.tolerations]
    if sched.priority_class_name:
        spec["priorityClassName"] = sched.priority_class_name
    if sched.queue_name:
        labels[KUEUE_QUEUE] = sched.queue_name
        labels[KUEUE_GROUP] = plan.name
        annotations[KUEUE_TOTAL] = str(total_pods(plan))
    if sched.gang == "scheduler-plugins":
        labels[COSCHEDULING_GROUP] = plan.name
    elif sched.gang == "volcano":
        annotations[VOLCANO_GROUP] = plan.name
        spec["schedulerName"] = VOLCANO_SCHEDULER
    meta = _meta(plan, replica.name)
    meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def pod_names(plan: JobPlan) -> list[str]:
    return [r.name for role in plan.roles for r in role.replicas]


def _container(
    plan: JobPlan, c: ContainerPlan, *, engine_key: bool = True, job_uid: str = ""
) -> Obj:
    user_names = {e.name for e in c.user_env}
    env: list[Obj] = []
    if engine_key:  # first: the kubelet expands `$(LORARL_ENGINE_API_KEY)` in later values only
        env.append(
            {
                "name": ENGINE_API_KEY_ENV,
                "valueFrom": {"secretKeyRef": {"name": secret_name(plan.name), "key": API_KEY_KEY}},
            }
        )
    env += [{"name": k, "value": v} for k, v in c.env.items()]
    if job_uid:
        env.append({"name": JOB_UID_ENV, "value": job_uid})
    if engine_key and c.name in SYNC_KEY_CONTAINERS:  # the sync's two ends, never the reward pod
        env.append(
            {
                "name": SYNC_KEY_ENV,
                "valueFrom": {
                    "secretKeyRef": {"name": secret_name(plan.name), "key": SYNC_KEY_KEY}
                },
            }
        )
    # The reward service and its client (the trainer), when the job runs its own service.
    if c.name in REWARD_KEY_CONTAINERS and plan.role("reward") is not None:
        env.append(
            {
                "name": REWARD_API_KEY_ENV,
                "valueFrom": {
                    "secretKeyRef": {"name": secret_name(plan.name), "key": REWARD_KEY_KEY}
                },
            }
        )
    # A read-only root filesystem: caches (HF, torch, triton, vLLM) go to the /tmp emptyDir.
    for name, value in (("HOME", TMP_DIR), ("XDG_CACHE_HOME", f"{TMP_DIR}/.cache")):
        if name not in user_names and name not in c.env:
            env.append({"name": name, "value": value})
    env += [e.wire() for e in c.user_env]  # verbatim: a secretKeyRef stays a secretKeyRef
    container: Obj = {
        "name": c.name,
        "image": c.image,
        "command": list(c.command),
        "env": env,
        "volumeMounts": [
            {"name": m.volume, "mountPath": m.path, **({"readOnly": True} if m.read_only else {})}
            for m in c.mounts
        ]
        + [{"name": "tmp", "mountPath": TMP_DIR}],
        # A failed container's last log lines become its termination message, so the pod
        # status, the job's Failed condition and the restart Event say why it failed.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    if c.ports:
        container["ports"] = [
            {"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in c.ports.items()
        ]
    resources = _resources(c.resources)
    if resources:
        container["resources"] = resources
    return container


def _colocated_container(plan: JobPlan, replica: ReplicaPlan, job_uid: str = "") -> Obj:
    """A colocated trainer pod's processes in one container, which alone holds the pod's GPUs:
    `python -m lorarl.colocate` starts each with its planned command and env (docs/
    architecture.md, Placement). The trainer's user env, resources and image cover them all."""
    trainer = next(c for c in replica.containers if c.name == "trainer")
    others = [c for c in replica.containers if c is not trainer]
    engine_ports = [c.ports["engine"] for c in others if "engine" in c.ports]
    processes = [_colocated_process(c, trainer, engine_ports) for c in [*others, trainer]]
    mounts = {m.path: m for c in [*others, trainer] for m in c.mounts}  # the trainer's win
    one = ContainerPlan(
        name="trainer",
        image=trainer.image,
        command=["python", "-m", "lorarl.colocate"],
        env={COLOCATED_PROCESSES_ENV: json.dumps(processes, separators=(",", ":"))},
        user_env=trainer.user_env,
        ports={name: port for c in [trainer, *others] for name, port in c.ports.items()},
        resources=trainer.resources,
        mounts=sorted(mounts.values(), key=lambda m: m.path),
    )
    return _container(plan, one, job_uid=job_uid)


def _colocated_process(c: ContainerPlan, trainer: ContainerPlan, engine_ports: list[int]) -> Obj:
    """One process of a colocated container. The container's env is the trainer's (its user
    env, tracker keys included): the others drop what their own container would not have had.
    On GPUs the trainer starts once the engine listens: vLLM measures free GPU memory while it
    starts, and a trainer loading its model beside it would skew that or leave too little."""
    item: Obj = {"name": c.name, "command": c.command, "env": c.env}
    if c is not trainer:
        own = {e.name for e in c.user_env}
        item["unsetEnv"] = sorted({e.name for e in trainer.user_env} - own - set(c.env))
    elif GPU_RESOURCE in trainer.resources.limits:
        item["waitForPorts"] = engine_ports
    return item


def _pinned(c: ContainerPlan, revision: str | None) -> ContainerPlan:
    if revision is None or c.name != FETCH_CONTAINER:
        return c
    return c.model_copy(update={"command": pinned(c.command, revision)})


def _resources(r: ResourceRequirements) -> Obj:
    out: Obj = {}
    if r.requests:
        out["requests"] = {k: _quantity(v) for k, v in r.requests.items()}
    if r.limits:
        out["limits"] = {k: _quantity(v) for k, v in r.limits.items()}
    return out


def _quantity(value: int | str) -> str:
    return str(value)


def _volume(v: VolumePlan) -> Obj:
    if v.kind == "configMap":
        return {"name": v.name, "configMap": {"name": v.source}}
    if v.kind == "pvc":
        claim: Obj = {"claimName": v.source}
        if v.read_only:
            claim["readOnly"] = True
        return {"name": v.name, "persistentVolumeClaim": claim}
    if v.kind == "empty":
        return {"name": v.name, "emptyDir": {}}
    return {"name": v.name, "emptyDir": {"medium": "Memory"}}


def _tmp_volume() -> Obj:
    return {"name": "tmp", "emptyDir": {}}


def replica_of(plan: JobPlan, name: str) -> tuple[RolePlan, ReplicaPlan] | None:
    for role in plan.roles:
        for replica in role.replicas:
            if replica.name == name:
                return role, replica
    return None
