"""The process kubelet (harness/kubelet/) does what a kubelet does, or the cluster tests
built on it would prove nothing: a Node the scheduler binds pods to, a read-only root, volumes
(claims bound by the provisioner, projected ServiceAccount tokens), env and secret references,
pod DNS names, Services, NetworkPolicy enforcement, init containers, status and exit codes,
graceful deletion, the Node authorizer's limits, cleanup.

The cluster is the real one (harness/cluster/controlplane.py): API server, controller-manager and
scheduler. Each test uses its own namespace, so policies and names never cross tests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.cluster.controlplane import ControlPlane, control_plane
from harness.cluster.kube_client import KubeClient
from harness.kubelet import Kubelet, NamespacesUnavailable, leftovers
from harness.kubelet import network as kubelet_network

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "ghcr.io/lorarl/trainer:0.1.0"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("cp")) as cp:
        yield cp


@pytest.fixture(scope="module")
def cluster(control: ControlPlane) -> Iterator[tuple[KubeClient, Kubelet]]:
    kube = KubeClient(control)
    with Kubelet(control, max_grace=2.0) as kubelet:
        yield kube, kubelet
        kubelet.raise_errors()
    kube.close()


@pytest.fixture
def ns(cluster: tuple[KubeClient, Kubelet], request: pytest.FixtureRequest) -> str:
    kube, _ = cluster
    name = request.node.name.replace("_", "-")[:40].strip("-").lower()
    kube.cp.create_namespace(name)
    return name


def claim(ns: str, name: str) -> Obj:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": "1Gi"}}}}  # fmt: skip


def pod(
    ns: str,
    name: str,
    script: str,
    *,
    labels: dict[str, str] | None = None,
    mounts: list[Obj] = (),
    volumes: list[Obj] = (),
    env: list[Obj] = (),
    image: str = TRAINER,
    **spec: Any,
) -> Obj:
    """A pod shaped like the operator's: non-root, read-only root, all capabilities dropped,
    an emptyDir at /tmp."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {"app": name}},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 10001,
                "runAsGroup": 10001,
                "fsGroup": 10001,
            },
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "command": ["python", "-c", script],
                    "env": list(env),
                    "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
                    "securityContext": {
                        "readOnlyRootFilesystem": True,
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
            **spec,
        },
    }


def create(kube: KubeClient, obj: Obj) -> Obj:
    plural = {"Pod": "v1/pods", "Service": "v1/services", "Secret": "v1/secrets",
              "ConfigMap": "v1/configmaps", "PersistentVolumeClaim": "v1/persistentvolumeclaims",
              "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
              "ServiceAccount": "v1/serviceaccounts",
              "Role": "rbac.authorization.k8s.io/v1/roles",
              "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings"}[obj["kind"]]  # fmt: skip
    return kube.create(plural, obj)


def finished(kube: KubeClient, kubelet: Kubelet, ns: str, name: str, timeout: float = 60) -> Obj:
    def done() -> Obj | None:
        p = kube.get("v1/pods", ns, name)
        return p if p and p.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    return kubelet.wait(done, timeout, f"pod {ns}/{name} finished")


def terminated(p: Obj, container: str = "main") -> Obj:
    (cs,) = [c for c in p["status"]["containerStatuses"] if c["name"] == container]
    return cs["state"]["terminated"]


def running(kube: KubeClient, kubelet: Kubelet, ns: str, name: str) -> Obj:
    def up() -> Obj | None:
        p = kube.get("v1/pods", ns, name)
        return p if p and p.get("status", {}).get("phase") == "Running" else None

    return kubelet.wait(up, 60, f"pod {ns}/{name} running")


def out(kubelet: Kubelet, ns: str, name: str, container: str = "main") -> dict:
    """The JSON line a test pod printed last."""
    lines = kubelet.logs(ns, name, container).strip().splitlines()
    assert lines, f"{name} printed nothing"
    return json.loads(lines[-1])


# -- filesystem --------------------------------------------------------------------------------

FS_PROBE = """
import json, os
def attempt(path):
    try:
        with open(path, "w") as f:
            f.write("x")
        return "ok"
    except OSError as e:
        return e.strerror
print(json.dumps({
    "root": attempt("/probe"), "usr": attempt("/usr/probe"), "tmp": attempt("/tmp/probe"),
    "data": attempt("/data/probe"), "out": attempt("/out/result"),
    "shm": attempt("/dev/shm/probe"), "config": open("/etc/cfg/greeting").read(),
    "model": open("/data/weights.txt").read(), "uid": os.getuid(), "groups": os.getgroups(),
}))
"""


