"""Operator start-up: kopf settings (standalone, no scanning, annotation storage, the webhook
server), the shared Reconciler, and the metrics and health endpoints."""

from __future__ import annotations

import logging
from typing import Any

import kopf

from lorarl.operator.handlers.common import CONFIG
from lorarl.operator.kube import Kube, load_credentials
from lorarl.operator.metrics import OperatorMetrics, health_route, metrics_route, serve
from lorarl.operator.reconciler import Reconciler
from lorarl.operator.storage import DiffBaseStorage, ProgressStorage

PREFIX = "lorarl.dev"


@kopf.on.startup()
async def configure(
    settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    settings.peering.standalone = True  # one replica; no peering objects (RBAC has none)
    settings.peering.mandatory = False
    settings.scanning.disabled = True  # the chart grants no CRD or namespace reads
    settings.persistence.finalizer = f"{PREFIX}/operator"
    # Annotations, not status: the status must stay exactly what the API models allow.
    # The same storages with a cheaper copy of the object (operator/storage.py).
    settings.persistence.progress_storage = ProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = DiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    # Only warnings from kopf's own logs become Events; ours are posted with kopf.event().
    settings.posting.level = logging.WARNING
    settings.admission.managed = None  # the Helm chart owns the webhook configuration
    if CONFIG.webhook_port:
        if not (CONFIG.cert_file.is_file() and CONFIG.key_file.is_file()):
            raise kopf.PermanentError(
                f"LORARL_WEBHOOK_PORT={CONFIG.webhook_port} but {CONFIG.cert_file} or "
                f"{CONFIG.key_file} is missing (set LORARL_WEBHOOK_PORT=0 to run without it)"
            )
        settings.admission.server = kopf.WebhookServer(
            addr=CONFIG.webhook_addr,
            port=CONFIG.webhook_port,
            certfile=str(CONFIG.cert_file),
            pkeyfile=str(CONFIG.key_file),
        )

    kube = Kube(load_credentials(), timeout=CONFIG.request_timeout)
    reconciler = Reconciler(kube, CONFIG)
    metrics = OperatorMetrics(reconciler.phases)
    reconciler.metrics = metrics
    memo["reconciler"], memo["kube"], memo["servers"] = reconciler, kube, []
    if CONFIG.metrics_port:
        memo["servers"].append(
            await serve({"/metrics": metrics_route(metrics)}, "0.0.0.0", CONFIG.metrics_port)
        )
    if CONFIG.health_port:
        memo["servers"].append(
            await serve({"/healthz": health_route()}, "0.0.0.0", CONFIG.health_port)
        )
    logger.info(
        "lorarl operator: namespace %s, webhook port %s, metrics port %s",
        CONFIG.namespace or "(all)",
        CONFIG.webhook_port or "off",
        CONFIG.metrics_port or "off",
    )


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    for runner in memo.get("servers", []):
        await runner.cleanup()
    if "reconciler" in memo:
        await memo["reconciler"].close()
        await memo["kube"].close()
