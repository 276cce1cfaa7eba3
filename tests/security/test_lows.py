"""The low findings of issue 34, each of which worked against the old code.

- The local status API (`lorarl run --local`) answered any `Host:` header, so a web page whose
  own name an attacker had pointed at 127.0.0.1 (DNS rebinding) could read its jobs and samples.
  Now a Host that is not localhost or a loopback address (with the server's port) gets 421, and
  no answer carries CORS headers. The in-cluster server, reached by its Service name, is not
  checked (it authenticates every call).
- An integer of more than 4,300 digits in a manifest made `lorarl validate` print a traceback
  (Python's `int()` limit, hit inside the YAML parser). Now one line naming the file and the key.
- A local SGLang engine got the engine API key on its command line, which any local user can
  read in /proc/<pid>/cmdline. Now the key reaches SGLang through the environment.
"""

from __future__ import annotations

import http.client
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from rich.console import Console

from lorarl.api.validation import load_job_file
from lorarl.cli.main import main
from lorarl.local import LocalRun, session
from lorarl.plan import LocalAddressing, plan
from lorarl.plan.engines import ENGINE_API_KEY_ENV, ENGINE_API_KEY_REF
from lorarl.server import LocalStore, create_app
from tests.unit.server.test_server_local import make_job

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

# --- the local status API: Host header and CORS -------------------------------------------------


