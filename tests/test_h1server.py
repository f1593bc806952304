"""The mesh's own HTTP/1.1 server for the two hot routes (`mesh.h1server`): what it takes, what it
hands to aiohttp, and the ways a client can abuse a hand-written parser."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.conftest import close_writer
from workers.mock import FleetSpec

BODY = b'{"model": "mock-model", "prompt": "hello there", "max_tokens": 3}'


def _post(path: str = "/v1/completions", body: bytes = BODY, extra: bytes = b"") -> bytes:
    return (b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%bContent-Length: %d\r\n\r\n%b"
            % (path.encode(), extra, len(body), body))


async def _answer(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer off the connection: its head and its body (Content-Length or chunked)."""
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    h = {k.lower(): v for k, _, v in (ln.partition(b": ") for ln in head.split(b"\r\n")[1:] if ln)}
    if b"content-length" in h:
        return head, await asyncio.wait_for(r.readexactly(int(h[b"content-length"])), 10)
    out = b""
    while True:
        n = int((await asyncio.wait_for(r.readuntil(b"\r\n"), 10)).strip(), 16)
        chunk = await r.readexactly(n + 2)
        if n == 0:
            return head, out
        out += chunk[:-2]


async def _conn(pd):
    port = int(pd.url.rsplit(":", 1)[1])
    return await asyncio.open_connection("127.0.0.1", port)


async def test_hot_routes_are_served_without_aiohttp_and_keep_alive(make_pd):
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    fast = pd.state.fast
    r, w = await _conn(pd)
    for path in ("/v1/completions", "/v1/completions", "/v1/chat/completions"):
        body = BODY if "chat" not in path else (
            b'{"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}')
        w.write(_post(path, body, b"X-Request-Id: rid-1\r\n"))
        head, got = await _answer(r)
        assert head.startswith(b"HTTP/1.1 200 OK") and b"X-Request-Id: rid-1" in head and b"Date: " in head
        assert json.loads(got)["usage"]["completion_tokens"] == 3
    assert fast.handed == 0 and len(fast.conns) == 1     # one connection, three requests, no aiohttp
    await close_writer(w)
    assert await pd.wait_released() == 0


async def test_pipelined_requests_are_answered_in_order(make_pd):
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    r, w = await _conn(pd)
    bodies = [b'{"model": "mock-model", "prompt": "p%d", "max_tokens": %d}' % (i, i + 1) for i in range(3)]
    w.write(b"".join(_post(body=b, extra=b"X-Request-Id: r%d\r\n" % i) for i, b in enumerate(bodies)))
    for i in range(3):
        head, got = await _answer(r)
        assert b"X-Request-Id: r%d" % i in head and json.loads(got)["usage"]["completion_tokens"] == i + 1
    await close_writer(w)


