"""Install the Helm chart into the API server emulator and run the operator as its Deployment
says (shared by tests/integration/test_chart_install.py and the cluster end-to-end tests).

The chart's render is applied to the emulator with the real kubectl, and the operator is started
exactly as its Deployment says (command, args, env), with only what a pod gets from the kubelet
swapped for local stand-ins:

- the service account's credentials -> `KUBECONFIG` with a token of its own (so every request
  the operator makes can be checked against the chart's RBAC), and the service account's
  namespace file -> `LORARL_OPERATOR_NAMESPACE`;
- the webhook Secret volume -> its items written to a local folder, `LORARL_WEBHOOK_CERT_DIR`;
- ports: the chart's webhook/metrics/health ports (9443/8080/8081) -> free local ports;
- the API server calling the webhook -> an emulator admission hook built from the applied
  ValidatingWebhookConfiguration (its rules, path and caBundle, TLS verified for the Service's
  DNS name);
- cluster DNS (optional, `hosts_file`): the operator runs in a mount namespace of its own that
  sees that hosts file at /etc/hosts, so the pod DNS names it polls resolve (the process
  kubelet keeps the file current).

Not applied: the `helm test` hook objects (`helm install` does not create them) and kinds the
emulator does not serve (with default values there are none; cert-manager's Certificate/Issuer
and the ServiceMonitor appear only when switched on).
"""

from __future__ import annotations

import base64
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from lorarl.local.ports import free_port
from lorarl.operator.config import DEFAULT_CERT_DIR
from tests.support.kube_emulator import KubeApi, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
CHART_CRDS = ROOT / "charts" / "lorarl" / "crds"
OPERATOR_TOKEN = "lorarl-operator-service-account-token"
# What the kubelet would set up in the pod; replaced by the local stand-ins listed above.
PORT_ENV = ("LORARL_WEBHOOK_PORT", "LORARL_METRICS_PORT", "LORARL_HEALTH_PORT")
Obj = dict[str, Any]


def wait_for(condition: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)


def with_hosts_file(argv: list[str], hosts_file: Path) -> list[str]:
    """Run `argv` in a private mount namespace that sees `hosts_file` at /etc/hosts: the
    cluster's DNS for a process on the host (nothing outside that process changes)."""
    bind = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", bind,
            str(hosts_file), *argv]  # fmt: skip


# -- the rendered release ----------------------------------------------------------------------


def find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''} in the chart, got {len(matches)}"
    return matches[0]


def installable(objs: list[Obj], kube: KubeApi) -> tuple[list[Obj], list[str]]:
    """What `helm install` creates and the emulator serves; and what was left out, by name."""
    served = {(i.group, i.version, i.kind) for i in kube.emulator.served()}
    keep, skipped = [], []
    for obj in objs:
        group, _, version = obj["apiVersion"].rpartition("/")
        hook = obj["metadata"].get("annotations", {}).get("helm.sh/hook")
        if hook or (group, version, obj["kind"]) not in served:
            skipped.append(f"{obj['kind']}/{obj['metadata']['name']}")
        else:
            keep.append(obj)
    return keep, skipped


def operator_container(deployment: Obj) -> Obj:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def container_env(container: Obj) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        assert "value" in var, f"env {var['name']}: only literal values are emulated here"
        env[var["name"]] = var["value"]
    return env


def mount_secret_volumes(
    get_secret: Callable[[str, str], Obj | None], deployment: Obj, container: Obj, root: Path
) -> dict[str, Path]:
    """Play the kubelet: write each Secret volume's items (read by `get_secret(namespace,
    name)`) to a folder; returns {mountPath: folder}."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"].get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        source = volumes[mount["name"]].get("secret")
        if source is None:
            continue
        ns = deployment["metadata"]["namespace"]
        secret = get_secret(ns, source["secretName"])
        assert secret is not None, f"volume {mount['name']}: Secret {source['secretName']} missing"
        folder = root / mount["name"]
        folder.mkdir(parents=True)
        for item in source.get("items") or [{"key": k, "path": k} for k in secret["data"]]:
            (folder / item["path"]).write_bytes(base64.b64decode(secret["data"][item["key"]]))
        mounts[mount["mountPath"]] = folder
    return mounts


# -- the webhook, called the way the API server calls it ---------------------------------------


def webhook_hook(webhook: Obj, port: int) -> Any:
    """POST reviews to the operator's local port, trusting only the caBundle and checking the
    certificate's name against the Service DNS name the API server would use."""
    service = webhook["clientConfig"]["service"]
    ca = base64.b64decode(webhook["clientConfig"]["caBundle"]).decode()
    context = ssl.create_default_context(cadata=ca)
    url = f"https://127.0.0.1:{port}{service['path']}"
    sni = f"{service['name']}.{service['namespace']}.svc"

    def call(review: Obj) -> Obj:
        with httpx.Client(verify=context, timeout=10) as client:
            reply = client.post(url, json=review, extensions={"sni_hostname": sni})
        reply.raise_for_status()
        return reply.json()

    return call


