"""`lorarl validate --deep`: checks that need what the job names on this machine, not only the
manifest. Here: the reward's code imports and its signature takes what the trainer passes.

It imports (runs) the user's reward file or module, which is why neither plain `validate` nor
the webhook does: admission checks the entrypoint's form, the trainer imports the code at start.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from lorarl.api.resource import LoRARLJob
from lorarl.entrypoints import is_file_entrypoint, split_entrypoint


def deep_problems(job: LoRARLJob, *, cluster: bool) -> list[str]:
    """One line per problem, each naming the field."""
    from lorarl.model_checks import model_problems  # model, adapter, data: lorarl/model_checks.py

    return reward_code_problems(job, cluster=cluster) + model_problems(job, cluster=cluster)


def reward_code_problems(job: LoRARLJob, *, cluster: bool) -> list[str]:
    """Import `spec.reward.entrypoint` and bind its params as the trainer will.

    For a cluster job, code this machine does not have is skipped, not reported: a file in
    `reward.configMap`, on a claim or in the image, a module of the image. Locally (`--local`)
    a missing file is a problem: `lorarl run --local` would fail on it."""
    reward = job.spec.reward
    spec = reward.entrypoint
    if spec is None or (reward.service is not None and reward.service.url is not None):
        return []  # a built-in (checked at admission), or an external service's own code
    source, _ = split_entrypoint(spec)
    if is_file_entrypoint(spec):
        if not Path(source).expanduser().is_file():
            if cluster:
                return []
            return [f"spec.reward.entrypoint: no file {source} (relative to {Path.cwd()})"]
    elif cluster and importlib.util.find_spec(source.split(".")[0]) is None:
        return []
    from lorarl.rewards.registry import get_reward

    try:
        get_reward(spec, **reward.params)
    except ValueError as exc:
        return [f"spec.reward.entrypoint: {exc}"]
    return []
