"""`python -m lorarl.operator`: run the handlers standalone (one replica, no peering)."""

from __future__ import annotations

import asyncio
import gc
import os

import kopf

from lorarl.operator.config import GC_THRESHOLDS
from lorarl.operator.crd_wait import is_resource_gone, wait_until_served
from lorarl.operator.handlers.common import CONFIG


def main() -> None:
    gc.freeze()  # the handlers, kopf and their imports are loaded by now: they live forever
    gc.set_threshold(*GC_THRESHOLDS)
    kopf.configure(verbose=os.environ.get("LORARL_DEBUG") == "1")
    while True:
        try:
            kopf.run(
                standalone=True,
                clusterwide=not CONFIG.namespace,
                namespaces=[CONFIG.namespace] if CONFIG.namespace else (),
            )
            return
        except Exception as exc:
            if not is_resource_gone(exc):
                raise
        # The CRD is gone: wait (healthy) until it is served again, then start over.
        asyncio.run(wait_until_served(CONFIG.health_port))


if __name__ == "__main__":
    main()
