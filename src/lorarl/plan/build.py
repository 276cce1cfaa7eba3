"""plan(job) -> JobPlan: pure and deterministic (same manifest, byte-identical plan)."""

from __future__ import annotations

from typing import Literal

from lorarl.api.resource import LoRARLJob, rendered_config
from lorarl.api.spec.job import RESERVED_ENV, LoRARLJobSpec
from lorarl.api.spec.k8s import ResourceRequirements, VolumeClaim
from lorarl.api.spec.placement import colocated
from lorarl.api.spec.tracking import tracking_env
from lorarl.plan.addressing import Addressing, ClusterAddressing
from lorarl.plan.engines import engine_command, engine_env
from lorarl.plan.hub import MODEL_VOLUME, cache_dir, fetch_container, with_pod_model
from lorarl.plan.model import (
    ContainerPlan,
    JobPlan,
    MountPlan,
    ReplicaPlan,
    Role,
    RolePlan,
    SyncPlan,
    VolumePlan,
)
from lorarl.plan.preemptible import rollout_labels, rollout_tolerations
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV

CONFIG_DIR = "/etc/lorarl"
CONFIG_FILE = "job.yaml"
SHM_DIR = "/dev/shm"
IMAGE_REGISTRY = "ghcr.io/lorarl"
IMAGE_TAG = "0.1.0"
# One image per thing a pod runs; a rollout image holds exactly one engine (plus the sidecar).
# `make images` builds each of these (tests/unit/plan/test_images.py checks the Makefile agrees).
DEFAULT_IMAGES = {
    name: f"{IMAGE_REGISTRY}/{name}:{IMAGE_TAG}"
    for name in ("trainer", "rollout-sglang", "rollout-vllm", "reward")
}
GPU_RESOURCE = "nvidia.com/gpu"
EMPTY = ResourceRequirements()


def plan(
    job: LoRARLJob,
    addressing: Addressing | None = None,
    *,
    config_path: str = f"{CONFIG_DIR}/{CONFIG_FILE}",
) -> JobPlan:
    addressing = addressing or ClusterAddressing()
    # A hub id: the pods' init containers fetch it (plan/hub.py); everything else reads a folder.
    source = job
    if job.spec.model.from_hub:
        job = with_pod_model(job)
    spec, name = job.spec, job.name
    _check_user_env(spec)
    labels = {
        "app.kubernetes.io/name": "lorarl",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "lorarl-operator",
        "lorarl.dev/job": name,
    }
    trainer0 = addressing.host(name, "trainer", 0)
    sync = SyncPlan(
        address=trainer0,
        port=addressing.port("trainer", 0, "sync"),
        world_size=1 + spec.rollout.replicas,
        backend=sync_backend(spec),
        mode=spec.rollout.sync_mode,
    )
    engine_role = engine_host_role(spec)
    replicas = range(spec.rollout.replicas)
    rollout_hosts = [(addressing.host(name, engine_role, i), i) for i in replicas]
    engine_urls = [
        f"http://{h}:{addressing.port(engine_role, i, 'engine')}" for h, i in rollout_hosts
    ]
    sidecar_urls = [
        f"http://{h}:{addressing.port(engine_role, i, 'sidecar')}" for h, i in rollout_hosts
    ]
    reward_url = _reward_url(job, addressing)
    common = {"LORARL_JOB_NAME": name, "LORARL_CONFIG": config_path}
    # A rollout pod's env never depends on how many replicas there are (scaling adds pods and
    # changes no running one): sidecars register in the sync store and the trainer reads who is
    # there (docs/architecture.md#live-membership). The trainer's world size is the start count.
    sync_env = {
        "LORARL_SYNC_ADDR": sync.address,
        "LORARL_SYNC_PORT": str(sync.port),
        "LORARL_SYNC_BACKEND": sync.backend,  # both ends use the plan's choice, never their own
    }
    urls = (engine_urls, sidecar_urls, reward_url)
    roles = [_trainer_role(job, addressing, common, sync_env, *urls)]
    if not colocated(spec):
        roles.append(_rollout_role(job, addressing, common, sync_env))
    if source.spec.model.from_hub:
        roles = [_with_model_fetch(r, source) for r in roles]
    if spec.reward.service is not None and spec.reward.service.url is None:
        roles.append(_reward_role(job, addressing, common))
    return JobPlan(
        name=name,
        namespace=job.namespace,
        service_name=name,
        placement=spec.rollout.placement,
        config_path=config_path,
        labels=labels,
        sync=sync,
        roles=roles,
        config=rendered_config(job),
    )


