"""The health probe: a slow /health of a worker busy with calls is not a failure; of an idle one it is."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from mesh.app import bound_port, start_site
from mesh.config import make_worker
from mesh.fleet import Fleet, StaticRegistry


async def test_a_slow_probe_counts_only_when_the_worker_is_idle():
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    app = web.Application()
    for path in ("/load", "/health", "/v1/models"):
        app.router.add_get(path, slow)
    runner = await start_site(app, "127.0.0.1", 0)
    w = make_worker("decode", {"url": f"http://127.0.0.1:{bound_port(runner)}", "model": "m", "id": "d0",
                               "capabilities": ["load_v1"]}, 0)
    fleet = Fleet(StaticRegistry((w,)), unhealthy_after=2)
    fleet.on_membership()
    try:
        async with aiohttp.ClientSession() as s:
            fleet.in_flight["d0"] = 1          # busy: slow probes are not failures
            for _ in range(3):
                await fleet.probe_all(s, timeout=0.2)
            assert fleet.healthy("d0")
            fleet.in_flight["d0"] = 0          # idle and not answering: out after two
            for _ in range(2):
                await fleet.probe_all(s, timeout=0.2)
            assert not fleet.healthy("d0")
    finally:
        await runner.cleanup()
