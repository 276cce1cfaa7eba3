"""One trainer-side WeightPublisher, three rollout replicas (sidecar + test engine each, started
from the job plan): every replica follows every version; an engine killed and restarted is brought
back to the latest version by its sidecar; a sidecar killed and restarted rejoins the sync group
and catches up; a sync attempted while a sidecar is down fails for the trainer but not for the
other sidecars — all without restarting the sender."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM

from harness.workloads.tiny_models import make_tiny_model
from lorarl.sync.errors import SyncTransportError
from lorarl.trainer.fleet.publish import SyncFailed, WeightPublisher
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
    wait_ready,
    write_job,
)

REPLICAS = 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ENGINE_START_S = 120  # the test engine starts in seconds; generous for a loaded box


@dataclass
class Cluster:
    rollout: Rollout
    publisher: WeightPublisher
    model: PeftModel
    model_dir: Path
    version: int = 0
    tensors: dict | None = None

    def publish(self, seed: int) -> None:
        """A trainer step's sync: new LoRA values in the PeftModel, gathered and published."""
        result = set_peft_model_state_dict(self.model, lora_tensors(seed))
        assert not result.unexpected_keys
        self.version += 1
        self.tensors = lora_state_dict(self.model)
        status = self.publisher.publish(self.model, self.tensors, self.version)
        assert status.version == self.version and status.bytes > 0

    def versions(self) -> list[int | None]:
        return [self.rollout.status(i)["version"] for i in range(REPLICAS)]


# The test engine only: the same paths on real vLLM run in tests/e2e (test_local_run kills and
# restarts a vLLM engine and a sidecar mid-run; test_vllm_sync_exact checks what vLLM serves after
# every sync; test_cluster_chaos preempts and adds vLLM rollout pods), so a second, vLLM-backed
# pass here cost ~2 minutes of `make test` for no path of its own.
@pytest.fixture(scope="module", params=["test-engine"])
def cluster(request, tmp_path_factory) -> Iterator[Cluster]:
    """Three replicas of the test engine, with the plan's sidecar command."""
    run_dir = tmp_path_factory.mktemp(f"multi-{request.param}")
    model_dir = make_tiny_model(run_dir / "model", "llama", init_std=0.1)
    job_path = write_job(run_dir / "job.yaml", model_dir, "merged", replicas=REPLICAS)
    rollout = start_rollout(job_path, run_dir, model_dir)
    publisher = None
    try:
        sync = rollout.plan.sync
        publisher = WeightPublisher(
            HOST, sync.port, "merged", backend="gloo", timeout_s=60, key=SYNC_KEY
        )
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(
            base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(LEAVES))
        )
        wait_ready(rollout, publisher.sender, timeout=ENGINE_START_S)
        yield Cluster(rollout, publisher, model, model_dir)
    finally:
        if publisher is not None:
            publisher.close()
        rollout.stop()


def incarnation(cluster: Cluster, index: int) -> str | None:
    """The registered incarnation of replica `index` (a restarted sidecar registers a new one)."""
    found = {m.index: m.incarnation for m in cluster.publisher.sender.registered()}
    return found.get(index)


def assert_all_serve_latest(cluster: Cluster) -> None:
    """Every engine serves exactly what the PeftModel with the latest adapter generates."""
    want = peft_greedy(cluster.model_dir, cluster.tensors)
    served = [cluster.rollout.greedy(i) for i in range(REPLICAS)]
    for got in served:
        assert_serves(got, want)
    assert served[1:] == served[:-1], "replicas serve different weights"


def test_every_replica_follows_every_version(cluster: Cluster) -> None:
    assert cluster.versions() == [None] * REPLICAS
    for seed in (31, 32, 33):
        cluster.publish(seed)
        assert cluster.versions() == [cluster.version] * REPLICAS
    assert [cluster.rollout.status(i)["updates"] for i in range(REPLICAS)] == [3] * REPLICAS
    assert_all_serve_latest(cluster)


def test_restarted_engine_gets_the_latest_version_back(cluster: Cluster) -> None:
    if cluster.version == 0:
        cluster.publish(41)
    rollout, victim = cluster.rollout, 1
    before = rollout.status(victim)
    rollout.kill(rollout.engines[victim])
    wait_for(
        "the sidecar to see its engine down",
        lambda: rollout.status(victim)["engineHealthy"] is False,
        timeout=15,
    )
    rollout.engines[victim].start()
    wait_for(
        "the sidecar to re-apply after the engine restart",
        lambda: rollout.status(victim)["reapplied"] == before["reapplied"] + 1,
        timeout=ENGINE_START_S,
        children=[rollout.engines[victim], rollout.sidecars[victim]],
    )
    status = rollout.status(victim)
    assert status["engineRestarts"] == before["engineRestarts"] + 1
    assert status["version"] == cluster.version and status["lastError"] is None
    assert_all_serve_latest(cluster)


def test_restarted_sidecar_rejoins_and_catches_up(cluster: Cluster) -> None:
    cluster.publish(51)
    rollout, victim = cluster.rollout, 2
    latest = cluster.version
    old = incarnation(cluster, victim)
    rollout.kill(rollout.sidecars[victim])
    rollout.sidecars[victim].start()
    wait_for(
        "the restarted sidecar to register",
        lambda: incarnation(cluster, victim) not in (None, old),
        timeout=60,
        children=[rollout.sidecars[victim]],
    )
    assert rollout.status(victim)["version"] is None  # a fresh process knows nothing yet
    assert rollout.healthz(victim) == 503  # so nothing may be sampled from it

    cluster.publisher.service_rejoin()  # re-forms the group and re-sends the latest version
    assert cluster.versions() == [latest] * REPLICAS
    assert rollout.status(victim)["updates"] == 1

    cluster.publish(52)  # the re-formed group carries the next step to everyone
    assert cluster.versions() == [latest + 1] * REPLICAS
    assert_all_serve_latest(cluster)


def test_sync_while_a_sidecar_is_down_spares_the_others(cluster: Cluster) -> None:
    rollout, victim = cluster.rollout, 0
    old = incarnation(cluster, victim)
    rollout.kill(rollout.sidecars[victim])
    with pytest.raises((SyncTransportError, SyncFailed)):
        cluster.publish(61)  # the trainer sees the step's sync fail...
    alive = [i for i in range(REPLICAS) if i != victim]
    for i in alive:  # ...but the healthy sidecars survive the broken group
        wait_for(
            f"sidecar {i} to report the broken group",
            lambda i=i: "sync transport" in (rollout.status(i)["lastError"] or ""),
            timeout=70,
            children=[rollout.sidecars[i]],
        )

    rollout.sidecars[victim].start()
    wait_for(
        "the restarted sidecar to register",
        lambda: incarnation(cluster, victim) not in (None, old),
        timeout=60,
        children=[rollout.sidecars[victim]],
    )
    cluster.publish(62)  # a new generation with every sidecar in it
    assert cluster.versions() == [cluster.version] * REPLICAS
    assert all(rollout.status(i)["lastError"] is None for i in range(REPLICAS))
    assert_all_serve_latest(cluster)