def _with_model_fetch(role: RolePlan, source: LoRARLJob) -> RolePlan:
    """Each pod fetches the hub id first (into a shared claim, or its own emptyDir), in its own
    image; the containers read the cache read-only."""
    if role.role == "reward":  # the reward service never reads the model
        return role
    volumes = [v for v in role.volumes if v.name != MODEL_VOLUME]
    claim = source.spec.model.volume
    cache = (
        VolumePlan(name=MODEL_VOLUME, kind="pvc", source=claim.claim_name)
        if claim
        else VolumePlan(name=MODEL_VOLUME, kind="empty")
    )
    replicas = []
    for replica in role.replicas:
        containers = [
            c.model_copy(
                update={
                    "mounts": [m for m in c.mounts if m.volume != MODEL_VOLUME]
                    + [MountPlan(volume=MODEL_VOLUME, path=cache_dir(source), read_only=True)]
                }
            )
            for c in replica.containers
        ]
        fetch = fetch_container(source, containers[0].image)
        replicas.append(
            replica.model_copy(update={"containers": containers, "init_containers": [fetch]})
        )
    return role.model_copy(update={"volumes": [*volumes, cache], "replicas": replicas})


def sync_backend(spec: LoRARLJobSpec) -> Literal["gloo"]:
    """The weight-sync group's backend: gloo, staged through host memory, whatever the trainer
    runs on. Correct by construction: the sidecar has no GPU (the engine container holds the
    pod's GPUs; one more per sidecar would idle a whole device per replica), and what it does
    with the tensors is host work anyway (an fp32 merge into host copies of the base weights,
    then HTTP or shared-memory files to the engine). The cost is on the trainer: one
    device-to-host copy of the LoRA tensors and a TCP broadcast, e.g. ~160 MB for a 7B model at
    r=32 in bf16: ~20 ms of copy and ~0.15 s at 1 GB/s (gloo measured 4.4 GB/s between local
    processes), against RL steps of tens of seconds."""
    del spec  # one answer today; the signature keeps the choice in one place
    return "gloo"


def engine_host_role(spec: LoRARLJobSpec) -> Role:
    """Whose pods run the engines: rollout pods, or the trainer's own when colocated."""
    return "trainer" if colocated(spec) else "rollout"


def rollout_image(engine: str) -> str:
    """The default image of a rollout pod: the one that holds its engine."""
    return DEFAULT_IMAGES[f"rollout-{engine}"]


def _check_user_env(spec: LoRARLJobSpec) -> None:
    """Defense in depth: validation rejects these, but a plan must never let them through."""
    for role, env in (("trainer", spec.trainer.env), ("rollout", spec.rollout.env)):
        clash = sorted({e.name for e in env} & set(RESERVED_ENV))
        if clash:
            raise ValueError(f"spec.{role}.env: reserved variables cannot be set: {clash}")
    # The reward key comes from the job's Secret when the job runs its own reward service; a
    # trainer may be given one (its own Secret) only for an external service (service.url).
    service = spec.reward.service
    own_service = service is not None and service.url is None
    for role, env in (("trainer", spec.trainer.env), ("rollout", spec.rollout.env)):
        if any(e.name == REWARD_API_KEY_ENV for e in env) and (role == "rollout" or own_service):
            raise ValueError(
                f"spec.{role}.env: {REWARD_API_KEY_ENV} is set by lorarl (the job's reward "
                "service key); set it in spec.trainer.env only for an external "
                "spec.reward.service.url"
            )