def test_read_only_root_with_writable_volumes(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    for name in ("data", "out"):
        create(kube, claim(ns, name))
    (kubelet.claim_dir(ns, "data") / "weights.txt").write_text("w")
    create(kube, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg",
           "namespace": ns}, "data": {"greeting": "hello"}})  # fmt: skip
    create(kube, pod(ns, "fs", FS_PROBE,
        mounts=[{"name": "data", "mountPath": "/data", "readOnly": True},
                {"name": "out", "mountPath": "/out"}, {"name": "cfg", "mountPath": "/etc/cfg"}],
        volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
                 {"name": "out", "persistentVolumeClaim": {"claimName": "out"}},
                 {"name": "cfg", "configMap": {"name": "cfg"}}]))  # fmt: skip
    p = finished(kube, kubelet, ns, "fs")
    assert terminated(p)["exitCode"] == 0, kubelet.logs(ns, "fs", "main")
    seen = out(kubelet, ns, "fs")
    assert seen["root"] == seen["usr"] == "Read-only file system"
    assert seen["data"] == "Read-only file system"  # a claim mounted readOnly
    assert seen["tmp"] == seen["out"] == seen["shm"] == "ok"
    assert seen["config"] == "hello" and seen["model"] == "w"
    assert seen["uid"] == 10001 and 10001 in seen["groups"]  # runAsUser, fsGroup
    result = kubelet.claim_dir(ns, "out") / "result"
    assert result.read_text() == "x" and result.stat().st_uid == 10001
    assert not Path("/probe").exists()  # the host's root was never written


