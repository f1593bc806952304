"""PD dialects through the mesh: atom, vllm and sglang mock fleets, each checking what the mesh
sends the way the real engine would (a wrong leg body is refused by the mock with a 400)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from contract.errors import ConfigError
from contract.etcd import EtcdConfig
from contract.snapshot import RoutingTable
from mesh.app import STATE, bound_port, create_app, start_site
from mesh.config import MeshConfig, Timeouts, make_worker
from tests.conftest import MESH_BIN
from workers.mock import FleetSpec, MockFaults, MockFleet, first_token, token_ids, token_text
from workers.register import Enrollment, engine_busy

DIALECTS = ("atom", "vllm", "sglang")
BODY = {"model": "mock-model", "prompt": "dialects all say the same", "max_tokens": 6, "temperature": 0}


def expected_text(prompt: str, n: int) -> str:
    return "".join(token_text(t) for t in token_ids(first_token(prompt), n))


def sse_text(raw: bytes) -> str:
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: {"):
            out.append(orjson.loads(line[6:])["choices"][0].get("text", ""))
    return "".join(out)


async def held_nowhere(fleet: MockFleet, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(len(p.holder) for p in fleet.prefills):
        assert time.monotonic() < deadline, {p.id: len(p.holder) for p in fleet.prefills}
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_completions_stream_and_not_in_every_dialect(make_pd, http, dialect):
    pd = await make_pd(FleetSpec(prefill=2, decode=2, dialect=dialect))
    want = expected_text(BODY["prompt"], 6)
    for _ in range(4):
        async with http.post(pd.url + "/v1/completions", json=BODY) as r:
            assert r.status == 200, await r.text()
            d = await r.json()
        assert d["choices"][0]["text"] == want and d["usage"]["completion_tokens"] == 6
        async with http.post(pd.url + "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status == 200
            raw = await r.read()
        assert raw.endswith(b"data: [DONE]\n\n") and sse_text(raw) == want, raw[-300:]
    assert all(d.requests == 4 for d in pd.fleet.decodes)  # round robin over both engines
    assert sum(p.requests for p in pd.fleet.prefills) == 8
    await held_nowhere(pd.fleet)  # each engine freed its KV (consumer read / release)
    if dialect != "atom":  # engine-managed KV: nothing for the mesh's ledger
        assert pd.state.ledger.began == 0
    else:
        assert pd.state.ledger.began == 8


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_openai_sdk_chat_streams_through_each_dialect(make_pd, dialect):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect=dialect))
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True})
        parts, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        full = await client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    finally:
        await client.close()
    assert "".join(parts) == full.choices[0].message.content and len("".join(parts)) > 0
    assert usage is not None and usage.completion_tokens == 5
    await held_nowhere(pd.fleet)


async def test_sglang_sends_one_room_to_both_legs_at_once(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect="sglang"))
    seen: list[dict] = []
    pre = pd.fleet.prefills[0]
    orig = pre.handle

    async def spy(request, gen, body):
        seen.append(body)
        return await orig(request, gen, body)

    pre.handle = spy  # type: ignore[method-assign]
    async with http.post(pd.url + "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status == 200
        await r.read()
    (b,) = seen
    assert b["bootstrap_host"] == pre.host and b["bootstrap_port"] == pre.port
    assert isinstance(b["bootstrap_room"], int) and 0 <= b["bootstrap_room"] < 2 ** 63
    assert b["stream"] is False and b["max_tokens"] == 6  # the prefill leg is the client's body, not streamed
    assert pd.fleet.decodes[0].pulls_failed == 0  # the decode met the prefill in that room


async def test_sglang_failed_prefill_is_re_paired_and_its_decode_cut(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=2, decode=1, dialect="sglang"), prefill_policy="round_robin",
                       unhealthy_after=100)
    pd.fleet.prefills[0].faults = MockFaults(status=503)
    for i in range(4):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": f"sg {i}"}) as r:
            assert r.status == 200, await r.text()
    assert pd.fleet.prefills[1].requests == 4
    assert pd.fleet.decodes[0].pulls_failed == 0  # cut while waiting for a room that never came
    assert b'atomesh_retries_total{leg="prefill"} 2.0' in await (await http.get(pd.url + "/metrics")).read()
    await held_nowhere(pd.fleet)


async def _settled(pd) -> None:
    """Nothing in flight at the mesh or on any mock worker (the legs it cut are gone)."""
    want = {w: 0 for w in pd.state.fleet.in_flight}
    for _ in range(250):
        workers = [*pd.fleet.prefills, *pd.fleet.decodes]
        if pd.state.fleet.in_flight == want and all(w.in_flight == 0 for w in workers):
            return
        await asyncio.sleep(0.02)
    assert pd.state.fleet.in_flight == want
    assert {w.id: w.in_flight for w in [*pd.fleet.prefills, *pd.fleet.decodes]} == {}


async def test_sglang_prefill_4xx_is_the_clients_answer_and_its_decode_is_cut(make_pd, http):
    """The decode leg runs in the request's own task: a prefill that fails while the decode waits
    for its room cancels that task, and this cancel (only this one) becomes the prefill's error."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect="sglang"))
    pd.fleet.prefills[0].faults = MockFaults(status=400)
    for stream in (False, True):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "stream": stream}) as r:
            assert r.status == 400, await r.text()
            assert "error" in await r.json()
    await _settled(pd)
    assert pd.fleet.decodes[0].pulls_failed == 0   # cut before the room's wait ran out
    assert b'atomesh_retries_total{leg="prefill"}' not in await (await http.get(pd.url + "/metrics")).read()
    await held_nowhere(pd.fleet)
    pd.fleet.prefills[0].faults = MockFaults()
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:   # the task and the pair serve on
        assert r.status == 200, await r.text()