async def test_long_bodies_read_with_their_head_and_pipelined_after_one_another(make_pd):
    """A body that comes in the head's read is a view of that read (not copied out of it): long
    prompts, one right after another in one write, and a short one last, each answered for its
    own prompt, in order; every KV block back."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    r, w = await _conn(pd)
    sizes = [20000, 30001, 5]
    bodies = [b'{"model": "mock-model", "prompt": "%b", "max_tokens": 2}' % (b"ab"[i % 2:i % 2 + 1] * n)
              for i, n in enumerate(sizes)]
    w.write(b"".join(_post(body=b, extra=b"X-Request-Id: L%d\r\n" % i) for i, b in enumerate(bodies)))
    for i, n in enumerate(sizes):
        head, got = await _answer(r)
        ans = json.loads(got)
        assert b"X-Request-Id: L%d" % i in head and ans["usage"]["prompt_tokens"] == n, (head, ans.get("usage"))
    for n in (40000, 17):   # and on their own: each in the head's read, or after it
        w.write(_post(body=b'{"model": "mock-model", "prompt": "%b", "max_tokens": 1}' % (b"c" * n)))
        assert json.loads((await _answer(r))[1])["usage"]["prompt_tokens"] == n
    assert pd.state.fast.handed == 0
    await close_writer(w)
    assert await pd.wait_released() == 0


async def test_other_routes_and_odd_requests_go_to_aiohttp_on_the_same_connection(make_pd):
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    fast = pd.state.fast
    r, w = await _conn(pd)
    w.write(_post())                                   # fast ...
    head, _ = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200")
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # ... then aiohttp for the rest of the connection
    head, got = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(got)["status"] == "ok"
    w.write(_post())
    head, _ = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200") and fast.handed == 1
    await close_writer(w)
    # a chunked upload is aiohttp's to read
    r, w = await _conn(pd)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
            % (len(BODY), BODY))
    head, got = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(got)["usage"]["completion_tokens"] == 3
    await close_writer(w)


@pytest.mark.parametrize("raw,status", [
    # request smuggling: two lengths, or a length and chunked framing, are refused (by aiohttp, as before)
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length : 5\r\n\r\nhello", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n folded: header\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 400),   # a head too long
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", 413),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad\x00Name: y\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: \xef\xbc\x95\r\n\r\nhello", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\nnot json", 400),
])
async def test_malformed_requests_get_a_clear_error(make_pd, raw, status):
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    r, w = await _conn(pd)
    w.write(raw)
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    assert head.split(b" ")[1] == b"%d" % status, head
    await close_writer(w)


async def test_a_client_that_leaves_mid_stream_cuts_the_request_and_frees_its_kv(make_pd):
    from workers.mock import MockTiming

    pd = await make_pd(FleetSpec(prefill=1, decode=1, timing=MockTiming(decode_ms_per_token=60)))
    r, w = await _conn(pd)
    w.write(_post(body=b'{"model": "mock-model", "prompt": "hi", "max_tokens": 400, "stream": true}'))
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    await asyncio.wait_for(r.readuntil(b"data:"), 10)
    w.transport.abort()
    await close_writer(w)
    assert await pd.wait_released() == 0
    for _ in range(100):
        if not pd.state.fleet.in_flight or not any(pd.state.fleet.in_flight.values()):
            break
        await asyncio.sleep(0.05)
    assert not any(pd.state.fleet.in_flight.values())


async def test_the_openai_sdk_streams_through_the_fast_server(make_pd):
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    client = openai.AsyncOpenAI(base_url=pd.url + "/v1", api_key="none")
    try:
        text = ""
        async for ev in await client.completions.create(model="mock-model", prompt="hello", max_tokens=5,
                                                         stream=True):
            text += ev.choices[0].text if ev.choices else ""
        whole = await client.completions.create(model="mock-model", prompt="hello", max_tokens=5)
        assert whole.usage is not None and whole.usage.completion_tokens == 5 and text
    finally:
        await client.close()
    assert pd.state.fast.handed == 0


async def test_a_head_with_bare_lf_lines_is_not_left_waiting(make_pd):
    """A client ending its head lines with LF alone gets an answer (aiohttp's), not a wait for a
    CRLF CRLF that never comes."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    r, w = await _conn(pd)
    w.write(b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: %d\n\n%b" % (len(BODY), BODY))
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    assert head.split(b" ")[1] in (b"200", b"400"), head
    await close_writer(w)


async def test_expect_100_continue_is_answered_before_the_body(make_pd):
    """curl sends `Expect: 100-continue` with large uploads and waits for the interim answer."""
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    r, w = await _conn(pd)
    w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
            % len(BODY))
    assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(BODY)
    head, got = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(got)["usage"]["completion_tokens"] == 3
    assert pd.state.fast.handed == 0
    await close_writer(w)


async def test_a_pipelining_flood_is_bounded_and_the_request_still_answered(make_pd):
    """A client that sends megabytes past the request being answered gets its reading paused
    (the mesh buffers at most PIPELINE_LIMIT past it), and still gets its answer."""
    from mesh.h1server import PIPELINE_LIMIT
    from workers.mock import MockTiming

    pd = await make_pd(FleetSpec(prefill=1, decode=1, timing=MockTiming(decode_ms_per_token=100)))
    r, w = await _conn(pd)
    w.write(_post(body=b'{"model": "mock-model", "prompt": "hi", "max_tokens": 5}'))
    junk = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" * 20000   # ~1.4 MB
    w.write(junk)
    conn = next(iter(pd.state.fast.conns))
    for _ in range(100):
        if not conn.reading:
            break
        await asyncio.sleep(0.02)
    assert not conn.reading and len(conn.buf) <= PIPELINE_LIMIT + 262144   # paused: at most one read (256 KiB) past
    head, got = await _answer(r)
    assert head.startswith(b"HTTP/1.1 200") and json.loads(got)["usage"]["completion_tokens"] == 5
    w.transport.abort()
    await close_writer(w)
    assert await pd.wait_released() == 0


async def test_a_slow_client_holds_the_decode_and_gets_every_event_whole(make_pd, monkeypatch):
    """A client that reads slower than the decode writes: the mesh stops reading the decode
    (`H1Response.hold`) while the client's buffer is full, and resumes as it drains. The events go
    out through the framed path (the decode's chunks as they came) and the parsed one alike, and
    the client gets every one of them, whole and in order: the same text as the answer unstreamed.
    Every KV block is back after."""
    import socket

    from mesh import h1, h1server

    held: list[int] = []
    framed: list[int] = []
    hold, write_framed = h1.H1Response.hold, h1server.FastStream.write_framed

    def counting_hold(self: h1.H1Response) -> None:
        held.append(1)
        hold(self)

    def counting_framed(self: h1server.FastStream, data: bytes, end: bool = False) -> bool:
        framed.append(len(data))
        return write_framed(self, data, end)
    monkeypatch.setattr(h1.H1Response, "hold", counting_hold)
    monkeypatch.setattr(h1server.FastStream, "write_framed", counting_framed)
    pd = await make_pd(FleetSpec(prefill=1, decode=1))
    prompt = b'{"model": "mock-model", "prompt": "hello slow reader", "max_tokens": 1500%b}'
    r, w = await _conn(pd)
    w.write(_post(body=prompt % b""))
    _, whole = await _answer(r)
    want = json.loads(whole)["choices"][0]["text"]

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", int(pd.url.rsplit(":", 1)[1])))
    sock.setblocking(False)
    r2, w2 = await asyncio.open_connection(sock=sock)
    for _ in range(100):   # the mesh's side of this connection: a small buffer, so that it fills
        conns = [c for c in pd.state.fast.conns if c.req is None and c.transport is not None
                 and c.transport.get_extra_info("peername") == sock.getsockname()]
        if conns:
            break
        await asyncio.sleep(0.01)
    conn = conns[0]
    conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    conn.transport.set_write_buffer_limits(high=4096)
    w2.write(_post(body=prompt % b', "stream": true'))
    head = await asyncio.wait_for(r2.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    body = b""
    while True:   # chunked framing checked chunk by chunk, read slowly
        size_line = await asyncio.wait_for(r2.readuntil(b"\r\n"), 10)
        n = int(size_line.strip(), 16)
        assert size_line == b"%x\r\n" % n
        chunk = await asyncio.wait_for(r2.readexactly(n + 2), 10)
        assert chunk.endswith(b"\r\n")
        if n == 0:
            break
        assert chunk[:-2].endswith(b"\n\n")   # whole events only
        body += chunk[:-2]
        await asyncio.sleep(0.002)
    events = [e for e in body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1] if json.loads(e[6:])["choices"])
    assert text == want
    assert held and framed, (len(held), len(framed))   # it held the decode; the framed path carried events
    await close_writer(w)
    await close_writer(w2)
    assert await pd.wait_released() == 0
