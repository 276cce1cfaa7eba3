"""Live membership with real processes: the trainer side (`Fleet` over a real WeightPublisher and
its store) and rollout replicas started from the job plan (sidecar + test engine each).

A replica started mid-run registers, is brought to the current adapter, and only then serves; a
replica deleted (SIGTERM) deregisters and leaves without a formation timeout; one killed outright
is found unreachable and left out of the next sync; a killed one that comes back rejoins. No
trainer-side object is restarted at any point.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import make_tiny_model
from lorarl.trainer.fleet.membership import Fleet
from lorarl.trainer.fleet.publish import WeightPublisher
from lorarl.trainer.model.loading import lora_state_dict
from tests.integration.test_sidecar import (
    ALPHA,
    HOST,
    LEAVES,
    RANK,
    SYNC_KEY,
    Rollout,
    assert_serves,
    lora_tensors,
    peft_greedy,
    start_rollout,
    wait_for,
    write_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@dataclass
class Trainer:
    """Rank 0's side of a job: the model whose adapter is published, and the fleet."""

    rollout: Rollout
    fleet: Fleet
    model: PeftModel
    model_dir: Path
    version: int = 0

    def step(self, seed: int) -> None:
        set_peft_model_state_dict(self.model, lora_tensors(seed))
        self.version += 1
        status = self.fleet.publish(self.model, lora_state_dict(self.model), self.version)
        assert status.version == self.version
        self.last_members = status.members

    def serves_latest(self, i: int) -> None:
        tensors = lora_state_dict(self.model)
        assert_serves(self.rollout.greedy(i), peft_greedy(self.model_dir, tensors))


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> Iterator[Trainer]:
    run_dir = tmp_path_factory.mktemp("membership")
    model_dir = make_tiny_model(run_dir / "model", "llama", init_std=0.1)
    job_path = write_job(run_dir / "job.yaml", model_dir, "merged", replicas=3)
    rollout = start_rollout(job_path, run_dir, model_dir, only={0, 1})  # 2 of 3 to start with
    publisher = WeightPublisher(
        HOST, rollout.plan.sync.port, "merged", backend="gloo", timeout_s=60, key=SYNC_KEY
    )
    http = httpx.Client(timeout=2.0)
    try:
        fleet = Fleet(publisher, http, initial_members=2, initial_timeout_s=120, retry_s=0.2)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(LEAVES))
        yield Trainer(rollout, fleet, get_peft_model(base, config), model_dir)
    finally:
        publisher.close()
        http.close()
        rollout.stop()


def test_replicas_join_and_leave_a_running_job(trainer: Trainer) -> None:
    rollout, fleet = trainer.rollout, trainer.fleet
    trainer.step(1)  # the first sync waits for the 2 replicas the job started with
    assert trainer.last_members == 2
    assert sorted(fleet.serving().values()) == ["rollout-0", "rollout-1"]

    # Scale up: the new replica registers; before it is handed any request it has the adapter.
    rollout.engines[2].start()
    rollout.sidecars[2].start()
    wait_for(
        "rollout-2 to register",
        lambda: 2 in {m.index for m in fleet.publisher.sender.registered()},
        timeout=90,
        children=[rollout.engines[2], rollout.sidecars[2]],
    )
    assert rollout.status(2)["version"] is None and rollout.healthz(2) == 503
    serving = fleet.serving()
    assert sorted(serving.values()) == ["rollout-0", "rollout-1", "rollout-2"]
    status = rollout.status(2)
    assert (status["version"], status["updates"]) == (trainer.version, 1)
    trainer.serves_latest(2)
    trainer.step(2)
    assert trainer.last_members == 3
    assert [rollout.status(i)["version"] for i in range(3)] == [2, 2, 2]

    # Scale down: a deleted pod's sidecar gets SIGTERM, deregisters, and the next sync goes to
    # the others at once (no formation timeout waiting for it).
    rollout.sidecars[0].stop(grace_s=10)
    rollout.engines[0].stop(grace_s=10)
    assert 0 not in {m.index for m in fleet.publisher.sender.registered()}
    t0 = time.monotonic()
    trainer.step(3)
    assert trainer.last_members == 2 and time.monotonic() - t0 < 10
    assert sorted(fleet.serving().values()) == ["rollout-1", "rollout-2"]

    # A replica killed outright (no deregistration): unreachable, so left out of the next sync.
    rollout.kill(rollout.sidecars[1])
    trainer.step(4)
    assert trainer.last_members == 1
    assert fleet.serving() == {rollout.engine_urls[2]: "rollout-2"}
    trainer.serves_latest(2)

    # It comes back (the kubelet restarts the container): it rejoins and catches up.
    rollout.sidecars[1].start()
    wait_for(
        "rollout-1 to answer again",
        lambda: rollout.healthz(1) != 0,
        timeout=60,
        children=[rollout.sidecars[1]],
    )
    wait_for(
        "rollout-1 to serve the latest version",
        lambda: len(fleet.serving()) == 2,
        timeout=60,
        children=[rollout.sidecars[1]],
    )
    assert rollout.status(1)["version"] == trainer.version
    trainer.serves_latest(1)
    trainer.step(5)
    assert trainer.last_members == 2