async def test_sglang_client_leaving_while_both_legs_wait_cuts_both(make_pd, http):
    """A client that leaves while the prefill hangs and the decode waits for its room: the request's
    cancel is not taken for the prefill's (no re-pair, no retry), and both legs are cut."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect="sglang"))
    pd.fleet.prefills[0].faults = MockFaults(hang=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(pd.url + "/v1/completions", json=BODY, timeout=aiohttp.ClientTimeout(total=0.3)) as r:
            await r.read()
    await _settled(pd)
    assert b'atomesh_retries_total{leg="prefill"}' not in await (await http.get(pd.url + "/metrics")).read()
    assert pd.fleet.prefills[0].requests == 1 and pd.fleet.decodes[0].requests == 1
    pd.fleet.prefills[0].faults = MockFaults()
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 200, await r.text()
    await held_nowhere(pd.fleet)


async def test_sglang_decode_failure_is_re_paired_on_another_engine(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=2, dialect="sglang", ttl_s=0.5), decode_policy="round_robin",
                       unhealthy_after=100)
    pd.fleet.decodes[0].faults = MockFaults(status=500)
    for i in range(4):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": f"sd {i}", "stream": True}) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"[DONE]\n\n")
    assert pd.fleet.decodes[1].requests == 4
    await held_nowhere(pd.fleet)  # rooms nobody claimed expire on the engine (its own timeout)


async def test_vllm_failed_decode_is_re_paired_never_retried_on_the_same_params(make_pd, http):
    """vLLM frees the prefill's blocks when a decode is aborted (docs/protocol.md section 9): a decode that
    failed is never sent the same params again; the request is re-paired with a new prefill."""
    pd = await make_pd(FleetSpec(prefill=1, decode=2, dialect="vllm", ttl_s=0.5), decode_policy="round_robin",
                       unhealthy_after=100)
    pd.fleet.decodes[0].faults = MockFaults(status=500)
    for i in range(4):
        async with http.post(pd.url + "/v1/completions", json={**BODY, "prompt": f"vd {i}"}) as r:
            assert r.status == 200, await r.text()
    assert pd.fleet.decodes[1].requests == 4
    # every failed decode cost a new prefill: 4 good pairs plus one re-pair per failed decode
    assert pd.fleet.prefills[0].requests == 4 + pd.fleet.decodes[0].requests
    await held_nowhere(pd.fleet)  # the unread ones: freed by the engine's lease, as vLLM does


async def test_vllm_kv_left_unread_is_freed_by_the_engine_timeout(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect="vllm", ttl_s=0.4), decode_retries=0, retries=0)
    pd.fleet.decodes[0].faults = MockFaults(status=500)
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 502
        assert set((await r.json())["error"]) == {"message", "type", "param", "code"}
    assert len(pd.fleet.prefills[0].holder) == 1  # the mesh cannot release a vLLM engine's blocks ...
    await held_nowhere(pd.fleet)                   # ... its abort timeout does
    assert pd.fleet.prefills[0].engine.blocks.free == pd.fleet.prefills[0].engine.blocks.num_blocks


async def test_mixed_fleet_pairs_each_pipeline_with_its_own_dialect(http):
    fleets = [MockFleet(FleetSpec(prefill=1, decode=1, dialect=d, id_prefix=f"{d}-")) for d in DIALECTS]
    for f in fleets:
        await f.start()
    pre = tuple(w for f in fleets for w in f.mesh_workers()[0])
    dec = tuple(w for f in fleets for w in f.mesh_workers()[1])
    app = create_app(MeshConfig(port=0, prefill=pre, decode=dec, prefill_policy="round_robin",
                                decode_policy="round_robin", health_interval=0.1,
                                timeouts=Timeouts(prefill=5, decode_first_byte=5, decode_idle=5, release=2)))
    runner = await start_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{bound_port(runner)}"
    try:
        await asyncio.sleep(0.5)  # probe rounds: vllm and sglang engines have no /load, so /health
        fleet = app[STATE].fleet
        assert all(fleet.healthy(w.id) for w in pre + dec)
        assert fleet._no_load == {w.id for w in pre + dec if w.record.dialect != "atom"}
        for i in range(9):
            async with http.post(url + "/v1/completions", json={**BODY, "stream": i % 2 == 0}) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            assert expected_text(BODY["prompt"], 6) in (sse_text(raw) if i % 2 == 0 else orjson.loads(raw)["choices"][0]["text"])
        for f in fleets:  # three each, and a mispairing would have been refused with a 400
            assert f.prefills[0].requests == 3 and f.decodes[0].requests == 3
            await held_nowhere(f)
        assert app[STATE].ledger.began == 3  # only the atom pipeline's KV is on the ledger
    finally:
        await runner.cleanup()
        for f in fleets:
            await f.close()


def test_routing_table_drops_pipelines_without_a_decode_of_their_dialect():
    p_v = make_worker("prefill", {"url": "http://127.0.0.1:1", "model": "m", "id": "pv", "dialect": "vllm"}, 0)
    p_a = make_worker("prefill", {"url": "http://127.0.0.1:2", "model": "m", "id": "pa"}, 1)
    d_a = make_worker("decode", {"url": "http://127.0.0.1:3", "model": "m", "id": "da"}, 0)
    t = RoutingTable.build((p_v, p_a, d_a), frozenset({"pv", "pa", "da"}))
    assert t.candidates("prefill", "m") == (p_a,)
    assert t.candidates("decode", "m", "atom") == (d_a,) and t.candidates("decode", "m", "vllm") == ()
    t2 = RoutingTable.build((p_v, p_a), frozenset({"pv", "pa"}))  # no decode at all: 503 on the decode pick
    assert t2.candidates("prefill", "m") == (p_v, p_a)


def test_unknown_dialect_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"prefill\[0\]\.dialect.*unknown dialect 'trtllm'"):
        make_worker("prefill", {"url": "http://127.0.0.1:1", "model": "m", "dialect": "trtllm"}, 0)


def test_register_cli_checks_dialect_options():
    base = [MESH_BIN, "register", "--etcd", "http://127.0.0.1:1", "--role", "decode", "--url", "http://127.0.0.1:9",
            "--model", "m"]
    p = subprocess.run(base + ["--dialect", "vllm", "--bootstrap-port", "8998"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "--bootstrap-port is for --role prefill with --dialect sglang or vllm-mooncake" \
        in p.stderr
    assert "Traceback" not in p.stderr
    q = subprocess.run(base + ["--dialect", "nope"], capture_output=True, text=True, timeout=60)
    assert q.returncode == 2 and "invalid choice: 'nope'" in q.stderr


def test_engine_busy_reads_vllm_and_sglang_gauges():
    page = ('# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\nvllm:num_requests_running_total 9\n')
    assert engine_busy(page) == 3
    assert engine_busy('sglang:num_running_reqs{model_name="m"} 0.0\nsglang:num_queue_reqs{model_name="m"} 0\n') == 0
    assert engine_busy("process_cpu_seconds_total 1.5\n") is None


async def test_drain_of_an_external_engine_waits_for_its_running_requests():
    """`mesh register` beside a vLLM engine: no /load, so the drain reads vLLM's /metrics."""
    running = {"n": 2}

    async def metrics(request):
        return web.Response(text=f'vllm:num_requests_running{{model_name="m"}} {running["n"]}.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        enr = Enrollment(etcd=EtcdConfig(), record=make_worker("decode", {"url": url, "model": "m",
                                                                          "dialect": "vllm"}, 0).record)
        waiter = asyncio.create_task(enr.wait_idle(5.0))
        await asyncio.sleep(0.5)
        assert not waiter.done()  # two requests still run on the engine
        running["n"] = 0
        assert await asyncio.wait_for(waiter, 3) is True
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_prefill_answering_garbage_is_a_clear_502(make_pd, http, dialect):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect=dialect), retries=0)
    pd.fleet.prefills[0].faults = MockFaults(garbage=True)
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in err["message"]


