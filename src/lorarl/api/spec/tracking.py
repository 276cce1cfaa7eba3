"""`spec.logging`: the experiment trackers a job reports to (TensorBoard, MLflow, W&B).

Credentials are never in the manifest: each one names a Secret key, and the plan turns it into
an env var with `valueFrom.secretKeyRef` on the trainer container only (`tracking_env`), where
the tracker's own library reads it (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field

from lorarl.api.base import ApiModel
from lorarl.api.rules import Rule, enforce, rules_schema_extra
from lorarl.api.spec.k8s import EnvVar, EnvVarSource, SecretKeySelector

if TYPE_CHECKING:
    from lorarl.api.spec.job import LoRARLJobSpec

Backend = Literal["tensorboard", "mlflow", "wandb"]

WANDB_API_KEY_ENV = "WANDB_API_KEY"
MLFLOW_TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"
MLFLOW_USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"
MLFLOW_PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
# Variables that carry a tracker credential: a literal value in trainer.env is refused.
CREDENTIAL_ENV = (WANDB_API_KEY_ENV, MLFLOW_TOKEN_ENV, MLFLOW_PASSWORD_ENV)


class MlflowSettings(ApiModel):
    tracking_uri: str = Field(
        pattern=r"^(https?|file)://",
        max_length=2048,
        description="MLflow tracking server, e.g. http://mlflow.mlops:5000 (or file:// for a "
        "folder the trainer can write).",
    )
    experiment: str | None = Field(
        default=None,
        min_length=1,
        max_length=500,
        description="Experiment; the job's name if unset.",
    )
    token_secret: SecretKeySelector | None = Field(
        default=None, description="Secret key holding a bearer token (MLFLOW_TRACKING_TOKEN)."
    )
    username_secret: SecretKeySelector | None = Field(
        default=None, description="Secret key holding a basic-auth user (MLFLOW_TRACKING_USERNAME)."
    )
    password_secret: SecretKeySelector | None = Field(
        default=None,
        description="Secret key holding a basic-auth password (MLFLOW_TRACKING_PASSWORD).",
    )


class WandbSettings(ApiModel):
    project: str | None = Field(
        default=None, min_length=1, max_length=128, description="Project; the job's name if unset."
    )
    entity: str | None = Field(
        default=None, min_length=1, max_length=128, description="Team or user (W&B's default)."
    )
    mode: Literal["online", "offline"] | None = Field(
        default=None,
        description="online streams to W&B and needs an API key (apiKeySecret, or WANDB_API_KEY "
        "from a Secret in trainer.env); offline writes the run under outputDir/wandb for a later "
        "`wandb sync`. Unset: online when a key is given, else offline.",
    )
    api_key_secret: SecretKeySelector | None = Field(
        default=None, description="Secret key holding the W&B API key (WANDB_API_KEY)."
    )
    base_url: str | None = Field(
        default=None,
        pattern=r"^https?://",
        max_length=2048,
        description="A self-hosted W&B server (WANDB_BASE_URL); W&B's cloud if unset.",
    )


def _settings_rule(backend: str) -> Rule:
    return Rule(
        cel=f"!has(self.{backend}) || '{backend}' in self.backends",
        message=f"{backend} settings are given but '{backend}' is not in backends",
        check=lambda m: getattr(m, backend) is None or backend in m.backends,
        field=backend,
    )


_MLFLOW_NEEDS_SETTINGS = Rule(
    cel="!('mlflow' in self.backends) || has(self.mlflow)",
    message="the mlflow backend needs mlflow.trackingUri",
    check=lambda m: "mlflow" not in m.backends or m.mlflow is not None,
    field="backends",
)
_UNIQUE_BACKENDS = Rule(
    cel="self.backends.all(b, self.backends.exists_one(c, c == b))",
    message="each backend may be listed once",
    check=lambda m: len(set(m.backends)) == len(m.backends),
    field="backends",
)
_LOGGING_RULES = (
    _UNIQUE_BACKENDS,
    _MLFLOW_NEEDS_SETTINGS,
    _settings_rule("mlflow"),
    _settings_rule("wandb"),
)


class LoggingSpec(ApiModel):
    model_config = ConfigDict(json_schema_extra=rules_schema_extra(*_LOGGING_RULES))

    backends: list[Backend] = Field(
        default_factory=list,
        max_length=3,
        description="Trackers every step's metrics, every eval and the sample completions go "
        "to: tensorboard (event files in outputDir/tensorboard), mlflow, wandb. A tracker that "
        "is down never fails the run: the trainer warns and the history stays in outputDir.",
    )
    run_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The run's name in MLflow and W&B (verl's trainer.experiment_name, SkyRL's "
        "trainer.run_name); the job's name if unset. Only the display name: a restarted "
        "trainer finds its run by the id kept in outputDir/tracking.json.",
    )
    mlflow: MlflowSettings | None = Field(default=None, description="MLflow settings.")
    wandb: WandbSettings | None = Field(default=None, description="Weights & Biases settings.")

    _rules = enforce(*_LOGGING_RULES)


def _secret_envs(spec: LoRARLJobSpec) -> list[tuple[str, SecretKeySelector]]:
    out: list[tuple[str, SecretKeySelector]] = []
    mlflow, wandb = spec.logging.mlflow, spec.logging.wandb
    if mlflow is not None:
        for name, sel in (
            (MLFLOW_TOKEN_ENV, mlflow.token_secret),
            (MLFLOW_USERNAME_ENV, mlflow.username_secret),
            (MLFLOW_PASSWORD_ENV, mlflow.password_secret),
        ):
            if sel is not None:
                out.append((name, sel))
    if wandb is not None and wandb.api_key_secret is not None:
        out.append((WANDB_API_KEY_ENV, wandb.api_key_secret))
    return out


def tracking_env(spec: LoRARLJobSpec) -> list[EnvVar]:
    """The trainer container's credential variables, each a reference to its Secret key."""
    return [
        EnvVar(name=name, value_from=EnvVarSource(secret_key_ref=sel))
        for name, sel in _secret_envs(spec)
    ]


