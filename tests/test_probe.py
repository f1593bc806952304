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


async def test_the_leak_alarm_and_the_routing_change_are_one_step():
    """A census that stays off raises the leak alarm; whoever reads the alarm (`/ready`, `/workers`)
    must already see the worker out of routing, even while another worker's probe of the same round
    is still in flight (CI once read the alarm with the pipeline still routable)."""
    delay = {"d0": 0.0}

    def handler(wid: str, body: dict):
        async def h(request: web.Request) -> web.Response:
            await asyncio.sleep(delay.get(wid, 0.0))
            return web.json_response(body)
        return h

    census_off = {"in_flight": 0, "free_blocks": 5, "num_blocks": 8, "held_blocks": 0, "running_blocks": 0,
                  "capabilities": ["load_v1"]}
    fine = {"in_flight": 0, "capabilities": ["load_v1"]}
    runners, ws = [], []
    for wid, role, body in (("p0", "prefill", census_off), ("d0", "decode", fine)):
        app = web.Application()
        app.router.add_get("/load", handler(wid, body))
        runners.append(await start_site(app, "127.0.0.1", 0))
        ws.append(make_worker(role, {"url": f"http://127.0.0.1:{bound_port(runners[-1])}", "model": "m",
                                     "id": wid, "capabilities": ["load_v1"]}, 0))
    fleet = Fleet(StaticRegistry(tuple(ws)), kv_leak_after=0.05)
    fleet.on_membership()
    try:
        async with aiohttp.ClientSession() as s:
            await fleet.probe_all(s, timeout=2)          # the census is off from here on
            assert fleet.table.candidates("prefill", "m") and not fleet.kv_unaccounted
            await asyncio.sleep(0.1)
            delay["d0"] = 1.0                            # the decode's probe outlasts the alarm
            round_ = asyncio.create_task(fleet.probe_all(s, timeout=2))
            while not fleet.kv_unaccounted:
                await asyncio.sleep(0.005)
            assert not round_.done()
            assert fleet.kv_unaccounted == {"p0": 3}
            assert not fleet.table.candidates("prefill", "m") and not fleet.healthy("p0")
            await round_
            assert not fleet.table.candidates("prefill", "m")
    finally:
        for r in runners:
            await r.cleanup()
