"""mesh/h1.py: the lean HTTP/1.1 client, against raw loopback servers that frame answers by hand."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from mesh.h1 import H1Error, H1Pool, split_url


async def raw_server(script):
    """A TCP server answering each request with the byte pieces `script(request_bytes)` yields."""
    conns = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(n)
                for piece in script(head + body):
                    if piece is None:
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                        continue
                    writer.write(piece)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], conns



@pytest.fixture
async def pool():
    p = H1Pool(connect_timeout=2)
    yield p
    await p.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def test_content_length_and_keepalive_reuse(pool):
    server, port, conns = await raw_server(lambda req: [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"
                                                        b"Content-Type: text/plain\r\n\r\nhel", b"lo"])
    async with server:
        for _ in range(3):
            r = await pool.post("127.0.0.1", port, "/x", b"{}", {"Content-Type": "application/json"})
            assert r.status == 200 and r.headers["content-type"] == "text/plain"
            assert await r.read() == b"hello"
        assert len(conns) == 1  # one connection, reused


async def test_chunked_split_at_every_byte(pool):
    body = chunked(b"data: 1\n\n", b"data: [DONE]\n\n")[:-5] + b"0;ext=1\r\nTrailer: x\r\n\r\n"
    resp = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body
    server, port, conns = await raw_server(lambda req: [resp[i:i + 1] for i in range(len(resp))])
    async with server:
        for _ in range(2):
            r = await pool.post("127.0.0.1", port, "/x", b"x", {})
            assert await r.read() == b"data: 1\n\ndata: [DONE]\n\n"
        assert len(conns) == 1


@pytest.mark.parametrize("cut", ["every byte", "in the head's end", "right after the head", "one read"])
async def test_a_content_length_answer_in_any_pieces(pool, cut):
    """The head is found in the first read itself when it is whole there (the body copied once),
    and across reads when it is not."""
    body = b'{"remote_block_ids":[' + b",".join(b"%d" % i for i in range(5000)) + b"]}"
    resp = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    h = resp.index(b"\r\n\r\n")
    pieces = {"every byte": [resp[i:i + 1] for i in range(300)] + [resp[300:]],
              "in the head's end": [resp[:h + 2], resp[h + 2:]],
              "right after the head": [resp[:h + 4], resp[h + 4:]], "one read": [resp]}[cut]
    server, port, conns = await raw_server(lambda req: [*pieces])
    async with server:
        for _ in range(2):
            r = await pool.post("127.0.0.1", port, "/x", b"x", {})
            assert r.status == 200 and await r.read() == body
        assert len(conns) == 1


async def test_readany_streams_as_it_comes(pool):
    server, port, _ = await raw_server(lambda req: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
                                                    b"3\r\nabc\r\n", 0.1, b"2\r\nde\r\n0\r\n\r\n"])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {})
        assert await r.readany() == b"abc"
        assert await r.readany() == b"de"
        assert await r.readany() == b""


async def test_close_delimited_body(pool):
    server, port, conns = await raw_server(lambda req: [b"HTTP/1.1 200 OK\r\n\r\nall of it", None])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {})
        assert await r.read() == b"all of it"
        r = await pool.post("127.0.0.1", port, "/x", b"x", {})  # a fresh connection
        assert await r.read() == b"all of it"
        assert len(conns) == 2


@pytest.mark.parametrize("pieces,match", [
    ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", None], "closed before the response ended"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", None], "closed before"),
    ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"], "bad chunk size"),
    ([b"SPDY/9 200 OK\r\n\r\n"], "bad status line"),
    ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "bad header line"),
    ([None], "closed before"),
])
async def test_broken_framing_raises(pool, pieces, match):
    server, port, _ = await raw_server(lambda req: pieces)
    async with server:
        with pytest.raises(H1Error, match=match):
            r = await pool.post("127.0.0.1", port, "/x", b"x", {})
            await r.read()


async def test_idle_timeout_between_chunks(pool):
    server, port, _ = await raw_server(lambda req: [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                                                    b"1\r\na\r\n", 5.0])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=0.2)
        assert await r.readany() == b"a"
        with pytest.raises(TimeoutError):
            await r.readany()
        r.close()


async def test_idle_bounds_each_wait_not_the_whole_stream(pool):
    """One idle timer per response, re-armed as it fires: chunks 0.1 s apart never time out with
    idle 0.25 s over a stream longer than that, a 1 s gap does, and a closed response leaves no
    timer behind (it would keep the response alive for `idle`)."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [head, b"1\r\na\r\n"] + [x for _ in range(5) for x in (0.1, b"1\r\nb\r\n")] + [1.0, b"0\r\n\r\n"]
    server, port, _ = await raw_server(lambda req: pieces)
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=0.25)
        got = b""
        with pytest.raises(TimeoutError):
            while True:
                got += await r.readany()
        assert got == b"abbbbb"
        r.close()
        assert r._timer is None
        r2 = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=5.0)   # read to its end: no timer left
        assert await r2.readany() == b"a"
        r2.close()
        assert r2._timer is None


