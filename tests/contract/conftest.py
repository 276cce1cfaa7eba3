"""The SGLang contract env: SGLang's real HTTP app served from `.venv-sglang` (see sglang_harness).

The suite itself runs in the project venv; only the harness process imports SGLang, so its pins
(transformers 5.19, ...) never meet ours. Without the env every contract test skips, saying how
to build it.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from lorarl.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent / "sglang_harness.py"
API_KEY = "contract-key"
START_TIMEOUT_S = 180.0


def sglang_python() -> Path:
    """The SGLang env's interpreter; LORARL_SGLANG_PYTHON overrides `.venv-sglang/bin/python`."""
    return Path(os.environ.get("LORARL_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))


@dataclass
class Harness:
    """Client to the harness: SGLang's routes plus its `/_contract/` introspection routes."""

    url: str
    api_key: str
    http: httpx.Client = field(repr=False)

    def server_args(self, argv: list[str], fields: list[str]) -> dict[str, Any]:
        return self.http.post(
            "/_contract/server_args", json={"argv": argv, "fields": fields}
        ).json()

    def check(self, path: str, body: Any, method: str = "POST") -> dict[str, Any]:
        resp = self.http.post(
            "/_contract/check", json={"path": path, "body": body, "method": method}
        )
        resp.raise_for_status()
        return resp.json()

    def calls(self) -> list[dict[str, Any]]:
        return self.http.get("/_contract/calls").json()["calls"]

    def weight_version(self) -> str:
        return self.http.get("/_contract/calls").json()["weight_version"]

    def raw(self) -> list[dict[str, Any]]:
        return self.http.get("/_contract/raw").json()["requests"]


@pytest.fixture(scope="session")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    python = sglang_python()
    if not python.exists():
        pytest.skip(
            f"SGLang contract env not found at {python}: build it with `make sglang-venv` "
            "(scripts/install_sglang_contract_env.sh) or set LORARL_SGLANG_PYTHON"
        )
    from harness.workloads.tiny_models import make_tiny_model

    work = tmp_path_factory.mktemp("sglang-contract")
    model = work / "model"
    make_tiny_model(model, arch="llama")
    port = free_port()
    log_path = work / "harness.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(python), "-W", "ignore", str(HARNESS), str(port), API_KEY, str(model), str(work)],
            stdout=log, stderr=subprocess.STDOUT, cwd=work,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"SGLang harness exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            try:
                if http.get("/_contract/calls", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"SGLang harness not up in {START_TIMEOUT_S:.0f} s:\n"
                            f"{log_path.read_text()[-3000:]}")  # fmt: skip
            time.sleep(0.3)
        yield Harness(url=url, api_key=API_KEY, http=http)
    finally:
        http.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
