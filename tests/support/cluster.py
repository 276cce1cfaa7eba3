"""A whole cluster on one machine for end-to-end tests and benchmarks: the API server emulator,
the Helm chart installed with kubectl, the operator and the status API run as the chart's
Deployments say, and the process kubelet running every Pod the operator creates.

Stand-ins, each where a cluster has something this machine cannot run (see chart_release.py for
the operator's): the status API reaches the API server through `kube_front` (TLS, tokens, RBAC)
with its service account's files at the usual path in a mount namespace of its own, and both the
operator and the status API see the kubelet's cluster DNS as /etc/hosts. They run on the host,
which the kubelet's policy evaluation treats as the operator's pod.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from lorarl.local.ports import free_port
from tests.support.chart_release import (
    Release,
    container_env,
    find,
    install,
    kubectl_ok,
    wait_for,
)
from tests.support.kube_emulator import KubeApi, kube_api
from tests.support.kube_front import ApiFront, User, api_front, service_account
from tests.support.kubelet import Kubelet
from tests.unit.test_helm_chart import NS, render_chart

Obj = dict[str, Any]
LRJ = "lorarl.dev/v1alpha1/lorarljobs"
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
STATUS_API_TOKEN = "lorarl-status-api-service-account-token"
READER_TOKEN, OUTSIDER_TOKEN = "job-reader-token", "outsider-token"
# A person allowed to read jobs in `default` by a Role, and one who is not.
READERS = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: job-reader, namespace: default}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: outsider, namespace: default}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: lorarljob-reader, namespace: default}
rules:
  - apiGroups: [lorarl.dev]
    resources: [lorarljobs]
    verbs: [get, list]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: lorarljob-reader, namespace: default}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: lorarljob-reader}
subjects:
  - {kind: ServiceAccount, name: job-reader, namespace: default}
"""


@dataclass
class Cluster:
    kube: KubeApi
    kubelet: Kubelet
    release: Release
    front: ApiFront
    status_url: str
    status_log: Path

    def kubectl(self, *args: str) -> str:
        return kubectl_ok(self.kube, *args)

    def apply(self, manifest: str) -> str:
        """`kubectl apply -f -`."""
        return _apply_ok(self.kube, manifest)

    def job(self, name: str, namespace: str = "default") -> Obj | None:
        return self.kube.emulator.get(LRJ, namespace, name)

    def metrics(self, name: str, token: str, namespace: str = "default") -> httpx.Response:
        url = f"{self.status_url}/v1/jobs/{namespace}/{name}/metrics"
        return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=10)


def _apply_ok(kube: KubeApi, manifest: str) -> str:
    done = kube.kubectl("apply", "-f", "-", input=manifest)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _status_api_argv(argv: list[str], sa_dir: Path, hosts_file: Path) -> list[str]:
    """The container's command in a mount namespace with its service account's files at the
    in-cluster path (a private /run: the host's is not touched) and the cluster DNS."""
    script = (
        'mount -t tmpfs lorarl-sa /run && mkdir -p "$2" && mount --bind "$0" "$2" && '
        'mount --bind "$1" /etc/hosts && shift 3 && exec "$@"'
    )
    target = SA_DIR.replace("/var/run", "/run")  # /var/run is a link to /run
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script,
            str(sa_dir), str(hosts_file), target, "_", *argv]  # fmt: skip


@contextmanager
def status_api(rel: Release, front: ApiFront, hosts_file: Path, tmp: Path) -> Iterator[str]:
    """`python -m lorarl.server` as the chart's status-api Deployment runs it; yields its URL."""
    deployment = find(rel.objs, "Deployment", "lorarl-status-api")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    front.users[STATUS_API_TOKEN] = service_account(NS, account)
    sa_dir = tmp / "status-api-sa"
    sa_dir.mkdir()
    (sa_dir / "token").write_text(STATUS_API_TOKEN)
    shutil.copy(front.ca_file, sa_dir / "ca.crt")
    (sa_dir / "namespace").write_text(NS)
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")},
        **container_env(container),
        "LORARL_SERVER_PORT": str(port),  # the chart's port -> a free local one
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(front.port),
        "HOME": str(tmp),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    argv = _status_api_argv(list(container["command"]), sa_dir, hosts_file)
    argv = ["setpriv", "--pdeathsig", "TERM", "--", *argv]  # never outlives the test
    log = tmp / "status-api.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(proc, url, log), 60, "status API /healthz")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"status API exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def cluster(tmp: Path) -> Iterator[Cluster]:
    """Everything up (emulator, kubelet, chart, operator, status API), torn down in reverse."""
    objs = render_chart(namespace=NS)
    operator = find(objs, "Deployment", "lorarl-operator")["spec"]["template"]["metadata"]
    with ExitStack() as stack:
        kube = stack.enter_context(kube_api(namespaces=("default",)))
        kubelet = stack.enter_context(
            Kubelet(kube.url, kube.token, host_namespace=NS, host_labels=operator["labels"])
        )
        rel = stack.enter_context(install(kube, objs, tmp, NS, hosts_file=kubelet.hosts_file))
        _apply_ok(kube, READERS)
        users = {
            READER_TOKEN: service_account("default", "job-reader"),
            OUTSIDER_TOKEN: service_account("default", "outsider"),
        }
        front = stack.enter_context(api_front(kube.url, users))
        url = stack.enter_context(status_api(rel, front, kubelet.hosts_file, tmp))
        yield Cluster(kube, kubelet, rel, front, url, tmp / "status-api.log")


def wait_phase(c: Cluster, name: str, phases: tuple[str, ...], timeout: float) -> Obj:
    """The job once its phase is one of `phases` (kubelet failures surface at once)."""
    deadline = time.monotonic() + timeout
    while True:
        c.kubelet.raise_errors()
        job = c.job(name)
        if job and (job.get("status") or {}).get("phase") in phases:
            return job
        if time.monotonic() > deadline:
            raise AssertionError(f"job {name} not {phases} within {timeout:.0f} s: {job}")
        time.sleep(1)


__all__ = ["Cluster", "User", "cluster", "wait_phase"]