def nproc_per_replica(spec: LoRARLJobSpec) -> int:
    t = spec.trainer
    return t.processes_per_replica or max(1, t.gpus_per_replica)


def _trainer_role(job, addressing, common, sync_env, engine_urls, sidecar_urls, reward_url):
    spec, name = job.spec, job.name
    nproc = nproc_per_replica(spec)
    nnodes = spec.trainer.replicas
    master = addressing.host(name, "trainer", 0)
    master_port = addressing.port("trainer", 0, "master")
    progress_port = addressing.port("trainer", 0, "progress")
    replicas = []
    for i in range(nnodes):
        env = {
            **common,
            "MASTER_ADDR": master,
            "MASTER_PORT": str(master_port),
            "WORLD_SIZE": str(nnodes * nproc),
            "NODE_RANK": str(i),
            "NPROC_PER_NODE": str(nproc),
            **sync_env,
            "LORARL_SYNC_WORLD_SIZE": str(1 + len(engine_urls)),
            "LORARL_ROLLOUT_ENDPOINTS": ",".join(engine_urls),
            "LORARL_SIDECAR_ENDPOINTS": ",".join(sidecar_urls),
            "LORARL_PROGRESS_PORT": str(progress_port),
        }
        if reward_url:
            env["LORARL_REWARD_ENDPOINT"] = reward_url
        command = [
            "python", "-m", "torch.distributed.run",
            "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc),
            "--node-rank", str(i),
            "--master-addr", master,
            "--master-port", str(master_port),
            "-m", "lorarl.trainer",
            "--config", common["LORARL_CONFIG"],
        ]  # fmt: skip
        colocated_engine = (
            _engine_containers(job, addressing, common, sync_env, "trainer", i)
            if colocated(spec)
            else []
        )
        ports = {"master": master_port}
        if i == 0:
            ports |= {"sync": addressing.port("trainer", 0, "sync"), "progress": progress_port}
        container = ContainerPlan(
            name="trainer",
            image=trainer_image(spec),
            command=command,
            env=env,
            user_env=[*spec.trainer.env, *tracking_env(spec)],  # tracker keys: trainer only
            ports=ports,
            resources=_with_gpus(spec.trainer.resources, spec.trainer.gpus_per_replica),
            mounts=_mounts(spec, "trainer", _config_dir(common)),
        )
        replicas.append(
            ReplicaPlan(
                role="trainer",
                index=i,
                name=f"{name}-trainer-{i}",
                host=addressing.host(name, "trainer", i),
                containers=[container, *colocated_engine],
            )
        )
    return RolePlan(
        role="trainer",
        replicas=replicas,
        volumes=_volumes(job, "trainer"),
        node_selector=spec.trainer.node_selector,
        tolerations=spec.trainer.tolerations,
        gpus_per_replica=spec.trainer.gpus_per_replica,
    )


def _rollout_role(job, addressing, common, sync_env):
    spec, name = job.spec, job.name
    r = spec.rollout
    replicas = []
    for i in range(r.replicas):
        replicas.append(
            ReplicaPlan(
                role="rollout",
                index=i,
                name=f"{name}-rollout-{i}",
                host=addressing.host(name, "rollout", i),
                containers=_engine_containers(job, addressing, common, sync_env, "rollout", i),
            )
        )
    return RolePlan(
        role="rollout",
        replicas=replicas,
        volumes=_volumes(job, "rollout"),
        node_selector=r.node_selector,
        tolerations=rollout_tolerations(r),  # spec.rollout.preemptible adds the spot ones
        labels=rollout_labels(r),
        gpus_per_replica=r.gpus_per_replica,
    )