def wandb_has_key(spec: LoRARLJobSpec) -> bool:
    w = spec.logging.wandb
    return (w is not None and w.api_key_secret is not None) or any(
        e.name == WANDB_API_KEY_ENV for e in spec.trainer.env
    )


_TRAINER_ENV = "has(self.trainer) && has(self.trainer.env)"
_CREDENTIALS_CEL = "[" + ", ".join(f"'{n}'" for n in CREDENTIAL_ENV) + "]"
_SECRET_FIELDS = (
    ("mlflow", "tokenSecret", MLFLOW_TOKEN_ENV),
    ("mlflow", "usernameSecret", MLFLOW_USERNAME_ENV),
    ("mlflow", "passwordSecret", MLFLOW_PASSWORD_ENV),
    ("wandb", "apiKeySecret", WANDB_API_KEY_ENV),
)


def _no_double_cel() -> str:
    parts = []
    for backend, field, env in _SECRET_FIELDS:
        section = f"self.logging.{backend}"
        has = f"has(self.logging) && has({section}) && has({section}.{field})"
        parts.append(f"!({has} && {_TRAINER_ENV} && self.trainer.env.exists(e, e.name == '{env}'))")
    return " && ".join(parts)


# Spec-level rules: they compare logging with trainer.env.
INLINE_KEY_RULE = Rule(
    cel=f"!({_TRAINER_ENV}) || self.trainer.env.all(e, !(e.name in {_CREDENTIALS_CEL}) || "
    "has(e.valueFrom))",
    message="tracker credentials (" + ", ".join(CREDENTIAL_ENV) + ") must come from a Secret "
    "(valueFrom.secretKeyRef, or logging.*Secret), never a literal value",
    check=lambda m: all(e.name not in CREDENTIAL_ENV or e.value_from for e in m.trainer.env),
    field="trainer.env",
)
DOUBLE_KEY_RULE = Rule(
    cel=_no_double_cel(),
    message="a tracker credential is set twice: in logging (*Secret) and in trainer.env",
    check=lambda m: not {n for n, _ in _secret_envs(m)} & {e.name for e in m.trainer.env},
    field="trainer.env",
)
WANDB_ONLINE_RULE = Rule(
    cel="!has(self.logging) || !has(self.logging.wandb) || !has(self.logging.wandb.mode) || "
    "self.logging.wandb.mode != 'online' || has(self.logging.wandb.apiKeySecret) || "
    f"({_TRAINER_ENV} && self.trainer.env.exists(e, e.name == '{WANDB_API_KEY_ENV}'))",
    message="wandb online needs an API key: set logging.wandb.apiKeySecret (or mode: offline)",
    check=lambda m: m.logging.wandb is None or m.logging.wandb.mode != "online" or wandb_has_key(m),
    field="logging.wandb.mode",
)
TRACKING_SPEC_RULES = (INLINE_KEY_RULE, DOUBLE_KEY_RULE, WANDB_ONLINE_RULE)
