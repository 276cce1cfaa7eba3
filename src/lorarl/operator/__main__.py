"""`python -m lorarl.operator`: run the handlers standalone (one replica, no peering)."""

from __future__ import annotations

import os

import kopf

from lorarl.operator.handlers.common import CONFIG


def main() -> None:
    kopf.configure(verbose=os.environ.get("LORARL_DEBUG") == "1")
    kopf.run(
        standalone=True,
        clusterwide=not CONFIG.namespace,
        namespaces=[CONFIG.namespace] if CONFIG.namespace else (),
    )


if __name__ == "__main__":
    main()
