"""A hub id model in a cluster: an init container fetches it into a cache volume, the pods read it.

Every trainer and rollout pod starts with `fetch-model` (`python -m lorarl.hub`), which downloads
the model into the cache volume (spec.model.volume, shared by the job's pods, or an emptyDir per
pod), pins the commit for the job and links `<cache>/lorarl/<pin>` to its snapshot. The other
containers mount the cache read-only and read the model there, so every process still sees a
folder (the rendered config says so); only the init container holds the hub token.
"""

from __future__ import annotations

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.k8s import EnvVar, EnvVarSource
from lorarl.plan.model import ContainerPlan, MountPlan

MODEL_VOLUME = "model"
FETCH_CONTAINER = "fetch-model"
# Where the cache is mounted when spec.model.volume does not say (an emptyDir per pod).
DEFAULT_CACHE_DIR = "/var/cache/lorarl-hub"
HF_TOKEN_ENV = "HF_TOKEN"


def pin_name(job: LoRARLJob) -> str:
    """The job's pin in a shared cache: its name and uid (a recreated job resolves afresh)."""
    uid = (job.metadata.model_extra or {}).get("uid")
    return f"{job.name}-{uid}" if uid else job.name


def cache_dir(job: LoRARLJob) -> str:
    volume = job.spec.model.volume
    return volume.mount_path if volume else DEFAULT_CACHE_DIR


def pod_model_path(job: LoRARLJob) -> str:
    """Where the pods read a hub id model: the link fetch-model makes to the pinned snapshot."""
    return f"{cache_dir(job)}/lorarl/{pin_name(job)}"


def with_pod_model(job: LoRARLJob) -> LoRARLJob:
    """The job as its pods read it: the model a folder in the cache (revision and hub are the
    init container's business)."""
    local = job.model_copy(deep=True)
    model = local.spec.model
    local.spec.model = model.model_copy(
        update={"path": pod_model_path(job), "revision": None, "hub": None}
    )
    return local


def fetch_command(job: LoRARLJob, revision: str | None = None) -> list[str]:
    """`revision` (a pinned commit) overrides the spec's branch or tag."""
    model = job.spec.model
    command = [
        "python", "-m", "lorarl.hub",
        "--repo", model.path,
        "--revision", revision or model.revision or "main",
        "--cache", cache_dir(job),
        "--pin", pin_name(job),
    ]  # fmt: skip
    if model.hub is not None and model.hub.endpoint:
        command += ["--endpoint", model.hub.endpoint]
    return command


def fetch_container(job: LoRARLJob, image: str) -> ContainerPlan:
    """The init container: the role's own image (it holds lorarl), the cache writable."""
    model = job.spec.model
    token = model.hub.token_secret if model.hub is not None else None
    user_env = (
        [EnvVar(name=HF_TOKEN_ENV, value_from=EnvVarSource(secret_key_ref=token))]
        if token is not None
        else []
    )
    return ContainerPlan(
        name=FETCH_CONTAINER,
        image=image,
        command=fetch_command(job),
        env={"HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"},
        user_env=user_env,
        mounts=[MountPlan(volume=MODEL_VOLUME, path=cache_dir(job))],
    )


def pinned(command: list[str], revision: str) -> list[str]:
    """A fetch command with its revision replaced by the job's pinned commit."""
    out = list(command)
    out[out.index("--revision") + 1] = revision
    return out