def _engine_containers(job, addressing, common, sync_env, role: Role, i: int) -> list:
    """The engine and its sync sidecar: a rollout pod's two containers, or the two extra
    processes of a colocated trainer pod (which inherit the trainer's image and env)."""
    spec, name = job.spec, job.name
    r = spec.rollout
    engine_port = addressing.port(role, i, "engine")
    sidecar_port = addressing.port(role, i, "sidecar")
    host = addressing.host(name, role, i)
    bind = "127.0.0.1" if host == "127.0.0.1" else "0.0.0.0"
    own_pod = role == "rollout"
    image = (r.image or rollout_image(r.engine)) if own_pod else trainer_image(spec)
    engine = ContainerPlan(
        name="engine",
        image=image,
        command=engine_command(spec, spec.model.path, bind, engine_port),
        env=engine_env(spec),
        user_env=r.env if own_pod else spec.trainer.env,
        ports={"engine": engine_port},
        # a colocated engine uses the trainer container's resources (one container, see builders)
        resources=_with_gpus(r.resources, r.gpus_per_replica) if own_pod else EMPTY,
        mounts=_mounts(spec, "rollout", _config_dir(common)) + _engine_cache_mounts(spec),
    )
    sidecar = ContainerPlan(
        name="sidecar",
        image=image,
        command=["python", "-m", "lorarl.rollout.sidecar", "--config", common["LORARL_CONFIG"]],
        env={
            **common,
            **sync_env,
            "LORARL_ROLLOUT_INDEX": str(i),
            # where the trainer reaches this replica, published with its registration
            "LORARL_ADVERTISED_ENGINE_URL": f"http://{host}:{engine_port}",
            "LORARL_ADVERTISED_SIDECAR_URL": f"http://{host}:{sidecar_port}",
            "LORARL_ENGINE_URL": f"http://127.0.0.1:{engine_port}",
            "LORARL_SIDECAR_PORT": str(sidecar_port),
        },
        user_env=[] if own_pod else spec.trainer.env,
        ports={"sidecar": sidecar_port},
        mounts=_mounts(spec, "rollout", _config_dir(common)),
    )
    return [engine, sidecar]


def trainer_image(spec: LoRARLJobSpec) -> str:
    """A colocated trainer pod runs the engine too: by default its engine's image, which holds
    the trainer as well (rollout_image/)."""
    if spec.trainer.image:
        return spec.trainer.image
    return rollout_image(spec.rollout.engine) if colocated(spec) else DEFAULT_IMAGES["trainer"]


def _reward_role(job, addressing, common):
    spec, name = job.spec, job.name
    service = spec.reward.service
    port = addressing.port("reward", 0, "reward")
    container = ContainerPlan(
        name="reward",
        image=DEFAULT_IMAGES["reward"],
        command=[
            "python",
            "-m",
            "lorarl.rewards.service.serve",
            "--config",
            common["LORARL_CONFIG"],
            "--port",
            str(port),
        ],
        env=dict(common),
        ports={"reward": port},
        resources=service.resources,
        mounts=[
            MountPlan(volume="config", path=_config_dir(common), read_only=True),
            *_reward_code_mounts(spec),
            MountPlan(volume="shm", path=SHM_DIR),
        ],
    )
    replica = ReplicaPlan(
        role="reward",
        index=0,
        name=f"{name}-reward-0",
        host=addressing.host(name, "reward", 0),
        containers=[container],
    )
    return RolePlan(
        role="reward",
        replicas=[replica],
        volumes=[
            _config_volume(name),
            *_reward_code_volumes(spec),
            VolumePlan(name="shm", kind="memory"),
        ],
        gpus_per_replica=0,
    )


def _reward_url(job: LoRARLJob, addressing: Addressing) -> str | None:
    service = job.spec.reward.service
    if service is None:
        return None
    if service.url:
        return service.url
    host = addressing.host(job.name, "reward", 0)
    return f"http://{host}:{addressing.port('reward', 0, 'reward')}"


def _with_gpus(resources: ResourceRequirements, gpus: int) -> ResourceRequirements:
    if gpus == 0:
        return resources
    return ResourceRequirements(
        requests=resources.requests, limits={**resources.limits, GPU_RESOURCE: gpus}
    )


def _config_dir(common: dict[str, str]) -> str:
    return common["LORARL_CONFIG"].rsplit("/", 1)[0]


def _config_volume(name: str) -> VolumePlan:
    return VolumePlan(name="config", kind="configMap", source=f"{name}-config", read_only=True)