async def test_connect_refused(pool):
    server, port, _ = await raw_server(lambda req: [])
    server.close()
    await server.wait_closed()
    with pytest.raises(OSError):
        await pool.post("127.0.0.1", port, "/x", b"x", {})


async def test_large_body_with_flow_control_against_aiohttp(pool):
    big = bytes(range(256)) * 40000  # ~10 MB, chunked by aiohttp

    async def handler(request: web.Request) -> web.StreamResponse:
        assert await request.read() == b"payload" * 1000
        r = web.StreamResponse()
        await r.prepare(request)
        for i in range(0, len(big), 65536):
            await r.write(big[i:i + 65536])
        await r.write_eof()
        return r

    app = web.Application()
    app.router.add_post("/big", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        r = await pool.post("127.0.0.1", port, "/big", b"payload" * 1000, {})
        got = bytearray()
        while chunk := await r.readany():
            got += chunk
            await asyncio.sleep(0)  # a slow reader: the transport pauses and resumes
        assert bytes(got) == big
    finally:
        await runner.cleanup()


def test_split_url():
    assert split_url("http://h:81/a/b") == ("h", 81, False, "/a/b")
    assert split_url("https://h") == ("h", 443, True, "")
    assert split_url("http://[::1]:9") == ("::1", 9, False, "")


async def test_a_connection_idle_past_idle_s_is_closed_not_reused():
    """Servers close idle keep-alive connections on their own clock (uvicorn: 5 s); the pool never
    sends on one idle longer than `idle_s`, so a request never meets the server's close."""
    server, port, conns = await raw_server(lambda req: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])
    pool = H1Pool(connect_timeout=2, idle_s=0.2)
    try:
        async with server:
            for _ in range(2):   # back to back: one connection, reused
                assert await (await pool.post("127.0.0.1", port, "/x", b"{}", {})).read() == b"ok"
            assert len(conns) == 1
            await asyncio.sleep(0.3)   # idle past idle_s: closed at the next use, a new one opened
            assert await (await pool.post("127.0.0.1", port, "/x", b"{}", {})).read() == b"ok"
            assert len(conns) == 2
            await asyncio.sleep(0.05)
            assert conns[0].is_closing()   # the stale one was closed, not left open
    finally:
        await pool.close()


async def test_relay_hands_every_piece_to_the_sink_and_reuses_the_connection(pool):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, conns = await raw_server(lambda req: [head, b"2\r\nab\r\n", 0.05, b"1\r\nc\r\n3\r\nde", 0.05,
                                                        b"f\r\n0\r\n\r\n"])
    async with server:
        for _ in range(2):
            r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)
            first = await r.readany()
            got = [first]
            await r.relay(got.append)
            assert b"".join(got) == b"abcdef" and len(got) >= 3    # pieces as they came, not one read
            assert r._timer is None
        assert len(conns) == 1                                       # read to its end: back to the pool


