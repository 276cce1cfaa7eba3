"""Operator settings, read once from the environment (the Helm chart's contract, see
charts/lorarl/README.md). A bad value fails start-up with the variable's name."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from lorarl.api.tenancy import TenancyPolicy, parse_allowed_secrets

DEFAULT_PROGRESS_URL = "http://{name}-trainer-0.{name}.{namespace}.svc:8080"
DEFAULT_CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# Every watch event allocates many short-lived objects (kopf's bodies and patches, JSON,
# pydantic models): with the collector's defaults (a young collection every 700 allocations,
# each older one rescanning every import-time object) collection took ~18% of the operator's CPU
# creating 200 jobs. `python -m lorarl.operator` freezes import-time objects (never rescanned)
# and collects this often instead; cyclic garbage still goes, a little later.
GC_THRESHOLDS = (20_000, 10, 10)


class ConfigError(ValueError):
    """An environment variable holds a value the operator cannot use."""


@dataclass(frozen=True)
class OperatorConfig:
    namespace: str = ""  # empty: every namespace
    webhook_port: int = 9443  # 0: no webhook server
    webhook_addr: str = "0.0.0.0"
    webhook_cert_dir: str = DEFAULT_CERT_DIR
    metrics_port: int = 8080  # 0: off
    health_port: int = 8081  # 0: off
    progress_url: str = DEFAULT_PROGRESS_URL  # `{name}`/`{namespace}`; `/progress` is appended
    timer_seconds: float = 10.0  # level-triggered pass + progress poll per job
    progress_timeout: float = 2.0
    operator_namespace: str = "default"  # where the operator and status API pods run
    request_timeout: float = 15.0
    # PriorityClasses a job may name (checked at admission); empty: none, jobs run at the
    # cluster's default priority.
    allowed_priority_classes: tuple[str, ...] = ()
    # Secrets a job may read besides its own generated one (checked at admission): `name`,
    # `namespace/name`, `namespace/*` or `*`; empty: none.
    allowed_secrets: tuple[str, ...] = ()
    # Whether job pods may select or tolerate control-plane nodes (checked at admission).
    allow_control_plane_nodes: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        return cls(
            namespace=env.get("LORARL_NAMESPACE", "").strip(),
            webhook_port=_port(env, "LORARL_WEBHOOK_PORT", 9443),
            webhook_addr=env.get("LORARL_WEBHOOK_ADDR", "0.0.0.0"),
            webhook_cert_dir=env.get("LORARL_WEBHOOK_CERT_DIR", DEFAULT_CERT_DIR),
            metrics_port=_port(env, "LORARL_METRICS_PORT", 8080),
            health_port=_port(env, "LORARL_HEALTH_PORT", 8081),
            progress_url=_template(env),
            timer_seconds=_seconds(env, "LORARL_TIMER_SECONDS", 10.0),
            progress_timeout=_seconds(env, "LORARL_PROGRESS_TIMEOUT", 2.0),
            operator_namespace=env.get("LORARL_OPERATOR_NAMESPACE") or _own_namespace(),
            request_timeout=_seconds(env, "LORARL_REQUEST_TIMEOUT", 15.0),
            allowed_priority_classes=_priority_classes(env),
            allowed_secrets=_allowed_secrets(env),
            allow_control_plane_nodes=_flag(env, "LORARL_ALLOW_CONTROL_PLANE_NODES"),
        )

    @property
    def tenancy(self) -> TenancyPolicy:
        """The admin's rules the webhook holds jobs to (api/tenancy.py)."""
        return TenancyPolicy(self.allowed_secrets, self.allow_control_plane_nodes)

    def progress_base(self, namespace: str, name: str) -> str:
        return self.progress_url.format(name=name, namespace=namespace).rstrip("/")

    @property
    def cert_file(self) -> Path:
        return Path(self.webhook_cert_dir) / "tls.crt"

    @property
    def key_file(self) -> Path:
        return Path(self.webhook_cert_dir) / "tls.key"


def _port(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}: must be a port number or 0 to turn it off (got {raw!r})"
        ) from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{name}: must be between 0 and 65535 (got {port})")
    return port


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}: must be a number of seconds (got {raw!r})") from None
    if value <= 0:
        raise ConfigError(f"{name}: must be greater than 0 (got {raw})")
    return value


_DNS1123_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"


def _priority_classes(env: Mapping[str, str]) -> tuple[str, ...]:
    name = "LORARL_ALLOWED_PRIORITY_CLASSES"
    names = tuple(n.strip() for n in env.get(name, "").split(",") if n.strip())
    for n in names:
        if len(n) > 253 or not re.fullmatch(_DNS1123_SUBDOMAIN, n):
            raise ConfigError(f"{name}: {n[:80]!r} is not a PriorityClass name")
        if n.startswith("system-"):
            raise ConfigError(f"{name}: {n!r}: system-* classes are for cluster components")
    return names


def _allowed_secrets(env: Mapping[str, str]) -> tuple[str, ...]:
    name = "LORARL_ALLOWED_SECRETS"
    try:
        return parse_allowed_secrets(env.get(name, "").split(","))
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw not in ("", "true", "false"):
        raise ConfigError(f"{name}: must be true or false (got {raw[:80]!r})")
    return raw == "true"


def _template(env: Mapping[str, str]) -> str:
    raw = env.get("LORARL_PROGRESS_URL", "").strip() or DEFAULT_PROGRESS_URL
    try:
        raw.format(name="job", namespace="ns")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            f"LORARL_PROGRESS_URL: only {{name}} and {{namespace}} may be used (got {raw!r})"
        ) from exc
    if not raw.startswith(("http://", "https://")):
        raise ConfigError(f"LORARL_PROGRESS_URL: must start with http:// or https:// (got {raw!r})")
    return raw


def _own_namespace() -> str:
    """The service account's namespace in a pod (for the NetworkPolicy peer); else default."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or "default"
    except OSError:
        return "default"