def register_webhooks(
    kube: KubeApi, vwc: Obj, objs: list[Obj], deployment: Obj, env: dict[str, str]
) -> None:
    """Play the API server: each webhook's rules become an emulator admission hook that calls
    the operator through the Service the webhook names."""
    for webhook in vwc["webhooks"]:
        ref = webhook["clientConfig"]["service"]
        port = service_port(objs, deployment, env, ref["name"], ref.get("port", 443))
        for rule in webhook["rules"]:
            for group in rule["apiGroups"]:
                for version in rule["apiVersions"]:
                    for resource in rule["resources"]:
                        plural, _, sub = resource.partition("/")
                        kube.emulator.add_admission_hook(
                            webhook_hook(webhook, port),
                            name=webhook["name"],
                            resource=f"{group}/{version}/{plural}",
                            operations=rule["operations"],
                            subresources=(sub or None,),
                        )


# -- the install -------------------------------------------------------------------------------


@dataclass
class Release:
    kube: KubeApi
    objs: list[Obj]
    skipped: list[str]
    manifest: Path
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str]
    env: dict[str, str]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise AssertionError(f"operator ignored SIGTERM for 30s:\n{self.logs()}") from None
        return self.proc.returncode


def kubectl_ok(kube: KubeApi, *args: str) -> str:
    done = kube.kubectl(*args)
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def operator_command(kube: KubeApi, deployment: Obj, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """The container's command + args and env, plus the local stand-ins (module docstring)."""
    container = operator_container(deployment)
    chart_env = container_env(container)
    ports = {name: free_port() if int(chart_env[name]) else 0 for name in PORT_ENV}
    mounts = mount_secret_volumes(
        lambda ns, name: kube.emulator.get("v1/secrets", ns, name),
        deployment,
        container,
        tmp / "volumes",
    )
    ns = deployment["metadata"]["namespace"]
    account_kubeconfig = write_kubeconfig(tmp / "sa-kubeconfig", kube.url, OPERATOR_TOKEN, ns)
    ambient = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    local = {
        "KUBECONFIG": str(account_kubeconfig),
        "LORARL_OPERATOR_NAMESPACE": ns,
        "HOME": str(tmp),
        # `python` in the image is the interpreter with lorarl installed: here, this venv's.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        **{name: str(port) for name, port in ports.items()},
    }
    if DEFAULT_CERT_DIR in mounts:
        local["LORARL_WEBHOOK_CERT_DIR"] = str(mounts[DEFAULT_CERT_DIR])
    argv = [*container["command"], *container.get("args", [])]
    return argv, {**ambient, **chart_env, **local}


def local_port(container: Obj, env: dict[str, str], port: int | str) -> int:
    """Where a container port (by name or number, as probes and Services name it) listens
    locally: the chart's port number -> the env variable holding it -> its local override."""
    if isinstance(port, str):
        (named,) = [p for p in container["ports"] if p["name"] == port]
        port = named["containerPort"]
    chart_env = container_env(container)
    (name,) = [n for n in PORT_ENV if chart_env[n] == str(port)]
    return int(env[name])


def service_port(
    objs: list[Obj], deployment: Obj, env: dict[str, str], name: str, port: int
) -> int:
    """Follow a Service port to the operator's local port, checking it selects the pod."""
    service = find(objs, "Service", name)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), f"{name} misses the pod"
    (entry,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    return local_port(operator_container(deployment), env, entry["targetPort"])


@contextmanager
def install(
    kube: KubeApi,
    objs: list[Obj],
    tmp: Path,
    namespace: str,
    *,
    hosts_file: Path | None = None,
) -> Iterator[Release]:
    """`helm install --create-namespace` of the rendered `objs`, then the operator, ready."""
    # `kubectl create namespace` speaks protobuf, which the emulator does not; apply sends JSON.
    ns_obj = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    created = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(ns_obj))
    assert created.returncode == 0, created.stderr
    kubectl_ok(kube, "apply", "-f", str(CHART_CRDS))  # helm installs crds/ first
    apply, skipped = installable(objs, kube)
    manifest = tmp / "release.yaml"
    manifest.write_text(yaml.safe_dump_all(apply))
    kubectl_ok(kube, "apply", "-f", str(manifest))

    deployment = find(objs, "Deployment", "lorarl-operator")
    argv, env = operator_command(kube, deployment, tmp)
    for vwc in kube.emulator.list_objects(
        "admissionregistration.k8s.io/v1/validatingwebhookconfigurations", None
    ):
        register_webhooks(kube, vwc, objs, deployment, env)
    log = tmp / "operator.log"
    run_argv = argv if hosts_file is None else with_hosts_file(argv, hosts_file)
    run_argv = ["setpriv", "--pdeathsig", "TERM", "--", *run_argv]  # never outlives the test
    with log.open("wb") as out:
        proc = subprocess.Popen(run_argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp)
    rel = Release(kube, objs, skipped, manifest, proc, log, argv, env)
    probe = operator_container(deployment)["readinessProbe"]["httpGet"]
    port = local_port(operator_container(deployment), env, probe["port"])
    try:
        wait_for(lambda: _ready(rel, probe["path"], port), 60, "operator readiness probe")
        yield rel
    except BaseException:
        print(rel.logs())
        raise
    finally:
        rel.stop()


def _ready(rel: Release, path: str, port: int) -> bool:
    if rel.proc.poll() is not None:
        raise AssertionError(f"operator exited {rel.proc.returncode}:\n{rel.logs()}")
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
