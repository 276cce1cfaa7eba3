"""`kubectl port-forward svc/lorarl-status-api L:8000` for the README test (cluster.py).

The process kubelet serves no streaming endpoint (port-forward is a SPDY/websocket upgrade on
`pods/portforward` that the API server tunnels to the kubelet), so the harness's `kubectl` hands
this command here: it checks that the target is the status API Service the chart installs,
listens on 127.0.0.1:L as kubectl would, prints kubectl's "Forwarding from" line and relays
every connection to that Service's ClusterIP. Its pid goes to a folder the harness empties on
teardown (the README starts it with `&`, so nothing else would stop it); it also exits after
IDLE_S without a connection.

    python port_forward.py STATUS_URL PID_DIR NAMESPACE [kubectl args...]
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

SERVICE, PORT = "lorarl-status-api", 8000
IDLE_S = 600.0


def parse(args: list[str], default_ns: str) -> tuple[str, str, int, int]:
    """(namespace, target, local port, remote port) from kubectl's port-forward arguments."""
    ns, positional = default_ns, []
    it = iter(args)
    for arg in it:
        if arg in ("-n", "--namespace"):
            ns = next(it)
        elif arg.startswith("--namespace="):
            ns = arg.split("=", 1)[1]
        elif not arg.startswith("-") and arg != "port-forward":
            positional.append(arg)
    if len(positional) != 2:
        raise SystemExit("error: the README harness forwards one Service and one port: "
                         f"got {positional}")  # fmt: skip
    target, ports = positional
    local, _, remote = ports.partition(":")
    return ns, target, int(local), int(remote or local)


async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def serve(local: int, remote: int, upstream: tuple[str, int]) -> None:
    last = asyncio.get_running_loop().time()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal last
        last = asyncio.get_running_loop().time()
        up_reader, up_writer = await asyncio.open_connection(*upstream)
        await asyncio.gather(relay(reader, up_writer), relay(up_reader, writer))

    try:
        server = await asyncio.start_server(handle, "127.0.0.1", local)
    except OSError as exc:
        raise SystemExit(f"Unable to listen on port {local}: {exc}") from None
    print(f"Forwarding from 127.0.0.1:{local} -> {remote}", flush=True)
    async with server:
        while asyncio.get_running_loop().time() - last < IDLE_S:
            await asyncio.sleep(1)


def main(argv: list[str]) -> None:
    status_url, pid_dir, default_ns, *args = argv
    ns, target, local, remote = parse(args, default_ns)
    kind, _, name = target.partition("/")
    if kind not in ("svc", "service", "services") or name != SERVICE or remote != PORT:
        raise SystemExit(f"error: the README harness forwards only svc/{SERVICE} port {PORT}")
    if ns != "lorarl-system":
        raise SystemExit(f'Error from server (NotFound): services "{name}" not found')
    (Path(pid_dir) / str(os.getpid())).touch()
    url = urlsplit(status_url)
    asyncio.run(serve(local, remote, (url.hostname or "127.0.0.1", url.port or 80)))


if __name__ == "__main__":
    main(sys.argv[1:])
