"""Every failure semantic of the PD flow, against an in-process mesh and mock fleet."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from mesh.config import Timeouts
from workers.mock import FleetSpec, MockFaults, MockTiming

BODY = {"model": "mock-model", "prompt": "failure semantics", "max_tokens": 5}


async def post(http, url, body=BODY, **kw):
    async with http.post(url + "/v1/completions", json=body, **kw) as r:
        return r.status, await r.read()


def err(raw: bytes) -> dict:
    d = orjson.loads(raw)
    assert set(d["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in d["error"]["message"]
    return d["error"]


@pytest.mark.parametrize("status,expect", [(500, 502), (503, 503), (400, 400), (422, 422)])
async def test_prefill_error_status_and_decode_never_called(make_pd, http, status, expect):
    pd = await make_pd()
    pd.fleet.prefills[0].faults = MockFaults(status=status)
    code, raw = await post(http, pd.url)
    assert code == expect
    e = err(raw)
    if expect < 500:
        assert e["code"] == "injected"  # the prefill's own 4xx body, passed on
    assert pd.fleet.decodes[0].requests == 0


async def test_prefill_timeout_is_504(make_pd, http):
    pd = await make_pd(timeouts=Timeouts(prefill=0.3))
    pd.fleet.prefills[0].faults = MockFaults(hang=True)
    code, raw = await post(http, pd.url)
    assert code == 504 and err(raw)["code"] == "upstream_timeout"
    assert pd.fleet.decodes[0].requests == 0


@pytest.mark.parametrize("fault", [MockFaults(garbage=True), MockFaults(no_kv_params=True)])
async def test_prefill_garbage_is_502(make_pd, http, fault):
    pd = await make_pd()
    pd.fleet.prefills[0].faults = fault
    code, raw = await post(http, pd.url)
    assert code == 502
    err(raw)
    assert pd.fleet.decodes[0].requests == 0


async def test_prefill_unreachable_is_502(make_pd, http):
    pd = await make_pd()
    await pd.fleet.close()  # nothing listens there any more
    code, raw = await post(http, pd.url)
    assert code == 502 and err(raw)["type"] == "upstream_error"


async def test_decode_failure_before_first_byte_retried_on_other_engine(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=2), decode_policy="round_robin")
    pd.fleet.decodes[0].faults = MockFaults(status=500)
    for _ in range(4):
        code, raw = await post(http, pd.url, {**BODY, "stream": True})
        assert code == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert pd.fleet.decodes[1].requests == 4
    assert b'atomesh_retries_total{leg="decode"} 2.0' in await (await http.get(pd.url + "/metrics")).read()
    assert await pd.wait_released() == 0


async def test_decode_failure_without_retry_releases_kv(make_pd, http):
    pd = await make_pd(decode_retries=0)
    pd.fleet.decodes[0].faults = MockFaults(status=500)
    code, raw = await post(http, pd.url)
    assert code == 502 and err(raw)
    assert pd.fleet.prefills[0].holder.freed_by["mesh-reclaim"] == 1
    assert await pd.wait_released() == 0


async def test_decode_timeout_before_first_byte(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=2), decode_policy="round_robin",
                       timeouts=Timeouts(decode_first_byte=0.3))
    for d in pd.fleet.decodes:
        d.faults = MockFaults(hang=True)
    deadline = time.monotonic() + 5   # both decodes routable (each after its first probe) before the request
    while len(pd.state.fleet.table.candidates("decode", "mock-model")) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    code, raw = await post(http, pd.url)
    assert code == 504 and err(raw)["code"] == "upstream_timeout"
    assert sum(d.requests for d in pd.fleet.decodes) == 2  # the first try and one retry
    assert await pd.wait_released() == 0


@pytest.mark.parametrize("pipeline_down", [False, True])
async def test_a_decode_stalled_while_its_pipeline_is_down_is_not_charged(make_pd, http, pipeline_down):
    """A decode that sends nothing before the first-byte timeout counts against its breaker, unless
    the pipeline it pulls from went down meanwhile (a stage died under its pull: the decode waits on
    a dead peer, and charging it would take the fleet's healthy decode engines out one by one)."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1), timeouts=Timeouts(decode_first_byte=0.5))
    pd.fleet.decodes[0].faults = MockFaults(hang=True)
    fleet = pd.state.fleet
    deadline = time.monotonic() + 5
    while not fleet.table.candidates("decode", "mock-model"):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    pid, did = pd.fleet.prefills[0].id, pd.fleet.decodes[0].id
    req = asyncio.ensure_future(post(http, pd.url))
    await asyncio.sleep(0.2)        # the prefill has answered; the decode leg hangs
    if pipeline_down:
        while fleet.healthy(pid):   # its breaker opens, as its probes or other requests would open it
            fleet.mark_failed(pid)
    code, raw = await req
    assert code == 504 and err(raw)["code"] == "upstream_timeout"
    assert fleet._fails.get(did, 0) == (0 if pipeline_down else 1)
    assert await pd.wait_released() == 0


async def test_decode_dies_mid_stream_ends_with_error_event(make_pd, http):
    pd = await make_pd()
    pd.fleet.decodes[0].faults = MockFaults(die_after_tokens=3)
    code, raw = await post(http, pd.url, {**BODY, "max_tokens": 10, "stream": True})
    assert code == 200
    events = raw.split(b"\n\n")
    assert raw.count(b'"text"') == 3
    assert events[-2].startswith(b"event: error\ndata: ")
    assert orjson.loads(events[-2].split(b"data: ", 1)[1])["error"]["type"] == "upstream_error"
    assert await pd.wait_released() == 0  # the decode took and released the KV before dying


async def test_client_disconnect_during_prefill(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, timing=MockTiming(prefill_ms_per_token=20)))
    with pytest.raises(asyncio.TimeoutError):
        await post(http, pd.url, timeout=aiohttp.ClientTimeout(total=0.15))
    await asyncio.sleep(0.5)
    assert pd.fleet.decodes[0].requests == 0
    assert await pd.wait_released() == 0
    assert pd.fleet.prefills[0].engine.blocks.free == pd.fleet.prefills[0].engine.blocks.num_blocks


