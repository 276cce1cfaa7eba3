"""The Trainer takes its parts (trainer/loop.py): `Trainer.from_job` builds them from the job,
a test passes its own."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.checkpoint.manager import CheckpointManager
from lorarl.trainer.data.train_data import TrainData
from lorarl.trainer.fleet.engine_memory import EngineMemory
from lorarl.trainer.loop import Trainer
from lorarl.trainer.model.parallel import DistContext
from lorarl.trainer.settings import ConfigError, Endpoints


def job(tmp_path: Path) -> LoRARLJob:
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(3))
    )
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": "j"},
        "spec": {
            "model": {"path": "/models/m"},
            "data": {"trainFiles": [str(train)]},
            "training": {"totalSteps": 4, "promptsPerStep": 1, "outputDir": str(tmp_path / "out")},
        },
    })  # fmt: skip


CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


def test_a_trainer_runs_on_the_parts_it_is_given(tmp_path: Path) -> None:
    j = job(tmp_path)
    data = TrainData.from_job(j, TrainData.read(j), tokenizer=None, lengths=[1, 1, 1])
    http = httpx.Client()
    checkpoints = CheckpointManager(tmp_path / "ckpt")
    trainer = Trainer(
        j, Endpoints(rollout=["http://engine"]), CPU, data=data,
        tokenizer=SimpleNamespace(pad_token_id=None, eos_token_id=7), model=None,
        updater=None, checkpoints=checkpoints, http=http,
        engine_memory=EngineMemory(False, "vllm", http, None, lambda: []),
    )  # fmt: skip
    assert (trainer.dataset, trainer.sampler) == (data.dataset, data.sampler)
    assert trainer.checkpoints is checkpoints and trainer.total_steps == 4
    assert trainer.pad_id == 7  # no pad token: the eos token pads
    assert trainer.tracker is trainer.worker is trainer.fleet is None  # not rank 0's parts
    trainer.close()
    assert http.is_closed


def test_no_rollout_endpoints_fail_before_anything_loads(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no rollout endpoints"):
        Trainer.from_job(job(tmp_path), Endpoints(rollout=[]), CPU)
