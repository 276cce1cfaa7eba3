"""The cluster tests on each Kubernetes release we build: the pinned (oldest served) one that
`make test` uses and the newest one the module proxy serves (`make test-cluster-newest`), one
after the other in one run. What the chart's `kubeVersion` may claim comes from here.

    LORARL_CONTROLPLANE_BIN=<newest bin dir> python -m bench.controlplane_versions

Records per release: the API server's own /version, the pytest outcome counts and the wall time
of the selection below (tests/cluster and the operator's integration tests).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, write_results

RESULTS = ROOT / "bench" / "results" / "controlplane_versions.json"
SELECTION = [
    "tests/cluster",
    "tests/integration/test_operator_harness.py",
    "tests/integration/test_operator_lifecycle.py",
    "tests/integration/test_operator_failures.py",
    "tests/integration/test_operator_webhook.py",
]


def server_version(bin_dir: Path) -> str:
    out = subprocess.run(
        [str(bin_dir / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip().split()[-1]


def run_suite(bin_dir: Path) -> dict[str, Any]:
    env = {**os.environ, "LORARL_CONTROLPLANE_BIN": str(bin_dir)}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {
        k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", summary)
    }
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return {
        "kube_apiserver_version": server_version(bin_dir),
        "exit_code": done.returncode,
        "counts": counts,
        "failures": failures[:20],
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    from harness.cluster.controlplane import GO_MOD, pinned_version

    pinned = ROOT / ".cache" / "controlplane" / pinned_version()
    newest_mod = ROOT / "tests" / "cluster" / "controlplane-newest"
    if "LORARL_CONTROLPLANE_BIN" in os.environ:
        newest = Path(os.environ["LORARL_CONTROLPLANE_BIN"])
    else:  # build (or find) it, as `make test-cluster-newest` does
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build_controlplane.sh"),
             str(ROOT / ".cache" / "controlplane"), str(newest_mod)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        newest = Path(out.stdout.strip().splitlines()[-1])
    runs = []
    for label, bin_dir in (("pinned (make test)", pinned), ("newest served", newest)):
        result = {"release": label, **run_suite(bin_dir)}
        print(json.dumps(result), flush=True)
        runs.append(result)
    report = {
        "benchmark": "controlplane_versions",
        "selection": SELECTION,
        "pinned_go_mod": str(GO_MOD.relative_to(ROOT)),
        "runs": runs,
        "machine": machine(),
    }
    write_results(RESULTS, report)
    if any(r["exit_code"] != 0 for r in runs):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
