"""TrainData.from_job: the trainer's data part, built from the job (trainer/data/train_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lorarl.api.resource import LoRARLJob
from lorarl.trainer.data.prompts import DataError, DataPosition
from lorarl.trainer.data.train_data import TrainData


def job(train: Path, **training) -> LoRARLJob:
    return LoRARLJob.model_validate({
        "apiVersion": "lorarl.dev/v1alpha1",
        "kind": "LoRARLJob",
        "metadata": {"name": "j"},
        "spec": {
            "model": {"path": "/models/m"},
            "data": {"trainFiles": [str(train)], "maxPromptTokens": 10, "shuffle": False},
            "training": {"promptsPerStep": 2, **training},
        },
    })  # fmt: skip


@pytest.fixture
def train(tmp_path: Path) -> Path:
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(5))
    )
    return path


def test_long_prompts_are_dropped_and_epochs_become_the_jobs_step_count(train: Path) -> None:
    j = job(train, epochs=2)
    loaded = TrainData.read(j)
    assert len(loaded) == 5
    data = TrainData.from_job(j, loaded, tokenizer=None, lengths=[3, 11, 4, 10, 30])
    assert [it.prompt for it in data.dataset] == ["p0", "p2", "p3"]
    assert data.dropped == 2
    assert data.total_steps == 3  # ceil(2 epochs x 3 prompts / 2 per step)
    assert j.spec.training.total_steps == 3  # what the schedules and progress read after
    assert data.sampler.next_batch(DataPosition())[0] == [0, 1]


def test_total_steps_stay_as_given(train: Path) -> None:
    j = job(train, totalSteps=7)
    data = TrainData.from_job(j, TrainData.read(j), tokenizer=None, lengths=[1] * 5)
    assert (data.total_steps, data.dropped, j.spec.training.total_steps) == (7, 0, 7)


def test_nothing_left_is_a_data_error(train: Path) -> None:
    j = job(train, totalSteps=7)
    with pytest.raises(DataError, match="all 5 prompts are longer"):
        TrainData.from_job(j, TrainData.read(j), tokenizer=None, lengths=[99] * 5)