def test_a_checkout_under_tmp_stays_visible(
    cluster: tuple[KubeClient, Kubelet], ns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The venvs standing in for images live in the checkout, and a clone may sit under /tmp
    (which the root view leaves out and the pod's /tmp emptyDir covers): it is bound read-only
    at its own path, or no pod of such a clone could start its interpreter."""
    kube, kubelet = cluster
    checkout = tmp_path / "clone"
    checkout.mkdir()
    checkout.chmod(0o755)
    tmp_path.chmod(0o755)
    (checkout / "marker").write_text("here")
    (checkout / "marker").chmod(0o644)
    from harness.kubelet import containers

    monkeypatch.setattr(containers, "HOST_PATHS", [*containers.HOST_PATHS, checkout])
    script = f"""
import json
def attempt(f):
    try:
        return f()
    except OSError as e:
        return e.strerror
print(json.dumps({{"read": attempt(lambda: open("{checkout}/marker").read()),
                   "write": attempt(lambda: open("{checkout}/new", "w").write("x")),
                   "tmp": attempt(lambda: open("/tmp/scratch", "w").write("x"))}}))
"""
    create(kube, pod(ns, "clone", script))
    p = finished(kube, kubelet, ns, "clone")
    assert terminated(p)["exitCode"] == 0, kubelet.logs(ns, "clone", "main")
    seen = out(kubelet, ns, "clone")
    assert seen == {"read": "here", "write": "Read-only file system", "tmp": 1}
    assert not (checkout / "new").exists()


def test_missing_claim_keeps_the_pod_pending_until_it_exists(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    create(
        kube,
        pod(
            ns,
            "nopvc",
            "print(1)",
            mounts=[{"name": "d", "mountPath": "/d"}],
            volumes=[{"name": "d", "persistentVolumeClaim": {"claimName": "nope"}}],
        ),
    )

    def scheduled_false() -> Obj | None:
        p = kube.get("v1/pods", ns, "nopvc")
        conds = (p.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "PodScheduled" and c["status"] == "False"),
                    None)  # fmt: skip

    cond = kubelet.wait(scheduled_false, 30, "PodScheduled=False")
    assert 'persistentvolumeclaim "nope" not found' in cond["message"]
    assert kube.get("v1/pods", ns, "nopvc")["status"]["phase"] == "Pending"
    create(kube, claim(ns, "nope"))
    assert finished(kube, kubelet, ns, "nopvc")["status"]["phase"] == "Succeeded"


def test_what_the_harness_cannot_run_is_said(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    create(kube, pod(ns, "shared", "print(1)", shareProcessNamespace=True))

    def condition() -> Obj | None:
        p = kube.get("v1/pods", ns, "shared")
        conds = (p.get("status") or {}).get("conditions") or []
        return next((c for c in conds if c.get("reason") == "UnsupportedByHarness"), None)

    cond = kubelet.wait(condition, 30, "UnsupportedByHarness")
    assert "shareProcessNamespace" in cond["message"]


# -- env ---------------------------------------------------------------------------------------

ENV_PROBE = """
import json, os, sys
print(json.dumps({k: os.environ.get(k) for k in ("KEY", "URL", "LITERAL", "MODE", "POD", "HOME")}
                 | {"argv": sys.argv[1:]}))
"""


def test_env_expansion_and_key_references(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    create(kube, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": ns},
                  "stringData": {"api-key": "s3cret"}})  # fmt: skip
    create(kube, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c",
           "namespace": ns}, "data": {"mode": "fast"}})  # fmt: skip
    env = [
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "api-key"}}},
        {"name": "URL", "value": "http://x/?k=$(KEY)&m=$(MODE)"},  # MODE is not defined yet
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "mode"}}},
        {"name": "LITERAL", "value": "$$(KEY)"},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    spec = pod(ns, "env", ENV_PROBE, env=env)
    spec["spec"]["containers"][0]["args"] = ["--key=$(KEY)", "$(MODE)", "$(UNDEFINED)"]
    create(kube, spec)
    finished(kube, kubelet, ns, "env")
    seen = out(kubelet, ns, "env")
    assert seen["KEY"] == "s3cret" and seen["MODE"] == "fast" and seen["POD"] == "env"
    assert seen["URL"] == "http://x/?k=s3cret&m=$(MODE)"
    assert seen["LITERAL"] == "$(KEY)"
    assert seen["argv"] == ["--key=s3cret", "fast", "$(UNDEFINED)"]
    assert seen["HOME"] == "/tmp"  # the trainer image's ENV, underneath the container's


def test_missing_secret_is_a_config_error_until_it_exists(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    env = [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "k"}}}]
    create(kube, pod(ns, "nosecret", "print(1)", env=env))

    def waiting() -> Obj | None:
        p = kube.get("v1/pods", ns, "nosecret")
        statuses = (p.get("status") or {}).get("containerStatuses") or []
        return statuses and statuses[0]["state"].get("waiting")

    state = kubelet.wait(waiting, 30, "a waiting container")
    assert state == {"reason": "CreateContainerConfigError", "message": 'secret "absent" not found'}
    assert kube.get("v1/pods", ns, "nosecret")["status"]["phase"] == "Pending"
    create(kube, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "absent",
           "namespace": ns}, "stringData": {"k": "v"}})  # fmt: skip
    assert finished(kube, kubelet, ns, "nosecret")["status"]["phase"] == "Succeeded"


def test_image_the_repo_does_not_build_is_err_image_pull(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    create(kube, pod(ns, "noimage", "print(1)", image="ghcr.io/lorarl/nonesuch:0.1.0"))

    def waiting() -> Obj | None:
        p = kube.get("v1/pods", ns, "noimage")
        statuses = (p.get("status") or {}).get("containerStatuses") or []
        return statuses and statuses[0]["state"].get("waiting")

    state = kubelet.wait(waiting, 30, "a waiting container")
    assert state["reason"] == "ErrImagePull"
    assert "ghcr.io/lorarl/nonesuch:0.1.0" in state["message"]


# -- network -----------------------------------------------------------------------------------

SERVER = """
import socket
import subprocess
import sys
import time
s = socket.create_server(("0.0.0.0", 7000))
while True:
    c, _ = s.accept()
    c.sendall(socket.gethostname().encode())
    c.close()
"""

CLIENT = """
import json, socket, sys, time
target, deadline, seen = sys.argv[1], time.time() + float(sys.argv[2]), None
port = int(sys.argv[3]) if len(sys.argv) > 3 else 7000
while time.time() < deadline:
    try:
        with socket.create_connection((target, port), timeout=1) as c:
            seen = c.recv(100).decode()
            break
    except OSError as e:
        seen = f"error: {e}"
        time.sleep(0.2)
print(json.dumps({"reply": seen, "ip": socket.gethostbyname(target)}))
"""


def headless(ns: str, name: str, selector: dict[str, str]) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": "None", "selector": selector,
                     "ports": [{"name": "p", "port": 7000}]}}  # fmt: skip


def client(ns: str, name: str, target: str, wait_s: float, labels: dict[str, str]) -> Obj:
    spec = pod(ns, name, CLIENT, labels=labels)
    spec["spec"]["containers"][0]["args"] = [target, str(wait_s)]
    return spec


def server(ns: str, name: str, labels: dict[str, str]) -> Obj:
    return pod(ns, name, SERVER, labels=labels, hostname=name, subdomain="svc")


def host_connect(ip: str, timeout: float = 2.0, port: int = 7000) -> str:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as c:
            return c.recv(100).decode()
    except OSError as exc:
        return f"error: {exc}"


def test_pods_reach_each_other_by_dns_name(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    create(kube, headless(ns, "svc", {"role": "srv"}))
    create(kube, server(ns, "srv-0", {"role": "srv"}))
    srv = running(kube, kubelet, ns, "srv-0")
    for name, target in (("short", "srv-0.svc"), ("fqdn", f"srv-0.svc.{ns}.svc.cluster.local")):
        create(kube, client(ns, name, target, 20, {"role": "client"}))
    for name in ("short", "fqdn"):
        p = finished(kube, kubelet, ns, name)
        assert terminated(p)["exitCode"] == 0
        assert out(kubelet, ns, name) == {"reply": "srv-0", "ip": srv["status"]["podIP"]}
    assert srv["status"]["podIP"] != p["status"]["podIP"]  # each pod its own address


def test_a_service_reaches_its_ready_pods_from_pods_and_from_the_node(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    """A ClusterIP Service: the controller-manager's EndpointSlices from the pods' reported
    addresses, the kubelet's DNAT in each pod and on the node, its DNS name in the hosts file."""
    kube, kubelet = cluster
    svc = create(
        kube,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "echo", "namespace": ns},
            "spec": {
                "selector": {"role": "srv"},
                "ports": [{"name": "p", "port": 80, "targetPort": 7000}],
            },
        },
    )
    create(kube, server(ns, "srv-0", {"role": "srv"}))  # fmt: skip
    running(kube, kubelet, ns, "srv-0")
    ip = svc["spec"]["clusterIP"]
    assert ip.startswith("127.100.")
    kubelet.wait(lambda: host_connect(ip, port=80) == "srv-0", 30, "the Service from the node")
    spec = client(ns, "by-name", "echo", 20, {"role": "client"})
    spec["spec"]["containers"][0]["args"] += ["80"]
    create(kube, spec)
    p = finished(kube, kubelet, ns, "by-name")
    assert terminated(p)["exitCode"] == 0
    assert out(kubelet, ns, "by-name") == {"reply": "srv-0", "ip": ip}