async def test_client_disconnect_between_legs_releases(make_pd, http):
    # a slow stage holds the decode's KV pull: the client leaves while decode has not got the KV
    pd = await make_pd(FleetSpec(prefill=1, decode=1, pp_size=2))
    pd.fleet.prefills[0].faults = MockFaults(slow_stage=1, slow_stage_ms=2000)
    with pytest.raises(asyncio.TimeoutError):
        await post(http, pd.url, timeout=aiohttp.ClientTimeout(total=0.3))
    assert await pd.wait_released() == 0
    assert pd.fleet.prefills[0].holder.freed_by["mesh-reclaim"] == 1


async def test_client_disconnect_mid_decode(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, timing=MockTiming(decode_ms_per_token=50)))
    async with http.post(pd.url + "/v1/completions", json={**BODY, "max_tokens": 100, "stream": True}) as r:
        assert r.status == 200
        await r.content.readany()
    # the connection is closed with the stream unfinished
    for _ in range(50):
        if pd.fleet.decodes[0].in_flight == 0:
            break
        await asyncio.sleep(0.05)
    assert pd.fleet.decodes[0].in_flight == 0  # the mesh cut the decode leg
    for _ in range(50):
        if pd.state.fleet.in_flight == {"mock-decode-0": 0, "mock-prefill-0": 0}:
            break
        await asyncio.sleep(0.05)
    assert pd.state.fleet.in_flight == {"mock-decode-0": 0, "mock-prefill-0": 0}
    assert await pd.wait_released() == 0


async def test_no_healthy_decode_is_503(make_pd, http):
    pd = await make_pd()
    pd.state.fleet.mark_failed("mock-decode-0")
    pd.state.fleet.mark_failed("mock-decode-0")
    code, raw = await post(http, pd.url)
    assert code == 503 and err(raw)["code"] == "no_healthy_worker"
    async with http.get(pd.url + "/ready") as r:
        assert r.status == 503


