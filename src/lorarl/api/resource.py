"""The LoRARLJob custom resource."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Final, Literal

from pydantic import ConfigDict, Field, ValidationInfo, model_validator
from pydantic_core import PydanticCustomError

from lorarl.api import safe_yaml
from lorarl.api.base import ApiModel
from lorarl.api.reports.status import LoRARLJobStatus
from lorarl.api.rules import Rule, crd_only, enforce, in_cluster, rules_schema_extra
from lorarl.api.spec.job import LoRARLJobSpec
from lorarl.api.tenancy import foreign_job_secret, foreign_secret_message

GROUP = "lorarl.dev"
VERSION = "v1alpha1"
# f"{GROUP}/{VERSION}", spelled out so that its type is the literal the model's field takes
API_VERSION: Final = "lorarl.dev/v1alpha1"
KIND: Final = "LoRARLJob"
PLURAL = "lorarljobs"
SINGULAR = "lorarljob"
SHORT_NAMES = ["lrj"]

# Children are named `<job>-trainer-<i>` / `<job>-rollout-<i>` and the headless Service `<job>`
# (a DNS-1035 label, at most 63 characters), so the name leaves room for those suffixes.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class ObjectMeta(ApiModel):
    """The parts of metav1.ObjectMeta a manifest may carry (the API server owns the rest)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, description="Job name.")
    namespace: str | None = Field(default=None, description="Namespace.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")


_NAME_RULE = Rule(
    cel=f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && "
    f"self.metadata.name.matches('{NAME_PATTERN}')",
    message=f"must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
    "(it prefixes pod and service names)",
    check=lambda m: (
        len(m.metadata.name) <= MAX_NAME_LENGTH
        and re.fullmatch(NAME_PATTERN, m.metadata.name) is not None
    ),
    field="metadata.name",
)


# A ConfigMap holds at most 1 MiB of data; the job's rendered config is one key of it.
MAX_CONFIG_BYTES = 1024 * 1024


def rendered_config(job: LoRARLJob) -> dict:
    """The job as every process reads it (the ConfigMap's job.yaml, a local run's job.yaml)."""
    return job.model_dump(mode="json", by_alias=True, exclude_none=True, exclude={"status"})


_RENDERED: OrderedDict[str, str] = OrderedDict()  # repr(config) -> its YAML, newest last
_RENDERED_LOCK = threading.Lock()  # the webhook may validate in kopf's thread pool
RENDER_CACHE = 4


def config_yaml(config: dict) -> str:
    """`safe_yaml.dump(config)`, remembered for the last few configs within the size limit.

    Validating a job renders it for the size rule and the operator then renders the same config
    for the ConfigMap; YAML emission is the costliest step of both, so the second is a lookup.
    The key is `repr` (it tells 1 from 1.0 and "1" from 1, as YAML does); a different dict
    order only misses."""
    key = repr(config)
    with _RENDERED_LOCK:
        text = _RENDERED.get(key)
        if text is not None:
            _RENDERED.move_to_end(key)
            return text
    text = safe_yaml.dump(config)
    if len(text) <= MAX_CONFIG_BYTES:  # an oversized job is refused: nothing renders it again
        with _RENDERED_LOCK:
            _RENDERED[key] = text
            while len(_RENDERED) > RENDER_CACHE:
                _RENDERED.popitem(last=False)
    return text


def config_bytes(job: LoRARLJob) -> int:
    return len(config_yaml(rendered_config(job)).encode())


_CONFIG_SIZE_RULE = Rule(
    cel=None,  # the size of a rendering is not something CEL can compute; the webhook checks it
    message=f"the job rendered as its ConfigMap's job.yaml exceeds {MAX_CONFIG_BYTES} bytes "
    "(1 MiB, the ConfigMap limit): keep large data such as reward params in files on a volume",
    check=lambda m: config_bytes(m) <= MAX_CONFIG_BYTES,
    cluster=True,
)


class LoRARLJob(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(_NAME_RULE))

    api_version: Literal["lorarl.dev/v1alpha1"] = Field(
        default=API_VERSION, description="lorarl.dev/v1alpha1."
    )
    kind: Literal["LoRARLJob"] = Field(default=KIND, description="LoRARLJob.")
    metadata: ObjectMeta = Field(description="Standard object metadata.")
    spec: LoRARLJobSpec = Field(description="What to train and how.")
    status: LoRARLJobStatus | None = Field(default=None, description="Observed state.")

    _rules = enforce(_NAME_RULE, _CONFIG_SIZE_RULE)

    @model_validator(mode="after")
    def _own_secrets_only(self, info: ValidationInfo) -> LoRARLJob:
        """Another job's generated Secret holds that job's engine and sync keys. Python only
        (the CRD's CEL cannot name the offending entry) and for jobs that run as pods: the
        webhook, `lorarl validate` and the operator refuse it (api/tenancy.py)."""
        if not in_cluster(info) or crd_only(info):
            return self
        bad = foreign_job_secret(self)
        if bad is None:
            return self
        path, name = bad
        message = foreign_secret_message(self.name)
        raise PydanticCustomError(
            "rule", "{message}", {"message": message, "field": path, "value": name}
        )

    @property
    def name(self) -> str:
        return self.metadata.name

    @property
    def namespace(self) -> str:
        return self.metadata.namespace or "default"
