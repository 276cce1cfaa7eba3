"""The kubelet's `$(VAR)` expansion, so a local run starts exactly the commands a pod would.

Kubernetes expands `$(NAME)` in a container's command, args and env values from the container's
environment; `$$` is a literal `$`, and a reference to an undefined name stays as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lorarl.api.workloads import SYNC_KEY_ENV
from lorarl.plan.engines import ENGINE_API_KEY_ENV
from lorarl.sync.protocol import SYNC_KEY_CONTAINERS

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(one, text)


def expand_env(env: Mapping[str, str], defined: Mapping[str, str]) -> dict[str, str]:
    """Each value expanded against `defined`."""
    return {name: expand(value, defined) for name, value in env.items()}


def with_engine_key(env: Mapping[str, str], key: str) -> dict[str, str]:
    """A container's planned env as its pod gets it: the job's engine key (from the Secret)
    first, then the plan's values with references to it expanded."""
    defined = {ENGINE_API_KEY_ENV: key}
    return {**defined, **expand_env(env, defined)}


def with_job_keys(container: str, env: Mapping[str, str], engine_key: str, sync_key: str) -> dict:
    """`with_engine_key`, plus the job's sync key for the sync's two ends (trainer, sidecar),
    as the operator's Secret gives it to their pods."""
    out = with_engine_key(env, engine_key)
    if container in SYNC_KEY_CONTAINERS:
        out[SYNC_KEY_ENV] = sync_key
    return out
