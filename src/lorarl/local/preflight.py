"""What a local run checks before it starts a process: the files it names exist here.

Without this, a missing model folder shows up a minute later as a traceback in an engine's log and
three engine restarts; here it is one line that names the field and how to create the file.
"""

from __future__ import annotations

from pathlib import Path

from lorarl.api.resource import LoRARLJob
from lorarl.api.spec.job import is_hub_id
from lorarl.entrypoints import is_file_entrypoint, split_entrypoint
from lorarl.errors import UserError

PREPARE_HINT = (
    "the examples' models and data come from `lorarl prepare quickstart` or "
    "`lorarl prepare smollm2`; paths are relative to the current directory"
)


class LocalInputMissing(UserError):
    pass


def missing_inputs(job: LoRARLJob) -> list[str]:
    """One line per local file or folder the job names that does not exist."""
    spec = job.spec
    problems = []
    model = spec.model.path
    if not is_hub_id(model) and not Path(model).is_dir():  # a hub id is fetched (hub_model.py)
        problems.append(f"spec.model.path: {model} is not a folder here")
    if spec.lora.adapter_path and not Path(spec.lora.adapter_path).is_dir():
        problems.append(f"spec.lora.adapterPath: {spec.lora.adapter_path} is not a folder here")
    for key, files in (("trainFiles", spec.data.train_files), ("valFiles", spec.data.val_files)):
        for i, f in enumerate(files):
            if "://" not in f and not Path(f).exists():  # a file, or a folder of shards
                problems.append(f"spec.data.{key}[{i}]: {f} does not exist")
    reward = spec.reward.entrypoint
    external = spec.reward.service is not None and spec.reward.service.url is not None
    if reward and is_file_entrypoint(reward) and not external:
        path = split_entrypoint(reward)[0]
        if not Path(path).expanduser().is_file():
            problems.append(f"spec.reward.entrypoint: {path} is not a file here")
    return problems


def check_inputs(job: LoRARLJob) -> None:
    problems = missing_inputs(job)
    if problems:
        raise LocalInputMissing(f"{'; '.join(problems)} ({PREPARE_HINT})")
