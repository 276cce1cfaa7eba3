"""Faults on a running job on the cluster path (issue #17's matrix, short: `python -m
bench.chaos` injects each fault 10 times).

One job (the quickstart on claims, 2 vLLM rollout pods, checkpointInterval 3) on the real control
plane and the process kubelet takes, while it trains: a rollout pod preempted (processes
SIGKILLed, deleted with grace 0), `kubectl scale lrj --replicas=3`, one torchrun worker of the
trainer SIGKILLed, and later the API server and then etcd restarted. Then:
the job Succeeds; the trainer restarted once (the rank kill; the rollout faults cost none) and
redid no more steps than checkpointInterval; every checkpoint on the claim verifies; no role and
index ever had two live pods (polled every 0.2 s); the third engine got generation requests
within one step of its sidecar being in sync (step history `engineRequests`); every engine
served the trainer's newest version, read back from the sidecars while the job ran.
"""

from __future__ import annotations

import random
import time

import pytest
import yaml

from harness.chaos import faults as chaos
from harness.chaos.run import (
    FAULTS,
    Injection,
    engine_served_steps,
    job_for,
    step_in_progress,
    wait_recovered,
)
from harness.cluster.cluster import Cluster, cluster, wait_phase
from harness.cluster.jobs import prepare_assets, provision

pytestmark = pytest.mark.slow
NAME, INTERVAL = "chaos-short", 3
# Measured: the rank kill lands at step ~4, the control plane restarts begin at step ~4-6 and
# steps then take ~2 s; a 45-step job spent its last ~70 s running steps no check needs. 24 leaves
# ample room for a slower machine to finish the faults before the job ends.
STEPS = 24


def timeline(w: chaos.Watcher, since: float) -> dict[int, float]:
    """Seconds from `since` to each step's first record, for the steps recorded after it."""
    return {s: round(t - since, 1) for s, t in sorted(w.first_times().items()) if t >= since}


def stall_report(c: Cluster, w: chaos.Watcher, since: float) -> str:
    """The steps since `since` and the last lines of the trainer's and each sidecar's log."""
    w.poll_history()
    parts = [f"steps after the faults (s): {timeline(w, since)}"]
    for pod, container in [(f"{NAME}-trainer-0", "trainer")] + [
        (f"{NAME}-rollout-{i}", "sidecar") for i in range(3)
    ]:
        try:
            tail = c.kubelet.logs("default", pod, container).splitlines()[-25:]
        except (AssertionError, OSError, ValueError) as exc:
            tail = [f"(no log: {exc})"]
        parts.append(f"--- {pod}/{container}:\n" + "\n".join(tail))
    return "\n".join(parts)


def test_preemption_scale_up_and_a_trainer_kill_on_one_running_job(tmp_path) -> None:
    prepare_assets()
    with cluster(tmp_path) as c:
        provision(c)
        job = job_for(FAULTS["rollout_delete"], NAME, steps=STEPS, checkpoint_interval=INTERVAL)
        c.apply(yaml.safe_dump(job))
        applied = time.time()
        with chaos.Watcher(c, NAME) as w:
            c.kubelet.wait(lambda: w.step() >= 2, 600, "step 2")
            w.poll_history()
            inj = Injection(0, w.step(), time.time(), "")
            inj.detail = chaos.delete_pod(c, f"{NAME}-rollout-1", preempt=True)
            inj.detail += "; " + chaos.scale(c, NAME, 3)
            # Two engines start beside the training on 2 cores; the bound is for a stall (the
            # seconds to the next step are bench.chaos's figures), and a stall says where.
            try:
                c.kubelet.wait(lambda: w.step() >= 4, 300, "step 4")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; {stall_report(c, w, inj.at)}") from exc
            print("steps after the preemption and scale-up (s):", timeline(w, inj.at))
            w.poll_history()
            kill_at = time.time()
            inj.detail += "; " + chaos.kill_trainer_rank(c, NAME, random.Random(17).randrange(2))
            in_sync_at = c.kubelet.wait(
                lambda: (
                    (s := chaos.sidecar_status(c, f"{NAME}-rollout-2"))
                    and s.get("inSync")
                    and time.time()
                ),
                300,
                "rollout-2 in sync",
            )
            wait_recovered(c, NAME, w, inj, {"trainer": 1, "rollout": 3}, timeout=300)
            assert inj.recovered, inj
            reads = []
            for _ in range(120):  # a read is consistent unless a sync lands during it
                reads.append(chaos.engines_on_latest(c, NAME))
                if reads[-1][0]:
                    break
                time.sleep(0.5)
            assert reads[-1][0], reads[-5:]
            # The control plane itself goes away and comes back: the API server (every watch
            # and client drops), then etcd under it. Training goes on; nothing is redone.
            before_restarts = w.step()
            chaos.restart_control_plane(c, "kube-apiserver")
            chaos.restart_control_plane(c, "etcd")
            c.kubelet.wait(lambda: w.step() >= before_restarts + 2, 300, "steps after restarts")
            print(
                f"restarts began at step {before_restarts}; steps (s from the apply):",
                timeline(w, applied),
            )
            final = wait_phase(c, NAME, ("Succeeded", "Failed"), 600)
        assert final["status"]["phase"] == "Succeeded", final["status"]
        assert final["status"]["restarts"] == 1  # the rank kill; the rollout faults cost none
        # Steps done twice: only those after the last checkpoint before the rank kill, redone
        # after it; the rollout faults made the trainer redo none.
        redone = {s: sorted(t) for s, t in w.records.items() if len(t) > 1}
        assert len(redone) <= INTERVAL and all(t[1] > kill_at for t in redone.values()), redone
        assert final["status"]["rolloutPreemptions"] == 1
        assert not chaos.checkpoints_bad(c, NAME)
        assert not [d for d in w.duplicates if "watcher error" not in d], w.duplicates
        served, in_sync_step = engine_served_steps(w, "rollout-2"), step_in_progress(w, in_sync_at)
        assert served and in_sync_step and served[0] <= in_sync_step + 1, (served, in_sync_step)
        assert list(w.records) and max(w.records) == STEPS