@pytest.fixture(scope="module")
def local_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The status API exactly as `lorarl run --local` starts it (a real uvicorn on 127.0.0.1)."""
    run_dir = tmp_path_factory.mktemp("lows-run")
    run = SimpleNamespace(job=make_job("demo"), progress_url="http://127.0.0.1:9", run_dir=run_dir)
    out = io.StringIO()
    stop = session._start_status_api(run.job, run, 0, Console(file=out, width=500))
    assert stop is not None, out.getvalue()
    url = out.getvalue().split("status API and dashboard: ")[1].split()[0].rstrip("/")
    parts = urlsplit(url)
    yield parts.hostname, parts.port
    stop()


def ask(
    api: tuple[str, int], host: str | None, path: str = "/v1/jobs", method: str = "GET", **headers
) -> tuple[int, dict[str, str], bytes]:
    """One request with exactly this Host header (None: none at all), as a browser would send
    it after its own name was re-pointed at the loopback address."""
    conn = http.client.HTTPConnection(*api, timeout=10)
    try:
        conn.putrequest(method, path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in headers.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "host",
    [
        "attacker.example:{port}",
        "attacker.example",
        "127.0.0.1.nip.io:{port}",
        "localhost.attacker.example:{port}",
        "localhost:1",  # another port: another origin
        "0.0.0.0:{port}",
        "",
        None,
    ],
)
def test_local_status_api_refuses_a_host_that_is_not_loopback(local_api, host):
    _, port = local_api
    for path in ("/v1/jobs", "/v1/jobs/local/demo/samples", "/", "/metrics"):
        status, _, body = ask(local_api, None if host is None else host.format(port=port), path)
        assert status == 421, (host, path, status, body[:200])
        assert len(body) < 200 and b"loopback" in body


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST:{port}", "127.0.0.1", "[::1]:{port}"],
)
def test_local_status_api_answers_its_loopback_names(local_api, host):
    status, _, body = ask(local_api, host.format(port=local_api[1]))
    assert status == 200, body[:200]
    assert [j["name"] for j in json.loads(body)["items"]] == ["demo"]


def test_local_status_api_sends_no_cors_headers(local_api):
    host = f"127.0.0.1:{local_api[1]}"
    origin = {"Origin": "http://attacker.example"}
    for method, extra in (
        ("GET", {}),
        ("OPTIONS", {"Access-Control-Request-Method": "GET"}),  # a preflight
    ):
        _, headers, _ = ask(local_api, host, "/v1/jobs", method, **origin, **extra)
        assert not [h for h in headers if h.startswith("access-control-")], headers


def test_loopback_host_parsing():
    from lorarl.server.app import loopback_host

    for ok in ("localhost", "localhost:80", "127.0.0.1:80", "127.3.4.5", "[::1]", "[::1]:80"):
        assert loopback_host(ok, 80), ok
    for bad in (
        "localhost:81",
        "localhost:",
        "localhost:8x",
        "[::1]x",
        "[::1",
        "::1",
        "10.0.0.1:80",
        "[::ffff:10.0.0.1]:80",
        "localhost.:80",
        "evil.localhost:80",
        "",
        None,
    ):
        assert not loopback_host(bad, 80), bad


def test_the_in_cluster_status_api_still_answers_its_service_name():
    """The chart's server is reached at its Service's DNS name or ClusterIP: no Host check."""
    client = TestClient(create_app(LocalStore()), base_url="http://lorarl-server.lorarl.svc:8088")
    assert client.get("/healthz").status_code == 200
    assert client.get("/healthz", headers={"Host": "10.96.0.12:8088"}).status_code == 200


# --- `lorarl validate` and a huge integer --------------------------------------------------------


@pytest.mark.parametrize("digits", [4301, 20_000, 101])
def test_validate_refuses_a_huge_integer_in_one_line(tmp_path, digits):
    text = QUICKSTART.read_text()
    assert "totalSteps:" in text
    lines = [
        f"{line.split(':')[0]}: {'9' * digits}" if line.strip().startswith("totalSteps:") else line
        for line in text.splitlines()
    ]
    f = tmp_path / "job.yaml"
    f.write_text("\n".join(lines) + "\n")
    r = CliRunner().invoke(main, ["validate", str(f)])
    assert isinstance(r.exception, SystemExit) and r.exit_code == 1, r.output[-500:]
    assert "Traceback" not in r.output
    out = r.output.strip().splitlines()
    assert len(out) == 1 and len(out[0]) < 300, out
    assert str(f) in out[0] and "totalSteps" in out[0] and "integer" in out[0]


def test_validate_refuses_a_huge_integer_anywhere(tmp_path):
    for i, text in enumerate(
        (
            f"a:\n  - {'9' * 5000}\n",  # a list item: no key to name, its line instead
            f"? {'9' * 5000}\n: 1\n",  # a key
            f'a: !!int "{"9" * 5000}"\n',  # an explicit tag
            f"a: -{'1' * 5000}\n",
        )
    ):
        f = tmp_path / f"j{i}.yaml"
        f.write_text(text)
        r = CliRunner().invoke(main, ["validate", str(f)])
        assert isinstance(r.exception, SystemExit) and r.exit_code == 1, r.output[-500:]
        assert r.output.count("\n") == 1 and "integer of" in r.output and "line" in r.output


def test_an_ordinary_manifest_still_validates():
    r = CliRunner().invoke(main, ["validate", str(QUICKSTART)])
    assert r.exit_code == 0, r.output


# --- a local SGLang engine's key ----------------------------------------------------------------


def sglang_engine(tmp_path: Path):
    job = load_job_file(QUICKSTART)
    job.spec.rollout = job.spec.rollout.model_copy(update={"engine": "sglang"})
    run = LocalRun(job, tmp_path / "run")
    run.run_dir.mkdir()
    run.plan = plan(run.job, LocalAddressing(30000))
    replica = run.plan.role("rollout").replicas[0]
    container = next(c for c in replica.containers if c.name == "engine")
    return run, run._child(replica, container)


def test_a_local_sglang_engine_gets_its_key_from_the_environment_only(tmp_path):
    run, child = sglang_engine(tmp_path)
    assert run.engine_api_key not in " ".join(child.argv), child.argv
    assert child.env[ENGINE_API_KEY_ENV] == run.engine_api_key
    assert "sglang.launch_server" in child.argv


def test_the_key_reaches_the_engines_own_argv_but_not_its_command_line(tmp_path):
    """What SGLang's argument parser sees has `--api-key <key>`; /proc/<pid>/cmdline does not."""
    from lorarl.local.env_refs import api_key_from_env

    (tmp_path / "fake_engine.py").write_text(
        "import json, sys\n"
        "cmdline = open('/proc/self/cmdline', 'rb').read().decode()\n"
        "print(json.dumps({'argv': sys.argv[1:], 'cmdline': cmdline, 'name': __name__}))\n"
    )
    argv = ["python", "-m", "fake_engine", "--port", "1", "--api-key", ENGINE_API_KEY_REF, "--x"]
    launched = api_key_from_env(argv)
    assert ENGINE_API_KEY_REF not in launched and "--api-key" not in launched
    key = "k3y-" + os.urandom(8).hex()
    env = {**os.environ, ENGINE_API_KEY_ENV: key, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, *launched[1:]], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["argv"] == ["--port", "1", "--x", "--api-key", key]
    assert seen["name"] == "__main__"
    assert key not in seen["cmdline"]


def test_other_engine_commands_are_left_alone():
    from lorarl.local.env_refs import api_key_from_env

    for argv in (
        ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "1"],
        ["python", "script.py", "--api-key", ENGINE_API_KEY_REF],
        ["python", "-m", "m", "--api-key", "literal"],
    ):
        assert api_key_from_env(argv) == argv
