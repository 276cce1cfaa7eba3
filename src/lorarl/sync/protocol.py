"""Names both ends of the sync agree on."""

from __future__ import annotations

ADAPTER_NAME_PREFIX = "lorarl"


def adapter_name(version: int) -> str:
    """The engine-side name of adapter `version` (adapter sync mode); requests name it."""
    return f"{ADAPTER_NAME_PREFIX}-v{version}"


# The containers at the two ends of the weight sync: only they get the job's sync key
# (LORARL_SYNC_KEY). Never the engine, and never the reward service, which runs untrusted code.
SYNC_KEY_CONTAINERS = ("trainer", "sidecar")