async def test_relay_idle_timeout_and_a_hold_is_not_idle(pool):
    """A relay whose upstream goes quiet for `idle` raises TimeoutError; one held by its sink
    (the client reads slowly) does not, and every byte arrives after `unhold`."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, _ = await raw_server(lambda req: [head, b"1\r\na\r\n", 5.0])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=0.2)
        with pytest.raises(TimeoutError):
            await r.relay(lambda b: None)
        r.close()
    pieces = [head, b"1\r\na\r\n"] + [b"1\r\nb\r\n"] * 5 + [b"0\r\n\r\n"]
    server, port, _ = await raw_server(lambda req: pieces)
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=0.2)
        got: list[bytes] = []

        def sink(b: bytes) -> None:
            got.append(b)
            if len(got) == 1:
                r.hold()
                asyncio.get_running_loop().call_later(0.6, r.unhold)   # held three times `idle`
        await r.relay(sink)
        assert b"".join(got) == b"abbbbb"


async def test_a_failing_sink_ends_the_relay_with_its_error(pool):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, conns = await raw_server(lambda req: [head, b"1\r\na\r\n", 0.05, b"1\r\nb\r\n", 0.05,
                                                        b"0\r\n\r\n"])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)

        def sink(b: bytes) -> None:
            raise ConnectionResetError("the client left")
        with pytest.raises(ConnectionResetError):
            await r.relay(sink)
        r.close()


def unframe(data: bytes, end: bool = False) -> bytes:
    """The payload of `data`, a run of whole chunks framed as `%x\\r\\n...\\r\\n` (with `end`, then the
    last chunk, no trailers); asserts that framing."""
    out, pos = [], 0
    if end:
        assert data.endswith(b"\r\n0\r\n\r\n")
        data = data[:-5]
    while pos < len(data):
        end = data.index(b"\r\n", pos)
        line = data[pos:end]
        assert line == b"%x" % int(line, 16) and int(line, 16) > 0, line
        size = int(line, 16)
        out.append(data[end + 2:end + 2 + size])
        assert data[end + 2 + size:end + 4 + size] == b"\r\n"
        pos = end + 4 + size
    return b"".join(out)


async def test_relay_framed_passes_whole_event_chunks_as_they_came_and_the_rest_parsed(pool):
    """`relay(framed=)`: whole chunks ending an event go to `framed` with their framing; a chunk
    that ends mid-event goes to `sink` parsed, and so do the chunks after it until one ends an event
    (the caller's pending bytes would go out after them otherwise). Upper-case sizes, extensions
    and a chunk split across reads are parsed too. Order and bytes are kept whole."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [head, 0.02, b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n", 0.02,
              b"7\r\ndata: 3\r\n", 0.02,                     # mid-event
              b"2\r\n\n\n\r\n", 0.02,                        # ends it (parsed: the state was mid-event)
              b"9\r\ndata: 4\n\n\r\n", 0.02,                 # framed again
              b"9\r\ndata: 5\n\n\r\nA\r\ndata: 66\n\n\r\n", 0.02,   # a hex size not as the mesh writes it
              b"9;x=1\r\ndata: 7\n\n\r\n", 0.02,             # an extension
              b"9\r\ndata:", 0.02, b" 8\n\n\r\n", 0.02,       # split across reads
              b"9\r\ndata: 9\n\n\r\n0\r\n\r\n"]
    server, port, conns = await raw_server(lambda req: pieces)
    async with server:
        for _ in range(2):
            r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)
            order: list[tuple[str, bytes]] = []
            await r.relay(lambda b: order.append(("sink", b)),
                          lambda b, end: order.append(("framed/end" if end else "framed", unframe(b, end))),
                          b"\n\n")
            assert b"".join(b for _, b in order) == (b"".join(b"data: %d\n\n" % i for i in range(1, 6))
                                                     + b"data: 66\n\ndata: 7\n\ndata: 8\n\ndata: 9\n\n")
            kinds = [k for k, _ in order]
            assert kinds[0] == "framed" and order[0][1] == b"data: 1\n\ndata: 2\n\n"
            assert ("sink", b"data: 3") in order and ("sink", b"\n\n") in order
            assert ("framed", b"data: 4\n\n") in order
            assert order[-1] == ("framed/end", b"data: 9\n\n")   # with the last chunk: the body ends there
            assert ("sink", b"data: 7\n\n") in order                      # the extension: parsed
            assert not any(k == "framed" and b"66" in b for k, b in order)   # "A": parsed, framed again by the mesh
        assert len(conns) == 1


