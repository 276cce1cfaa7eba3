"""The operator outlives its own CRD: deleting the CRD (an uninstall, a botched upgrade) must not
end the process, and once the CRD is back the operator serves new jobs without a restart.
On a control plane of its own: deleting the CRD deletes every job in the cluster."""

from __future__ import annotations

import time
from pathlib import Path

from harness.cluster.controlplane import control_plane
from tests.conftest import CRD_PATH
from tests.integration.test_operator_harness import cluster, quickstart, wait_for


def test_the_operator_survives_its_crd_deleted_and_recreated(tmp_path: Path) -> None:
    with (
        control_plane(tmp_path / "cp", scheduler=False) as cp,
        cluster(cp, tmp_path / "op", namespace="crd-loss", webhook=False) as c,
    ):
        c.create(quickstart("before"))
        c.wait_pods("before", {"before-trainer-0", "before-rollout-0", "before-rollout-1"})

        cp.kubectl_ok("delete", "crd", "lorarljobs.lorarl.dev", "--wait=true")
        time.sleep(5.0)  # kopf's watch sees 404s and the CRD's removal meanwhile
        assert c.operator.proc is not None and c.operator.proc.poll() is None, c.operator.logs()
        cp.apply_crds(CRD_PATH)
        c.create(quickstart("after"))
        c.wait_pods("after", {"after-trainer-0", "after-rollout-0", "after-rollout-1"}, timeout=60)
        c.run_all("after")
        c.wait_phase("after", "Running", timeout=30)
        assert c.operator.proc.poll() is None
        # The first job went with its CRD. Its pods go too, but the garbage collector may wait
        # for the CRD to be served again before it can tell their owner is gone.
        wait_for(lambda: c.pods("before") == {}, 90, "pods of the deleted job collected")
