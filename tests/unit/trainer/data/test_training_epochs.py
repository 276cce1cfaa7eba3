"""training.epochs: one of it and totalSteps, counted by the trainer from the rows it trains on
(trainer/data/epochs.py), with the real total in progress and on the local console."""

from __future__ import annotations

import copy

import pytest
from rich.console import Console

from lorarl.api.reports.progress import Progress
from lorarl.api.resource import LoRARLJob
from lorarl.api.validation import check_manifest
from lorarl.local.console import LiveView
from lorarl.trainer.data.epochs import resolve_total_steps, steps_for_epochs
from lorarl.trainer.errors import ConfigError

DOC = {
    "apiVersion": "lorarl.dev/v1alpha1",
    "kind": "LoRARLJob",
    "metadata": {"name": "j"},
    "spec": {
        "model": {"path": "/models/m"},
        "data": {"trainFiles": ["train.jsonl"]},
        "training": {"outputDir": "/out", "volume": {"claimName": "out", "mountPath": "/out"}},
    },
}


def job(**training) -> LoRARLJob:
    doc = copy.deepcopy(DOC)
    doc["spec"]["training"].update(training)
    return LoRARLJob.model_validate(doc)


def problems(**training) -> list[str]:
    doc = copy.deepcopy(DOC)
    doc["spec"]["training"].update(training)
    return [f"{p.path}: {p.message}" for p in check_manifest(doc)]


def test_one_of_total_steps_and_epochs():
    # neither: 100, read as `steps`, not stored (the API server would store it beside epochs)
    t = job().spec.training
    assert (t.total_steps, t.epochs, t.steps) == (None, None, 100)
    assert (
        "totalSteps" not in job().model_dump(by_alias=True, exclude_none=True)["spec"]["training"]
    )
    assert job(totalSteps=7).spec.training.steps == 7
    t = job(epochs=2.5).spec.training
    assert (t.epochs, t.total_steps, t.steps) == (2.5, None, None)  # the trainer counts them
    [both] = problems(epochs=1, totalSteps=5)
    assert both.startswith("spec.training.epochs: set totalSteps or epochs, not both")
    assert problems(epochs=0) and problems(epochs=-1)
    # a manifest dumped and read again keeps its meaning
    again = LoRARLJob.model_validate(job(epochs=3).model_dump(by_alias=True, exclude_none=True))
    assert (again.spec.training.epochs, again.spec.training.steps) == (3, None)


@pytest.mark.parametrize(
    ("epochs", "rows", "per_step", "steps"),
    [
        (1, 100, 10, 10),
        (1, 101, 10, 11),  # a last, partial batch is a step
        (3, 7473, 256, 88),  # verl's GSM8K train split, 3 epochs
        (0.1, 30, 3, 1),  # exact: 0.1 * 30 / 3 is 1, not 1.0000000000000002 -> 2
        (0.01, 10, 64, 1),  # at least one step
        (2.5, 64, 16, 10),
    ],
)
def test_steps_for_epochs(epochs, rows, per_step, steps):
    assert steps_for_epochs(epochs, rows, per_step) == steps


def test_resolve_total_steps_from_the_loaded_rows():
    assert resolve_total_steps(job(totalSteps=9), rows=1000) == 9  # rows do not matter
    assert resolve_total_steps(job(), rows=1000) == 100
    assert resolve_total_steps(job(epochs=2, promptsPerStep=8), rows=100) == 25
    with pytest.raises(ConfigError, match="no prompts"):
        resolve_total_steps(job(epochs=1), rows=0)


def test_the_critic_warmup_is_checked_once_the_count_is_known():
    doc = copy.deepcopy(DOC)
    doc["spec"]["algorithm"] = {"name": "ppo", "groupSize": 1}
    doc["spec"]["critic"] = {"warmupSteps": 20}
    doc["spec"]["training"].update(epochs=1, promptsPerStep=10)
    assert check_manifest(doc) == []  # admission cannot count the rows
    ppo = LoRARLJob.model_validate(doc)
    assert resolve_total_steps(ppo, rows=300) == 30
    with pytest.raises(ConfigError, match=r"warmupSteps \(20\) must be less than the run's 10 "):
        resolve_total_steps(ppo, rows=100)


def test_the_local_console_takes_the_trainers_total():
    view = LiveView(Console(record=True, width=120), "j", None)  # epochs: no total in the spec
    assert view.progress.tasks[0].total is None
    view.update(Progress(job="j", phase="Running", step=3, total_steps=88))
    assert (view.progress.tasks[0].completed, view.progress.tasks[0].total) == (3, 88)