API_PROBE = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
ns = open(f"{sa}/namespace").read()
tls = ssl.create_default_context(cafile=f"{sa}/ca.crt")
def get(path):
    req = urllib.request.Request(f"https://{host}:{port}{path}",
                                 headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
    try:
        return urllib.request.urlopen(req, context=tls, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code
print(json.dumps({"host": host, "ns": ns, "own": get(f"/api/v1/namespaces/{ns}/configmaps"),
                  "other": get("/api/v1/namespaces/kube-system/configmaps")}))
"""


def test_a_pod_calls_the_api_server_with_its_projected_token(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    """The `kube-api-access` volume the API server adds (a TokenRequest bound to the pod, the
    cluster CA, the namespace) and KUBERNETES_SERVICE_HOST: in-cluster config works, as the
    pod's ServiceAccount, which RBAC then judges."""
    kube, kubelet = cluster
    create(kube, {"apiVersion": "v1", "kind": "ServiceAccount",
                  "metadata": {"name": "reader", "namespace": ns}})  # fmt: skip
    create(
        kube,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "cm", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
        },
    )
    create(
        kube,
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "cm", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        },
    )
    host_had = Path("/run/secrets/kubernetes.io").exists()
    spec = pod(ns, "api", API_PROBE, serviceAccountName="reader")  # fmt: skip
    created = create(kube, spec)
    assert any(v["name"].startswith("kube-api-access") for v in created["spec"]["volumes"])
    p = finished(kube, kubelet, ns, "api")
    assert terminated(p)["exitCode"] == 0, kubelet.logs(ns, "api", "main")
    seen = out(kubelet, ns, "api")
    assert seen == {"host": "127.100.0.1", "ns": ns, "own": 200, "other": 403}
    # /var/run is a link to /run: the mount point was made inside the pod's root, not the host's
    assert Path("/run/secrets/kubernetes.io").exists() == host_had


