"""`python -m lorarl.operator`: run the handlers standalone (one replica, no peering)."""

from __future__ import annotations

import gc
import os

import kopf

from lorarl.operator.config import GC_THRESHOLDS
from lorarl.operator.handlers.common import CONFIG


def main() -> None:
    gc.freeze()  # the handlers, kopf and their imports are loaded by now: they live forever
    gc.set_threshold(*GC_THRESHOLDS)
    kopf.configure(verbose=os.environ.get("LORARL_DEBUG") == "1")
    kopf.run(
        standalone=True,
        clusterwide=not CONFIG.namespace,
        namespaces=[CONFIG.namespace] if CONFIG.namespace else (),
    )


if __name__ == "__main__":
    main()
