"""The operator's API client times the answer, not its place in the queue: a thousand jobs'
children created at once must wait for one of the few connections without timing out, while a
server that does not answer still fails the request within the timeout."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from lorarl.operator import kube as kube_mod
from lorarl.operator.kube import Credentials, Kube, KubeError, path


async def _serve(delay: float) -> tuple[web.AppRunner, str, list[int]]:
    in_flight = [0, 0]  # now, most at once

    async def answer(request: web.Request) -> web.Response:
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        await asyncio.sleep(1.5 if request.path.endswith("/slow") else delay)
        in_flight[0] -= 1
        return web.json_response({"metadata": {"name": request.path.rsplit("/", 1)[-1]}})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}", in_flight


def test_queued_requests_do_not_time_out_and_a_silent_server_does() -> None:
    n, delay, timeout = 5 * kube_mod.CONNECTIONS, 0.25, 0.8

    async def scenario() -> tuple[list[object], float, int, str]:
        runner, base, in_flight = await _serve(delay)
        kube = Kube(Credentials(server=base), timeout=timeout)
        t0 = time.monotonic()
        urls = [path("v1", "pods", "ns", f"p{i}") for i in range(n)]
        got = await asyncio.gather(*(kube.get(u) for u in urls), return_exceptions=True)
        took = time.monotonic() - t0
        try:
            await kube.get(path("v1", "pods", "ns", "slow"))
            silent = "answered"
        except KubeError as exc:
            silent = f"{exc.reason}: {exc}"
        await kube.close()
        await runner.cleanup()  # waits out the silent answer
        return got, took, in_flight[1], silent

    got, took, most, silent = asyncio.run(scenario())
    assert [g["metadata"]["name"] for g in got] == [f"p{i}" for i in range(n)]  # type: ignore[index]
    assert took > timeout  # the last ones waited longer than the timeout in the queue...
    assert most == kube_mod.CONNECTIONS  # ...for one of the few connections
    assert silent.startswith("Unreachable: GET /api/v1/namespaces/ns/pods/slow: no answer within")