def test_the_node_is_registered_ready_and_limited_by_the_node_authorizer(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    """Registered with its capacity, Ready, its Lease renewed; pods reach it through the
    scheduler; and its own credentials read only what its pods reference."""
    kube, kubelet = cluster
    node = kube.get("v1/nodes", None, kubelet.node)
    assert node is not None and node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"
    lease = kube.get("coordination.k8s.io/v1/leases", "kube-node-lease", kubelet.node)
    assert lease is not None and lease["spec"]["holderIdentity"] == kubelet.node
    create(kube, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "used",
           "namespace": ns}, "stringData": {"k": "v"}})  # fmt: skip
    create(kube, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unused",
           "namespace": ns}, "stringData": {"k": "v"}})  # fmt: skip
    env = [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "used", "key": "k"}}}]
    create(kube, pod(ns, "bound", "print(1)", env=env))
    p = finished(kube, kubelet, ns, "bound")
    assert p["spec"]["nodeName"] == kubelet.node  # bound by the scheduler, not by the kubelet
    assert kubelet.api.get(f"/api/v1/namespaces/{ns}/secrets/used")["metadata"]["name"] == "used"
    with pytest.raises(httpx.HTTPStatusError) as refused:
        kubelet.api.get(f"/api/v1/namespaces/{ns}/secrets/unused")
    assert refused.value.response.status_code == 403
    time.sleep(6)  # one heartbeat (node.RENEW_EVERY)
    renewed = kube.get("coordination.k8s.io/v1/leases", "kube-node-lease", kubelet.node)
    assert renewed["spec"]["renewTime"] != lease["spec"]["renewTime"]


POLICY_PORT = {"port": 7000, "protocol": "TCP"}


def policy(ns: str, ingress: list[Obj]) -> Obj:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "srv", "namespace": ns},
            "spec": {"podSelector": {"matchLabels": {"role": "srv"}}, "policyTypes": ["Ingress"],
                     "ingress": ingress}}  # fmt: skip