async def test_prompt_larger_than_the_kv_pool_is_a_clear_400(make_pd, http):
    """The engine's scheduler refuses a prompt no pool here can ever hold (the mock fleet runs the
    real adapters and scheduler): a 4xx that says why, not a 503 to retry."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1, num_blocks=2))
    code, raw = await post(http, pd.url, {**BODY, "prompt": "x" * 100})
    assert code == 400 and "needs more KV blocks than the pool has" in err(raw)["message"]
    assert err(raw)["param"] == "prompt" and err(raw)["type"] == "invalid_request_error"
    assert pd.fleet.prefills[0].engine.blocks.free == 2


async def test_prefill_failure_retried_on_a_new_pair_with_backoff(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=2), prefill_policy="round_robin", unhealthy_after=100)
    pd.fleet.prefills[0].faults = MockFaults(status=500)
    for i in range(4):
        code, raw = await post(http, pd.url, {**BODY, "prompt": f"retry {i}"})
        assert code == 200
    assert pd.fleet.prefills[1].requests == 4
    text = await (await http.get(pd.url + "/metrics")).text()
    assert 'atomesh_retries_total{leg="prefill"} 2.0' in text  # round robin hit the bad one twice
    assert pd.state.ledger.totals["NO_KV"] == 2 and await pd.wait_released() == 0


async def test_unreachable_prefill_is_retried(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=1), prefill_policy="round_robin", unhealthy_after=100)
    await pd.fleet._runners[0].cleanup()  # prefill 0 refuses connections
    for i in range(3):
        code, _ = await post(http, pd.url, {**BODY, "prompt": f"u{i}"})
        assert code == 200


async def test_circuit_breaker_opens_then_half_opens(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=1), prefill_policy="round_robin", unhealthy_after=2,
                       breaker_open_s=0.3, health_interval=0.1, retries=1)
    bad = pd.fleet.prefills[0]
    bad.faults = MockFaults(status=500)
    for i in range(6):
        assert (await post(http, pd.url, {**BODY, "prompt": f"b{i}"}))[0] == 200
    assert not pd.state.fleet.healthy(bad.id)  # open: no more traffic to it
    seen = bad.requests
    for i in range(4):
        assert (await post(http, pd.url, {**BODY, "prompt": f"c{i}"}))[0] == 200
    assert bad.requests == seen
    bad.faults = MockFaults()
    await asyncio.sleep(0.6)  # past breaker_open_s: half-open, and the probe of /load succeeds
    assert pd.state.fleet.healthy(bad.id)
    for i in range(4):
        assert (await post(http, pd.url, {**BODY, "prompt": f"d{i}"}))[0] == 200
    assert bad.requests > seen


@pytest.mark.parametrize("stream", [False, True])
async def test_kv_pull_failure_re_pairs_on_another_pipeline(make_pd, http, stream):
    """The decode could not pull from the pipeline (it answers kv_transfer_failed): the pipeline is
    blamed, not the decode engine, and the request is re-run on another pipeline."""
    pd = await make_pd(FleetSpec(prefill=2, decode=1, pull_deadline_s=0.3), prefill_policy="round_robin",
                       unhealthy_after=2, first_token_early=False)
    bad, good = pd.fleet.prefills
    bad.faults = MockFaults(drop_write_done=1.0)
    bad.apply_faults()
    for i in range(4):
        code, raw = await post(http, pd.url, {**BODY, "prompt": f"pull {i}", "stream": stream})
        assert code == 200 and b"error" not in raw, raw[-300:]
    dec = pd.fleet.decodes[0]
    assert pd.state.fleet.healthy(dec.id)  # the decode engine's circuit never opened
    assert not pd.state.fleet.healthy(bad.id)  # the pipeline's did, after unhealthy_after failures
    assert dec.pulls_failed == 2 and good.requests == 4
    text = await (await http.get(pd.url + "/metrics")).text()
    assert 'atomesh_upstream_errors_total{kind="kv_transfer",leg="decode"} 2.0' in text
    assert pd.state.ledger.totals["RECLAIMED"] == 2
    assert await pd.wait_released() == 0


async def test_kv_pull_failure_after_token_zero_ends_the_stream_with_an_error(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, pull_deadline_s=0.3), first_token_early=True)
    pd.fleet.prefills[0].faults = MockFaults(drop_write_done=1.0)
    pd.fleet.prefills[0].apply_faults()
    code, raw = await post(http, pd.url, {**BODY, "stream": True})
    assert code == 200 and raw.count(b"data: {") == 2  # the role + token 0 chunk, then the error
    assert b"event: error" in raw and b'"kv_transfer_failed"' in raw
    assert await pd.wait_released() == 0


@pytest.mark.parametrize("status,opens", [(503, False), (500, True)])
async def test_capacity_answers_do_not_open_the_breaker(make_pd, http, status, opens):
    """A worker saying 503 (capacity: kv_exhausted, busy) stays routable; a 500 opens its breaker."""
    pd = await make_pd(FleetSpec(prefill=2, decode=1), prefill_policy="round_robin", unhealthy_after=1)
    bad = pd.fleet.prefills[0]
    bad.faults = MockFaults(status=status)
    for i in range(2):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": f"cap {i}"}) as r:
            assert r.status == 200   # re-paired on the other pipeline
    assert pd.state.fleet.healthy(_pid(pd, bad)) is not opens


def _pid(pd, w) -> str:
    (wid,) = [x.id for x in pd.state.fleet.workers() if x.url == w.url]
    return wid


async def test_a_decode_that_fails_every_pull_does_not_take_healthy_pipelines_out(http):
    """A decode whose pulls all fail (here: a deadline no write_done can meet; in the field, a dead
    side channel) answers kv_transfer_failed against every pipeline. Charging each pipeline would open
    the breakers of three healthy ones; once it has failed against two distinct pipelines with no
    good pull since, the decode is charged instead, and requests go on to the good decode."""
    from mesh.app import STATE, bound_port, create_app, start_site
    from mesh.config import MeshConfig
    from workers.mock import MockFleet

    pipes = MockFleet(FleetSpec(prefill=3, decode=0, id_prefix="p-"))
    bad = MockFleet(FleetSpec(prefill=0, decode=1, pull_deadline_s=1e-6, id_prefix="bad-"))
    good = MockFleet(FleetSpec(prefill=0, decode=1, id_prefix="good-"))
    for f in (pipes, bad, good):
        await f.start()
    cfg = MeshConfig(port=0, prefill=pipes.mesh_workers()[0], decode=bad.mesh_workers()[1] + good.mesh_workers()[1],
                     prefill_policy="round_robin", decode_policy="round_robin", unhealthy_after=2,
                     first_token_early=False, health_interval=30)
    app = create_app(cfg)
    runner = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        codes = [(await post(http, url, {**BODY, "prompt": f"pull {i}"}))[0] for i in range(12)]
        fleet = app[STATE].fleet
        assert all(fleet.healthy(p.id) for p in pipes.prefills), codes
        assert not fleet.healthy(bad.decodes[0].id) and bad.decodes[0].pulls_failed >= 2
        assert codes[-6:] == [200] * 6, codes
        for _ in range(250):   # the mesh frees a failed pull's transfer in the background
            if sum(len(p.holder) for p in pipes.prefills) == 0:
                break
            await asyncio.sleep(0.02)
        assert sum(len(p.holder) for p in pipes.prefills) == 0
    finally:
        await runner.cleanup()
        for f in (pipes, bad, good):
            await f.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_prompt_larger_than_the_pool_is_a_400_before_any_stream_in_regular_mode(make_pd, http, stream):
    """The engine alone (regular mode): refused on arrival, so a streaming client gets the 400 too,
    not a 200 with an error event."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1, num_blocks=2), regular=True)
    async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": "x" * 100, "stream": stream}) as r:
        body = await r.json()
        assert r.status == 400 and body["error"]["param"] == "prompt", body
        assert "needs more KV blocks than the pool has" in body["error"]["message"]
    assert all(d.engine.blocks.free == 2 for d in pd.fleet.decodes)