def _claims(spec: LoRARLJobSpec, role: str) -> list[tuple[str, VolumeClaim, bool]]:
    """(volume name, claim, read only) for the PVCs a role mounts."""
    out = []
    if spec.model.volume:
        out.append(("model", spec.model.volume, True))
    if role == "trainer" and spec.data.volume:
        out.append(("data", spec.data.volume, True))
    if role == "trainer" and spec.training.volume:
        out.append(("output", spec.training.volume, False))
    return out


def _volumes(job: LoRARLJob, role: str) -> list[VolumePlan]:
    vols = [_config_volume(job.name)]
    vols += [
        VolumePlan(name=n, kind="pvc", source=c.claim_name, read_only=ro or c.read_only)
        for n, c, ro in _claims(job.spec, role)
    ]
    if role == "trainer":
        vols += _reward_code_volumes(job.spec) + _agent_code_volumes(job.spec)
    if role == "rollout" or (role == "trainer" and colocated(job.spec)):
        vols += _engine_cache_volumes(job.spec)
    # Every role: NCCL, DataLoader workers, vLLM and Ray's object store need more than the
    # container runtime's 64 MiB /dev/shm.
    vols.append(VolumePlan(name="shm", kind="memory"))
    return vols


def _mounts(spec: LoRARLJobSpec, role: str, config_dir: str) -> list[MountPlan]:
    mounts = [MountPlan(volume="config", path=config_dir, read_only=True)]
    mounts += [
        MountPlan(volume=n, path=c.mount_path, read_only=ro or c.read_only)
        for n, c, ro in _claims(spec, role)
    ]
    if role == "trainer":
        mounts += _reward_code_mounts(spec) + _agent_code_mounts(spec)
    mounts.append(MountPlan(volume="shm", path=SHM_DIR))
    return mounts


# spec.rollout.cacheVolume: the engines' compile caches, on the engine container only (the
# sidecar compiles nothing); on the trainer pod too when the engine is colocated there.
ENGINE_CACHE_VOLUME = "engine-cache"


def _engine_cache_volumes(spec: LoRARLJobSpec) -> list[VolumePlan]:
    cache = spec.rollout.cache_volume
    if cache is None:
        return []
    return [VolumePlan(name=ENGINE_CACHE_VOLUME, kind="pvc", source=cache.claim_name)]


def _engine_cache_mounts(spec: LoRARLJobSpec) -> list[MountPlan]:
    cache = spec.rollout.cache_volume
    if cache is None:
        return []
    return [MountPlan(volume=ENGINE_CACHE_VOLUME, path=cache.mount_path)]


# spec.reward.configMap: the reward's code, where rewards are scored (the trainer container,
# which scores in-process, and lorarl's reward service); engines and sidecars never import it.
REWARD_CODE_VOLUME = "reward-code"


def _reward_code_volumes(spec: LoRARLJobSpec) -> list[VolumePlan]:
    cm = spec.reward.config_map
    if cm is None:
        return []
    return [VolumePlan(name=REWARD_CODE_VOLUME, kind="configMap", source=cm.name, read_only=True)]


def _reward_code_mounts(spec: LoRARLJobSpec) -> list[MountPlan]:
    cm = spec.reward.config_map
    if cm is None:
        return []
    return [MountPlan(volume=REWARD_CODE_VOLUME, path=cm.mount_path, read_only=True)]


# spec.agent.configMap: the agent's code, in the trainer pods (rank 0 runs the agent).
AGENT_CODE_VOLUME = "agent-code"


def _agent_code_volumes(spec: LoRARLJobSpec) -> list[VolumePlan]:
    cm = spec.agent.config_map if spec.agent is not None else None
    if cm is None:
        return []
    return [VolumePlan(name=AGENT_CODE_VOLUME, kind="configMap", source=cm.name, read_only=True)]


def _agent_code_mounts(spec: LoRARLJobSpec) -> list[MountPlan]:
    cm = spec.agent.config_map if spec.agent is not None else None
    if cm is None:
        return []
    return [MountPlan(volume=AGENT_CODE_VOLUME, path=cm.mount_path, read_only=True)]