async def test_vllm_prefill_without_kv_transfer_params_names_the_field(make_pd, http):
    pd = await make_pd(FleetSpec(prefill=1, decode=1, dialect="vllm"), retries=0)
    pd.fleet.prefills[0].faults = MockFaults(no_kv_params=True)
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 502
        err = (await r.json())["error"]
    assert "kv_transfer_params" in err["message"] and pd.fleet.decodes[0].requests == 0


def test_vllm_mooncake_legs_and_bootstrap_answers():
    """The `vllm-mooncake` bodies as vllm 0.32 `mooncake_connector.py` reads them (the real pair is
    tests/test_vllm_mooncake.py); `GET /query` answers validated before they name an engine."""
    from contract.errors import ProtocolError, UpstreamClientError, UpstreamError, UpstreamTimeout
    from mesh.flows import FLOWS, parse_bootstrap
    from mesh.request import Limits, parse

    flow = FLOWS["vllm-mooncake"]
    pw = make_worker("prefill", {"url": "http://[::1]:8100", "model": "m", "dialect": "vllm-mooncake",
                                 "bootstrap_port": 9000, "dp_rank": 1}, 0)
    dw = make_worker("decode", {"url": "http://127.0.0.1:8200", "model": "m", "dialect": "vllm-mooncake"}, 0)
    creq = parse("completions", orjson.dumps({"model": "m", "prompt": "p", "max_tokens": 9, "min_tokens": 3, "stream": True,
                                              "stream_options": {"include_usage": True}}), Limits())
    pre = flow.prefill_body(creq, pw, dw, "mesh")
    tid = pre["kv_transfer_params"]["transfer_id"]
    assert pre["max_tokens"] == 1 and pre["stream"] is False and "min_tokens" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    assert tid != flow.prefill_body(creq, pw, dw, "mesh")["kv_transfer_params"]["transfer_id"]
    ctx = parse_bootstrap("http://[::1]:9000", {"0": {"engine_id": "e0", "worker_addr": {}},
                                                "1": {"engine_id": "e1", "worker_addr": {"0": {"0": "tcp://x:1"}}}})
    h = flow.handoff(creq, pw, dw, {"choices": [{"text": "x"}]}, False, pre, ctx)
    assert h.decode_body["max_tokens"] == 9 and h.decode_body["min_tokens"] == 3 and h.decode_body["stream"] is True
    assert h.params == {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": "http://[::1]:9000",
                        "remote_engine_id": "e1", "transfer_id": tid} and h.key == tid
    drain = flow.drain_body(creq, h, parse_bootstrap("b", {"1": {"engine_id": "e1-restarted"}}))
    assert drain["max_tokens"] == 1 and drain["kv_transfer_params"]["remote_engine_id"] == "e1-restarted"
    assert drain["kv_transfer_params"]["transfer_id"] == tid
    # a drain only where the decode surely never read the transfer
    assert flow.drain_on(None) and flow.drain_on(UpstreamClientError(400, b"{}", "refused"))
    assert flow.drain_on(UpstreamError("5xx", may_hold_kv=False))
    assert not flow.drain_on(UpstreamError("cut mid-answer")) and not flow.drain_on(UpstreamTimeout("slow"))
    assert not flow.drain_on(asyncio.CancelledError())
    for bad in ([], {}, {"x": {"engine_id": "e"}}, {"0": {"engine_id": 5}}, {"0": "e"}, {"0": {}}):
        with pytest.raises(ProtocolError):
            parse_bootstrap("b", bad)


def test_entropy_ids_are_random_distinct_and_not_shared_with_a_forked_child() -> None:
    """mesh.flows.Entropy: 63-bit rooms and hex transfer ids from os.urandom read in blocks; across
    a buffer refill they stay distinct, and a forked child draws fresh bytes, not its parent's."""
    import os

    from mesh.flows import Entropy

    e = Entropy()
    rooms = [e.bits63() for _ in range(3 * Entropy.SIZE // 8 + 5)]   # three refills and some
    assert len(set(rooms)) == len(rooms) and all(0 <= r < 2 ** 63 for r in rooms)
    assert max(rooms).bit_length() > 55   # all 63 bits in use
    ids = {e.hex(16) for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 for i in ids)
    e.take(8)   # a buffer in hand at the fork
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: what it draws next goes to the parent
        os.write(w, e.take(64))
        os._exit(0)
    os.close(w)
    child = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    assert child != e.take(64)
