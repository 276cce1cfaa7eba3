"""`python -m lorarl.operator`: run the handlers standalone (one replica, no peering)."""

from __future__ import annotations

import gc
import os

import kopf

from lorarl.operator.handlers.common import CONFIG

# Every watch event allocates many short-lived objects (kopf's bodies and patches, JSON,
# pydantic models): with the collector's defaults (a young collection every 700 allocations,
# each older one rescanning every import-time object) collection took ~18% of the operator's CPU
# creating 200 jobs. Import-time objects are frozen (never rescanned) and collections run less
# often; cyclic garbage still goes, a little later.
GC_THRESHOLDS = (20_000, 10, 10)


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
