"""The operator's progress poll keeps bounded_fetch's caps: size, encoding, status, deadline."""

from __future__ import annotations

import asyncio

from aiohttp import web

from lorarl.bounded_fetch import FetchError
from lorarl.operator.progress_fetch import fetch_json, session


async def _serve() -> tuple[web.AppRunner, str]:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"job": "j", "step": 3})

    async def big(_: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # no Content-Length: the cap must hold while reading
        await resp.prepare(_)
        await resp.write(b"[" + b"1," * 600 + b"1]")
        return resp

    async def gz(_: web.Request) -> web.Response:
        return web.Response(body=b"x", headers={"Content-Encoding": "gzip"})

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(1.0)
        return web.json_response({})

    async def err(_: web.Request) -> web.Response:
        return web.Response(status=500, text="boom")

    async def junk(_: web.Request) -> web.Response:
        return web.Response(text="not json")

    app = web.Application()
    for path, handler in (("/ok", ok), ("/big", big), ("/gz", gz), ("/slow", slow), ("/err", err),
                          ("/junk", junk)):  # fmt: skip
        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_caps_hold_and_a_good_answer_parses() -> None:
    async def scenario() -> dict[str, object]:
        runner, base = await _serve()
        out: dict[str, object] = {}
        async with session(5.0, 4) as s:
            for name in ("ok", "big", "gz", "slow", "err", "junk", "missing"):
                try:
                    out[name] = await fetch_json(s, f"{base}/{name}", max_bytes=1000,
                                                 deadline_s=0.3)  # fmt: skip
                except FetchError as exc:
                    out[name] = str(exc)
        await runner.cleanup()
        return out

    out = asyncio.run(scenario())
    assert out["ok"] == {"job": "j", "step": 3}
    assert "over 1000 bytes" in str(out["big"])
    assert "gzip" in str(out["gz"])
    assert "within 0.3 s" in str(out["slow"])
    assert "HTTP 500" in str(out["err"]) and "HTTP 404" in str(out["missing"])
    assert "not JSON" in str(out["junk"])