def test_network_policy_drops_what_it_does_not_allow(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    create(kube, headless(ns, "svc", {"role": "srv"}))
    friends = {
        "from": [{"podSelector": {"matchLabels": {"role": "friend"}}}],
        "ports": [POLICY_PORT],
    }
    create(kube, policy(ns, [friends]))
    create(kube, server(ns, "srv-0", {"role": "srv"}))
    ip = running(kube, kubelet, ns, "srv-0")["status"]["podIP"]
    create(kube, client(ns, "friend", "srv-0.svc", 20, {"role": "friend"}))
    create(kube, client(ns, "stranger", "srv-0.svc", 4, {"role": "stranger"}))
    finished(kube, kubelet, ns, "friend")
    assert out(kubelet, ns, "friend")["reply"] == "srv-0"
    finished(kube, kubelet, ns, "stranger")
    assert out(kubelet, ns, "stranger")["reply"].startswith("error: timed out")
    # Traffic from the node the pod runs on always passes (kubelet probes, the API server).
    assert host_connect(ip) == "srv-0"
    assert "policy drop" in kubelet.rules(ns, "srv-0")


# -- status ------------------------------------------------------------------------------------


def test_exit_codes_and_termination_messages(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    crash = pod(
        ns, "crash", "import sys; print('loading'); print('bad config: rank 0'); sys.exit(3)"
    )
    crash["spec"]["containers"][0]["terminationMessagePolicy"] = "FallbackToLogsOnError"
    create(kube, crash)
    told = pod(ns, "told", "open('/dev/termination-log','w').write('ran out of data'); exit(4)")
    create(kube, told)
    create(kube, pod(ns, "fine", "print('done')"))
    p = finished(kube, kubelet, ns, "crash")
    assert p["status"]["phase"] == "Failed"
    term = terminated(p)
    assert (term["exitCode"], term["reason"]) == (3, "Error")
    assert term["message"] == "loading\nbad config: rank 0\n"
    term = terminated(finished(kube, kubelet, ns, "told"))
    assert (term["exitCode"], term["message"]) == (4, "ran out of data")
    p = finished(kube, kubelet, ns, "fine")
    assert p["status"]["phase"] == "Succeeded"
    assert terminated(p)["reason"] == "Completed" and "message" not in terminated(p)


def test_on_failure_restarts_the_container(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    script = (
        "import os, sys; first = not os.path.exists('/tmp/seen'); open('/tmp/seen', 'w'); "
        "sys.exit(1 if first else 0)"
    )
    create(kube, pod(ns, "flaky", script, restartPolicy="OnFailure"))
    p = finished(kube, kubelet, ns, "flaky")
    (cs,) = p["status"]["containerStatuses"]
    assert p["status"]["phase"] == "Succeeded" and cs["restartCount"] == 1
    assert cs["lastState"]["terminated"]["exitCode"] == 1  # the emptyDir outlived the restart


# -- init containers ---------------------------------------------------------------------------

INITIALIZING = {"waiting": {"reason": "PodInitializing"}}  # a main container's, until init is done


def with_init(spec: Obj, *scripts: tuple[str, str], mounts: list[Obj] = ()) -> Obj:
    """`spec` with init containers (name, script) shaped like its main container."""
    main = spec["spec"]["containers"][0]
    spec["spec"]["initContainers"] = [
        dict(main, name=name, command=["python", "-c", script],
             volumeMounts=[*main["volumeMounts"], *mounts])
        for name, script in scripts
    ]  # fmt: skip
    return spec


def init_status(p: Obj, name: str) -> Obj:
    (cs,) = [c for c in p["status"]["initContainerStatuses"] if c["name"] == name]
    return cs


def condition(p: Obj, kind: str) -> Obj:
    return next(c for c in p["status"]["conditions"] if c["type"] == kind)


def test_init_containers_run_in_order_before_the_main_container(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    """The operator's model download: init containers one after the other on the pod's volumes,
    the second held at a gate the test opens, its termination message (the resolved commit) in
    initContainerStatuses; the main container starts only after both succeeded."""
    kube, kubelet = cluster
    create(kube, claim(ns, "gate"))
    first = "open('/tmp/order', 'w').write('first ')"
    second = (
        "import os, time\n"
        "assert open('/tmp/order').read() == 'first ', 'ran before the first'\n"
        "while not os.path.exists('/gate/open'): time.sleep(0.1)\n"
        "open('/tmp/order', 'a').write('second')\n"
        "open('/dev/termination-log', 'w').write('sha-0123abc')"
    )
    main = "import json; print(json.dumps({'order': open('/tmp/order').read()}))"
    spec = with_init(pod(ns, "inits", main), ("first", first), ("second", second),
                     mounts=[{"name": "gate", "mountPath": "/gate"}])  # fmt: skip
    spec["spec"]["volumes"].append({"name": "gate", "persistentVolumeClaim": {"claimName": "gate"}})
    create(kube, spec)

    def at_the_gate() -> Obj | None:
        p = kube.get("v1/pods", ns, "inits")
        statuses = (p.get("status") or {}).get("initContainerStatuses") or []
        return p if len(statuses) == 2 and "running" in statuses[1]["state"] else None

    p = kubelet.wait(at_the_gate, 60, "the second init container running")
    assert p["status"]["phase"] == "Pending"
    assert "terminated" in init_status(p, "first")["state"]
    initialized = condition(p, "Initialized")
    assert (initialized["status"], initialized["reason"]) == ("False", "ContainersNotInitialized")
    assert "second" in initialized["message"] and "first" not in initialized["message"]
    assert p["status"]["containerStatuses"][0]["state"] == INITIALIZING
    (kubelet.claim_dir(ns, "gate") / "open").write_text("")
    p = finished(kube, kubelet, ns, "inits")
    assert p["status"]["phase"] == "Succeeded", kubelet.logs(ns, "inits", "second")
    assert out(kubelet, ns, "inits") == {"order": "first second"}
    for name, message in (("first", None), ("second", "sha-0123abc")):
        cs = init_status(p, name)
        term = cs["state"]["terminated"]
        assert (term["exitCode"], term["reason"], term.get("message")) == (0, "Completed", message)
        assert cs["restartCount"] == 0 and cs["ready"]  # kubelet: ready once it succeeded
    assert condition(p, "Initialized")["status"] == "True"
    assert terminated(p)["exitCode"] == 0


def test_a_failed_init_container_fails_the_pod_under_never(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    fail = "open('/dev/termination-log', 'w').write('no such revision'); exit(3)"
    create(kube, with_init(pod(ns, "noinit", "open('/tmp/main-ran', 'w')"), ("fetch", fail)))
    p = finished(kube, kubelet, ns, "noinit")
    assert p["status"]["phase"] == "Failed"
    cs = init_status(p, "fetch")
    term = cs["state"]["terminated"]
    assert (term["exitCode"], term["reason"], term["message"]) == (3, "Error", "no such revision")
    assert cs["restartCount"] == 0 and not cs["ready"]
    assert condition(p, "Initialized")["status"] == "False"
    time.sleep(1.0)  # a few kubelet passes: the main container must still not start
    p = kube.get("v1/pods", ns, "noinit")
    assert p["status"]["containerStatuses"][0]["state"] == INITIALIZING
    assert not (kubelet.pod(ns, "noinit").volumes["tmp"].path / "main-ran").exists()


def test_on_failure_restarts_a_failed_init_container(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    flaky = (
        "import os, sys; first = not os.path.exists('/tmp/tried'); open('/tmp/tried', 'w'); "
        "sys.exit(1 if first else 0)"
    )
    spec = pod(ns, "retried", "print('main')", restartPolicy="OnFailure")
    create(kube, with_init(spec, ("fetch", flaky)))
    p = finished(kube, kubelet, ns, "retried")
    assert p["status"]["phase"] == "Succeeded"
    cs = init_status(p, "fetch")
    assert cs["restartCount"] == 1 and cs["state"]["terminated"]["exitCode"] == 0
    assert cs["lastState"]["terminated"]["exitCode"] == 1  # the emptyDir outlived the restart
    assert kubelet.logs(ns, "retried", "main").strip() == "main"


# -- deletion, garbage collection, cleanup -----------------------------------------------------

SLEEPER = "import subprocess, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"


def alive(pids: list[int]) -> list[int]:
    """Those still running (a zombie waiting for its reaper has already been killed)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def pids_of(netns: str) -> list[int]:
    return [int(p) for p in kubelet_network.run("ip", "netns", "pids", netns, check=False).split()]


def test_deleting_a_pod_kills_its_processes(cluster: tuple[KubeClient, Kubelet], ns: str) -> None:
    kube, kubelet = cluster
    create(kube, pod(ns, "sleeper", SLEEPER))
    running(kube, kubelet, ns, "sleeper")
    netns = kubelet.pod(ns, "sleeper").net.netns
    kubelet.wait(lambda: len(pids_of(netns)) >= 2, 20, "python and its child")
    pids = pids_of(netns)
    kube.delete("v1/pods", ns, "sleeper")
    kubelet.wait(lambda: kubelet.pod(ns, "sleeper").stopped.is_set(), 30, "pod stopped")
    kubelet.wait(lambda: not alive(pids), 10, f"processes {alive(pids)} gone")
    assert netns not in kubelet_network.run("ip", "netns", "list")
    kube.wait_gone("v1/pods", ns, "sleeper", 10)  # the kubelet's final DELETE


def test_deleting_a_pod_during_init_kills_the_init_container(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    create(kube, with_init(pod(ns, "slowinit", "print(1)"), ("fetch", SLEEPER)))

    def fetching() -> bool:
        p = kube.get("v1/pods", ns, "slowinit")
        statuses = (p.get("status") or {}).get("initContainerStatuses") or []
        return bool(statuses) and "running" in statuses[0]["state"]

    kubelet.wait(fetching, 60, "the init container running")
    netns = kubelet.pod(ns, "slowinit").net.netns
    kubelet.wait(lambda: len(pids_of(netns)) >= 2, 20, "python and its child")
    pids = pids_of(netns)
    kube.delete("v1/pods", ns, "slowinit")
    kubelet.wait(lambda: kubelet.pod(ns, "slowinit").stopped.is_set(), 30, "pod stopped")
    kubelet.wait(lambda: not alive(pids), 10, f"processes {alive(pids)} gone")
    kube.wait_gone("v1/pods", ns, "slowinit", 10)
    (main,) = kubelet.pod(ns, "slowinit").containers
    assert not main.started_once


GRACEFUL = """
import signal, sys, time
def bye(*_):
    time.sleep(0.5)
    open("/out/said-goodbye", "w").write("yes")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
open("/out/started", "w").write("yes")
time.sleep(600)
"""


def test_graceful_deletion_terminates_then_removes_the_pod(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    """The API server only marks a pod deleted; the kubelet sends SIGTERM, waits for the
    process (within the grace period), and only then removes the object for good."""
    kube, kubelet = cluster
    create(kube, claim(ns, "out"))
    create(kube, pod(ns, "polite", GRACEFUL, mounts=[{"name": "out", "mountPath": "/out"}],
                     volumes=[{"name": "out", "persistentVolumeClaim": {"claimName": "out"}}],
                     terminationGracePeriodSeconds=30))  # fmt: skip
    running(kube, kubelet, ns, "polite")
    out_dir = kubelet.claim_dir(ns, "out")
    kubelet.wait(lambda: (out_dir / "started").exists(), 20, "the pod started")
    kube.delete("v1/pods", ns, "polite")
    marked = kube.get("v1/pods", ns, "polite")
    assert marked is not None and marked["metadata"]["deletionTimestamp"]  # not gone yet
    kube.wait_gone("v1/pods", ns, "polite", 30)
    assert (out_dir / "said-goodbye").read_text() == "yes"  # it ran its SIGTERM handler
    stopped = [t for t, key, what in kubelet.events if key == f"{ns}/polite" and what == "stopped"]
    assert stopped, kubelet.events


def test_garbage_collection_follows_owner_references(
    cluster: tuple[KubeClient, Kubelet], ns: str
) -> None:
    kube, kubelet = cluster
    owner = create(kube, {"apiVersion": "v1", "kind": "ConfigMap",
                          "metadata": {"name": "owner", "namespace": ns}})  # fmt: skip
    child = pod(ns, "child", SLEEPER)
    child["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    ]
    create(kube, child)
    create(kube, pod(ns, "bystander", SLEEPER))
    running(kube, kubelet, ns, "child")
    kube.delete("v1/configmaps", ns, "owner")
    kubelet.wait(lambda: kube.get("v1/pods", ns, "child") is None, 20, "child collected")
    kubelet.wait(lambda: kubelet.pod(ns, "child").stopped.is_set(), 30, "child stopped")
    assert kube.get("v1/pods", ns, "bystander") is not None


def test_stopping_the_kubelet_leaves_nothing_behind(control: ControlPlane) -> None:
    kube = KubeClient(control)
    kubelet = Kubelet(control, node="second-node", max_grace=0.5).start()
    try:
        spec = pod("default", "a", SLEEPER)
        spec["spec"]["nodeName"] = "second-node"  # past the scheduler, onto this node
        create(kube, spec)
        running(kube, kubelet, "default", "a")
        netns = kubelet.pod("default", "a").net.netns
        pids = pids_of(netns)
        assert pids
    finally:
        left = kubelet.stop()
    assert left == [] and leftovers(kubelet.kid) == []
    assert kube.get("v1/nodes", None, "second-node") is None
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(pids) == []
    kube.delete("v1/pods", "default", "a", grace=0)
    kube.close()


def test_without_root_the_harness_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NamespacesUnavailable, match="needs root"):
        kubelet_network.require_namespaces()


KILLED_RUN = """
import json, sys, time
from pathlib import Path
from tests.integration.test_kubelet_harness import SLEEPER, create, pids_of, pod, running
from harness.cluster.controlplane import control_plane
from harness.cluster.kube_client import KubeClient
from harness.kubelet import Kubelet
with control_plane(Path(sys.argv[1])) as cp:
    kube = KubeClient(cp)
    kubelet = Kubelet(cp).start()
    create(kube, pod("default", "a", SLEEPER))
    running(kube, kubelet, "default", "a")
    netns = kubelet.pod("default", "a").net.netns
    kubelet.wait(lambda: len(pids_of(netns)) >= 2, 20, "python and its child")
    print(json.dumps({"kid": kubelet.kid, "pids": pids_of(netns)}), flush=True)
    time.sleep(600)
"""


def test_a_killed_test_run_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL gives a test no teardown: the pods die with it (parent-death signal), and the
    next kubelet's sweep removes the namespaces, links and state it left."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(tmp_path / "cp")], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        seen = json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 10
    while alive(seen["pids"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive(seen["pids"]) == []
    assert leftovers(seen["kid"]), "nothing left to sweep: the kill came too late to test this"
    kubelet_network.sweep_stale()
    assert leftovers(seen["kid"]) == []