async def test_relay_framed_needs_the_callers_state_at_an_event_end(pool):
    """Bytes read before `relay` that end mid-event: the next whole chunks go to `sink`, not `framed`."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, _ = await raw_server(lambda req: [head, b"5\r\ndata:\r\n", 0.05, b"4\r\n 1\n\n\r\n", 0.02,
                                                    b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)
        await asyncio.sleep(0.03)
        order: list[tuple[str, bytes]] = []
        await r.relay(lambda b: order.append(("sink", b)), lambda b, end: order.append(("framed", unframe(b, end))), b"\n\n")
        assert order == [("sink", b"data:"), ("sink", b" 1\n\n"), ("framed", b"data: 2\n\n")]


async def test_relay_framed_comes_back_after_a_read_that_ends_mid_chunk(pool):
    """A read that ends inside a chunk (its size line, data or CRLF): the next read's rest of that
    chunk is parsed and the whole chunks after it in the same read go to `framed` again (a held
    relay's reads all end mid-chunk; one split must not keep the rest off the framed path).
    `at_tail=False`: the caller's own bytes end mid-event, so the first chunk is parsed."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [head, 0.02, b"9\r\ndata: 1\n\n\r\n9\r\ndata:", 0.02,           # in a chunk's data
              b" 2\n\n\r\n9\r\ndata: 3\n\n\r\n9", 0.02,                       # in a size line
              b"\r\ndata: 4\n\n\r\n9\r\ndata: 5\n\n\r", 0.02,                # in a CRLF
              b"\n9\r\ndata: 6\n\n\r\n0\r\n\r\n"]
    server, port, _ = await raw_server(lambda req: pieces)
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)
        order: list[tuple[str, bytes]] = []
        await r.relay(lambda b: order.append(("sink", b)),
                      lambda b, end: order.append(("framed/end" if end else "framed", unframe(b, end))),
                      b"\n\n", at_tail=False)
        assert order == [("sink", b"data: 1\n\n"), ("sink", b"data:"), ("sink", b" 2\n\n"),
                         ("framed", b"data: 3\n\n"), ("framed", b"data: 4\n\n"), ("sink", b"data: 5\n\n"),
                         ("framed/end", b"data: 6\n\n")], order


async def test_relay_framed_failure_and_cut_mid_stream(pool):
    """A failing framed sink ends the relay with its error; an upstream cut after framed chunks
    raises H1Error (the caller then sends its error event after whole events only)."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, _ = await raw_server(lambda req: [head, 0.02, b"9\r\ndata: 1\n\n\r\n", 0.05,
                                                    b"9\r\ndata: 2\n\n\r\n"])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)

        def bad(b: bytes, end: bool) -> None:
            raise ConnectionResetError("the client left")
        with pytest.raises(ConnectionResetError):
            await r.relay(lambda b: None, bad, b"\n\n")
        r.close()
    server, port, _ = await raw_server(lambda req: [head, 0.02, b"9\r\ndata: 1\n\n\r\n", 0.05, None])
    async with server:
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, idle=2.0)
        got: list[bytes] = []
        with pytest.raises(H1Error):
            await r.relay(got.append, lambda b, end: got.append(unframe(b, end)), b"\n\n")
        assert got == [b"data: 1\n\n"]
        r.close()


async def test_post_deadline_bounds_head_and_body_until_cleared(pool):
    """`post(deadline=)`: a head that never comes and a body that stalls fail with TimeoutError at the
    deadline (the connection is not reused); after `clear_deadline` only `idle` bounds the waits."""
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    server, port, conns = await raw_server(lambda req: [0.5, head, b"1\r\na\r\n", 0.4, b"1\r\nb\r\n0\r\n\r\n"])
    async with server:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):   # no head within 0.2 s
            await pool.post("127.0.0.1", port, "/x", b"x", {}, deadline=t0 + 0.2)
        assert 0.15 < loop.time() - t0 < 0.45
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, deadline=loop.time() + 0.7)
        assert await r.readany() == b"a"
        with pytest.raises(TimeoutError):   # the body stalls past the deadline
            await r.readany()
        r.close()
        r = await pool.post("127.0.0.1", port, "/x", b"x", {}, deadline=loop.time() + 0.7, idle=2.0)
        assert await r.readany() == b"a"
        r.clear_deadline()
        assert await r.read() == b"b"     # past the old deadline: cleared
        assert len(conns) == 3            # the timed-out connections were not reused
