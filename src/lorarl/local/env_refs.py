"""The kubelet's `$(VAR)` expansion, so a local run starts exactly the commands a pod would.

Kubernetes expands `$(NAME)` in a container's command, args and env values from the container's
environment; `$$` is a literal `$`, and a reference to an undefined name stays as written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from lorarl.api.spec.workloads import SYNC_KEY_ENV
from lorarl.plan.engines import ENGINE_API_KEY_ENV, ENGINE_API_KEY_REF
from lorarl.rewards.service.auth import REWARD_API_KEY_ENV, REWARD_KEY_CONTAINERS
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


def with_job_keys(
    container: str,
    env: Mapping[str, str],
    engine_key: str,
    sync_key: str,
    reward_key: str | None = None,
) -> dict:
    """`with_engine_key`, plus the job's sync key for the sync's two ends (trainer, sidecar)
    and, when the job runs its own reward service (`reward_key`), the reward key for that
    service and the trainer, as the operator's Secret gives them to their pods. The reward
    service, which runs untrusted code, gets no engine key, as in a pod."""
    out = dict(env) if container == "reward" else with_engine_key(env, engine_key)
    if container in SYNC_KEY_CONTAINERS:
        out[SYNC_KEY_ENV] = sync_key
    if reward_key is not None and container in REWARD_KEY_CONTAINERS:
        out[REWARD_API_KEY_ENV] = reward_key
    return out


# Runs `-m <module> <args>` as `python -m` would, with `--api-key <key from the environment>`
# appended to the module's own sys.argv: the process's command line (/proc/<pid>/cmdline, which
# any local user can read) never holds the key; its environment is readable by its owner only.
_KEY_FROM_ENV = (
    "import os, runpy, sys; "
    f"sys.argv = [sys.argv[1], *sys.argv[2:], '--api-key', os.environ[{ENGINE_API_KEY_ENV!r}]]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def api_key_from_env(argv: list[str]) -> list[str]:
    """A planned `python -m <module> ... --api-key $(LORARL_ENGINE_API_KEY)` (SGLang, which reads
    its key from no variable of its own) as a command that passes the key through the
    environment instead; any other command is returned unchanged. In a pod the reference is the
    kubelet's to expand, in a container no other user shares; locally the engine runs beside
    every other process on the machine."""
    pairs = [i for i in range(len(argv) - 1) if argv[i] == "--api-key"]
    if len(argv) < 3 or argv[1] != "-m" or len(pairs) != 1:
        return argv
    at = pairs[0]
    if argv[at + 1] != ENGINE_API_KEY_REF:
        return argv
    rest = argv[3:at] + argv[at + 2 :]
    return [argv[0], "-c", _KEY_FROM_ENV, argv[2], *rest]
