"""Admission control and client API keys."""

from __future__ import annotations

import asyncio

import pytest

from contract.errors import Overloaded
from mesh.admission import AdmissionConfig, Gate
from tests.conftest import close_writer
from workers.mock import FleetSpec, MockTiming

BODY = {"model": "mock-model", "prompt": "admit me", "max_tokens": 5}
SLOW = FleetSpec(prefill=1, decode=1, timing=MockTiming(decode_ms_per_token=60))


async def test_gate_queue_handoff_and_timeout():
    g = Gate(1, 1, 0.2, "test")
    await g.acquire()
    waiter = asyncio.create_task(g.acquire())
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):  # queue full
        await g.acquire()
    g.release()  # handed straight to the waiter
    await waiter
    assert g.active == 1 and g.queued == 0
    with pytest.raises(Overloaded, match="waited"):
        await g.acquire()  # nobody releases within 0.2 s
    g.release()
    assert g.active == 0 and g.rejected == 2


async def test_cancelled_waiter_does_not_leak_a_slot():
    g = Gate(1, 4, 5, "test")
    await g.acquire()
    t = asyncio.create_task(g.acquire())
    await asyncio.sleep(0.01)
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    g.release()
    assert g.active == 0 and g.queued == 0


async def test_overload_gets_429_with_retry_after(make_pd, http):
    pd = await make_pd(SLOW, admission=AdmissionConfig(max_concurrency=2, max_queue=1, queue_timeout=2.0))

    async def one():
        async with http.post(pd.url + "/v1/completions", json=BODY) as r:
            return r.status, r.headers.get("Retry-After"), await r.json()

    res = await asyncio.gather(*(one() for _ in range(6)))
    ok = [r for r in res if r[0] == 200]
    over = [r for r in res if r[0] == 429]
    assert len(ok) == 3 and len(over) == 3  # 2 running + 1 queued; the rest refused at once
    assert all(r[1] == "1" and r[2]["error"]["type"] == "rate_limit_error" for r in over)
    assert pd.state.admission.gate.active == 0


async def test_api_keys_and_per_key_limit(make_pd, http):
    keys = ("k" * 20, "z" * 20)
    pd = await make_pd(SLOW, api_keys=keys,
                       admission=AdmissionConfig(per_key_concurrency=1, max_queue=0, queue_timeout=1))
    async with http.post(pd.url + "/v1/completions", json=BODY) as r:
        assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
    async with http.post(pd.url + "/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"}) as r:
        assert r.status == 401
    async with http.get(pd.url + "/v1/models") as r:
        assert r.status == 401

    async def as_key(k):
        async with http.post(pd.url + "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {k}"}) as r:
            return r.status

    # one at a time per key: a second concurrent request of key 0 is refused, key 1 is not affected
    assert sorted(await asyncio.gather(as_key(keys[0]), as_key(keys[0]), as_key(keys[1]))) == [200, 200, 429]
    async with http.get(pd.url + "/metrics") as r:
        text = await r.text()
    assert keys[0] not in text and keys[1] not in text


async def test_the_api_key_is_checked_before_the_body_is_read(make_pd):
    """An unauthenticated client announcing 8 MB gets its 401 after the headers alone."""
    from urllib.parse import urlsplit

    pd = await make_pd(SLOW, api_keys=("k" * 20,))
    u = urlsplit(pd.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer wrong\r\nContent-Length: 8000000\r\n\r\n{\"model\"")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)   # without sending the rest
    assert head.startswith(b"HTTP/1.1 401")
    writer.close()


