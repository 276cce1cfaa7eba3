"""The operator's own API client against a real HTTPS server: a private CA, client-certificate
auth and a bearer token, loaded the way a cluster hands them out (a kubeconfig outside a pod,
the service account's token and CA inside one). The server refuses a connection without the
client certificate and a request without the token, so each credential must really be sent."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import json
import ssl
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from lorarl.operator.kube import Kube, KubeError, load_credentials, path

TOKEN = "s3cret-token"
NAMED = "kubernetes.default.svc"  # the only name the `named` server certificate carries
CM = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "a", "namespace": "ns"}}


def _cert(
    name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, Any] | None, **kw: Any
) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    if kw.get("ip"):
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(kw["ip"]))]), False
        )
    if kw.get("dns"):
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(kw["dns"])]), False
        )
    if kw.get("usage"):
        builder = builder.add_extension(x509.ExtendedKeyUsage([kw["usage"]]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(tmp: Path, name: str, cert: x509.Certificate, key: Any = None) -> tuple[str, str]:
    crt = tmp / f"{name}.crt"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is None:
        return str(crt), ""
    pem = tmp / f"{name}.key"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(crt), str(pem)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA;
    plus a second CA that signed nothing this server uses."""
    tmp = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("test-ca", ca_key, None)
    issuer = (ca.subject, ca_key)
    srv_key, cli_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    srv = _cert("kube-api", srv_key, issuer, ip="127.0.0.1", usage=ExtendedKeyUsageOID.SERVER_AUTH)
    cli = _cert("operator", cli_key, issuer, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    other_key = ec.generate_private_key(ec.SECP256R1())
    out = {"ca": _write(tmp, "ca", ca)[0]}
    out["other_ca"] = _write(tmp, "other", _cert("o", other_key, None))[0]
    out["srv_crt"], out["srv_key"] = _write(tmp, "srv", srv, srv_key)
    out["cli_crt"], out["cli_key"] = _write(tmp, "cli", cli, cli_key)
    named = _cert("kube-api", srv_key, issuer, dns=NAMED, usage=ExtendedKeyUsageOID.SERVER_AUTH)
    out["named_crt"], out["named_key"] = _write(tmp, "named", named, srv_key)
    out["dir"] = str(tmp)
    return out


class Server:
    """HTTPS with a required client certificate; answers like an API server for one object."""

    def __init__(self, pki: dict[str, str], *, client_cert: bool, cert: str = "srv") -> None:
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(pki[f"{cert}_crt"], pki[f"{cert}_key"])
        if client_cert:
            self.ctx.load_verify_locations(pki["ca"])
            self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.objects: dict[str, dict[str, Any]] = {}
        self.seen: list[tuple[str, str, str | None, str | None]] = []  # method, path, auth, peer

    async def handle(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        subject = dict(x[0] for x in peer["subject"])["commonName"] if peer else None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        auth = f"{scheme.lower()} {token}"  # the scheme is case-insensitive (RFC 9110 11.1)
        self.seen.append((request.method, request.path, auth, subject))
        if auth != f"bearer {TOKEN}":
            return web.json_response({"reason": "Unauthorized", "message": "no token"}, status=401)
        key = request.path
        if request.method == "POST":
            body = await request.json()
            key += "/" + body["metadata"]["name"]
            if key in self.objects:
                return web.json_response({"reason": "AlreadyExists", "message": "x"}, status=409)
            self.objects[key] = body
            return web.json_response(body, status=201)
        if key not in self.objects:
            return web.json_response({"reason": "NotFound", "message": f"{key} gone"}, status=404)
        if request.method == "GET":
            return web.json_response(self.objects[key])
        if request.method == "PATCH":
            assert request.content_type == "application/merge-patch+json"
            self.objects[key] = {**self.objects[key], **(await request.json())}
            return web.json_response(self.objects[key])
        del self.objects[key]  # DELETE
        return web.json_response({"status": "Success"})

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ctx)
        await site.start()
        return f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def _use(monkeypatch: pytest.MonkeyPatch, kubeconfig: Path) -> None:
    """$KUBECONFIG as the operator's process would have it at start (the `kubernetes` package
    reads it once, at import)."""
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))


def _kubeconfig(
    tmp: Path, server: str, pki: dict[str, str], *, ca: str, token: str, **cluster: str
) -> Path:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": server, "certificate-authority": ca, **cluster}}
        ],
        "users": [
            {
                "name": "u",
                "user": {
                    "client-certificate": pki["cli_crt"],
                    "client-key": pki["cli_key"],
                    "token": token,
                },
            }
        ],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    out = tmp / f"kubeconfig-{len(list(tmp.iterdir()))}"
    out.write_text(yaml.safe_dump(doc))
    return out


async def _crud(kube: Kube) -> list[Any]:
    cm_url = path("v1", "configmaps", "ns", "a")
    try:
        return [
            await kube.create(CM),
            await kube.create(CM),  # 409: exists
            await kube.get(cm_url),
            await kube.merge_patch(cm_url, {"data": {"k": "v"}}, what="cm"),
            await kube.delete(cm_url, what="cm"),
            await kube.delete(cm_url, what="cm"),  # 404: gone
            await kube.get(cm_url),
        ]
    finally:
        await kube.close()


def test_kubeconfig_with_ca_client_cert_and_token(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def scenario() -> tuple[Server, list[Any], dict[str, str]]:
        server = Server(pki, client_cert=True)
        url = await server.start()
        _use(monkeypatch, _kubeconfig(tmp_path, url, pki, ca=pki["ca"], token=TOKEN))
        results = await _crud(Kube(load_credentials(), timeout=5))
        refusals: dict[str, str] = {}  # "status reason: message"
        cases = (("wrong token", pki["ca"], "nope"), ("other CA", pki["other_ca"], TOKEN))
        for what, ca, token in cases:
            _use(monkeypatch, _kubeconfig(tmp_path, url, pki, ca=ca, token=token))
            kube = Kube(load_credentials(), timeout=5)
            with pytest.raises(KubeError) as err:
                await kube.get(path("v1", "configmaps", "ns", "a"))
            await kube.close()
            refusals[what] = f"{err.value.status} {err.value.reason}: {err.value}"
        await server.runner.cleanup()
        return server, results, refusals

    server, results, refusals = asyncio.run(scenario())
    created, again, got, patched, deleted, gone, missing = results
    assert created == CM and again is None and got == CM
    assert patched["data"] == {"k": "v"}
    assert (deleted, gone, missing) == (True, False, None)
    assert refusals["wrong token"].startswith("401 ")  # the server's answer, not a crash
    assert refusals["other CA"].startswith("None Unreachable")
    assert "CERTIFICATE_VERIFY_FAILED" in refusals["other CA"]  # the CA file is what is trusted
    # Every request that got through carried the token and the client certificate.
    ok = [s for s in server.seen if s[2] == f"bearer {TOKEN}"]
    assert len(ok) == 7 and {s[3] for s in ok} == {"operator"}
    assert ok[0][:2] == ("POST", "/api/v1/namespaces/ns/configmaps")


def test_tls_server_name_is_what_the_certificate_is_checked_against(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubeconfig that reaches the API server by address and names it with `tls-server-name`
    (kubeadm, tunnels, private endpoints): the certificate names only that name."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def scenario() -> dict[str, str]:
        server = Server(pki, client_cert=True, cert="named")
        url = await server.start()
        out = {}
        for what, extra in (("named", {"tls-server-name": NAMED}), ("by address", {})):
            _use(monkeypatch, _kubeconfig(tmp_path, url, pki, ca=pki["ca"], token=TOKEN, **extra))
            kube = Kube(load_credentials(), timeout=5)
            try:
                out[what] = "created" if await kube.create(CM) == CM else "?"
            except KubeError as exc:
                out[what] = f"{exc.status} {exc.reason}: {exc}"
            finally:
                await kube.close()
        await server.runner.cleanup()
        return out

    out = asyncio.run(scenario())
    assert out["named"] == "created"
    assert out["by address"].startswith("None Unreachable")
    assert "CERTIFICATE_VERIFY_FAILED" in out["by address"]  # 127.0.0.1 is not in the cert


def test_a_missing_client_certificate_is_refused(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's TLS handshake demands the certificate: a client that dropped it gets no
    answer at all, only a KubeError the reconciler retries."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def scenario() -> str:
        server = Server(pki, client_cert=True)
        url = await server.start()
        _use(monkeypatch, _kubeconfig(tmp_path, url, pki, ca=pki["ca"], token=TOKEN))
        creds = load_credentials()
        assert creds.cert is not None
        kube = Kube(type(creds)(server=creds.server, verify=creds.verify, token=TOKEN), timeout=5)
        try:
            await kube.get(path("v1", "configmaps", "ns", "a"))
        except KubeError as exc:
            return f"{exc.status} {exc.reason}"
        finally:
            await kube.close()
            await server.runner.cleanup()
        return "answered"

    assert asyncio.run(scenario()) == "None Unreachable"


def test_in_cluster_service_account(
    pki: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pod: KUBERNETES_SERVICE_HOST/PORT, the mounted token and the cluster CA."""
    from kubernetes.config import incluster_config

    token_file, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    token_file.write_text(TOKEN)
    ca_file.write_text(Path(pki["ca"]).read_text())
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca_file))
    _use(monkeypatch, tmp_path / "absent")

    async def scenario() -> tuple[Server, list[Any]]:
        server = Server(pki, client_cert=False)
        url = await server.start()
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", url.rsplit(":", 1)[1])
        creds = load_credentials()
        assert creds.cert is None and creds.verify == str(ca_file)
        results = await _crud(Kube(creds, timeout=5))
        await server.runner.cleanup()
        return server, results

    server, results = asyncio.run(scenario())
    assert results[0] == CM and results[1] is None and results[4:] == [True, False, None]
    assert [s[2] for s in server.seen] == [f"bearer {TOKEN}"] * 7
    assert json.dumps(server.objects) == "{}"