async def test_json_nested_too_deeply_is_a_400(make_pd, http):
    pd = await make_pd()
    deep = "[" * 1000 + "]" * 1000
    raw = ('{"model": "mock-model", "prompt": "x", "max_tokens": 2, "metadata": ' + deep + "}").encode()
    async with http.post(pd.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "nested too deeply" in (await r.json())["error"]["message"]


def test_the_depth_check_refuses_exactly_what_the_legs_cannot_encode():
    """`mesh.request.parse` encodes each array or object value one level down instead of the whole
    body: at every depth around orjson's limit (and for objects and arrays alike) it refuses
    exactly the bodies whose whole encoding fails, as a leg's would."""
    import orjson

    from contract.errors import InvalidRequest
    from mesh.request import Limits, parse

    for n in range(248, 258):
        for inner in ("[" * n + "]" * n, '{"a":' * n + "1" + "}" * n):
            raw = ('{"model": "m", "prompt": "x", "metadata": ' + inner + "}").encode()
            try:
                orjson.dumps(orjson.loads(raw))
                whole_ok = True
            except orjson.JSONEncodeError:
                whole_ok = False
            try:
                parse("completions", raw, Limits())
                ok = True
            except InvalidRequest as e:
                assert "nested too deeply" in e.message
                ok = False
            assert ok == whole_ok, (n, inner[:2])


async def test_a_flood_of_malformed_requests_is_logged_once_per_peer_without_its_bytes(make_pd, http, caplog):
    """issue 16: aiohttp logged each refused request at ERROR with the bytes it choked on (headers,
    an Authorization among them). Now: one warning per peer per minute, no bytes, all counted."""
    import logging

    from contract.badlog import BAD_REQUESTS

    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    port = int(pd.url.rsplit(":", 1)[1])
    before = BAD_REQUESTS.total
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    for _ in range(30):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET / HTTP/1.1\r\nAuthorization: Bearer very-secret-token\r\nBad Header\x00: y\r\n\r\n")
        await w.drain()
        await r.read()
        await close_writer(w)
    lines = [rec for rec in caplog.records if rec.name == "aiohttp.server"]
    assert len(lines) <= 1 and all(rec.levelno == logging.WARNING for rec in lines), [r.getMessage() for r in lines]
    assert "very-secret-token" not in caplog.text and "Bad Header" not in caplog.text
    assert BAD_REQUESTS.total - before == 30
    async with http.get(pd.url + "/metrics") as resp:
        assert "atomesh_bad_http_requests_total" in await resp.text()
    async with http.post(pd.url + "/v1/completions", json={"model": "mock-model", "prompt": "ok", "max_tokens": 2}) as resp:
        assert resp.status == 200


async def test_slow_heads_and_slow_bodies_are_cut_off(make_pd):
    """issue 16 (slowloris): a client trickling its request head is disconnected once the
    keep-alive deadline passes (bytes that complete no head do not move it); one trickling its body
    gets a 408 after `body_timeout_s` and the connection closes. Normal requests are served."""
    import dataclasses
    import time

    from mesh.app import bound_port, create_app, start_site
    from mesh.request import Limits

    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    cfg = dataclasses.replace(pd.state.cfg, limits=Limits(body_timeout_s=0.5))
    app = create_app(cfg)
    runner = await start_site(app, "127.0.0.1", 0, keepalive_timeout=1.0)
    port = bound_port(runner)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        closed = None
        for _ in range(40):  # one header byte every 0.1 s, never finishing the head
            await asyncio.sleep(0.1)
            try:
                w.write(b"X")
                await w.drain()
            except ConnectionError:
                closed = time.monotonic() - t0
                break
            if r.at_eof() or (await _eof(r)):
                closed = time.monotonic() - t0
                break
        await close_writer(w)
        assert closed is not None and closed < 3.5, closed
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{")
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)   # the 408 ...
        body = await asyncio.wait_for(r.read(), 5)                      # ... and the server closes
        await close_writer(w)
        assert head.startswith(b"HTTP/1.1 408") and b"request_timeout" in body, (head, body)
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions",
                              json={"model": "mock-model", "prompt": "ok", "max_tokens": 2}) as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()


async def _eof(r: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(r.read(1), 0.01) == b""
    except TimeoutError:
        return False


