"""A lean keep-alive HTTP/1.1 client for the two hot legs (prefill and decode).

Why not the app's aiohttp `ClientSession` here: measured on this project's 2-core machine,
one aiohttp client POST costs about 110 us of CPU against about 40 us for a plain asyncio
exchange; with two legs per request that was a quarter of the mesh's whole per-request CPU
(bench/overhead.py). Everything that is not per-request (health probes, releases, held
listings) still goes through the pooled `ClientSession`.

Scope, on purpose small: one request at a time per connection (no pipelining), bodies
framed by Content-Length, chunked transfer encoding, or connection close; connections
pooled per (host, port, tls) and reused only when the answer was read to its end.

Size: one client, connection pool and response reader that only make sense together; split, the
per-request path would cross module boundaries for no reader's gain.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from collections import deque
from typing import Any, Callable

from contract.snapshot import split_url
from mesh.pacer import Pacer, no_note

MAX_HEAD = 64 * 1024
HIGH_WATER = 1 << 20


class H1Error(ConnectionError):
    """The connection failed or the peer broke HTTP/1.1 framing."""


class _Conn(asyncio.Protocol):
    def __init__(self, pool: "H1Pool", key: tuple[str, int, bool]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.resp: H1Response | None = None
        self.idle_since = 0.0   # when it went back to the pool
        self.note = pool.note
        self.note_whole = pool.note_whole
        self.read_at = 0.0      # the last read of a relayed stream (`mesh.pacer`)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (type: ignore below) asyncio types a Protocol's transport as BaseTransport; a stream connection's is a Transport
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is not None:
            if resp._sink is not None:
                self.note(self)   # a read of a relayed stream (`mesh.pacer`)
            else:
                self.note_whole(self)   # a whole answer's or a head's read (`mesh.pacer`)
            if resp._framed is not None:
                resp._feed_framed(data)   # a relay's whole chunks, as they came
            else:
                resp._feed(data)
        else:  # bytes nobody asked for: the peer is confused; never reuse this connection
            self.abort()

    def eof_received(self) -> bool:
        self.closed = True
        if self.resp is not None:
            self.resp._eof()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.resp is not None:
            self.resp._eof(exc)
        self.pool._forget(self)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class H1Response:
    """Status and headers at once; the body through `read()` or `readany()`."""

    __slots__ = ("status", "headers", "_conn", "_buf", "_head_done", "_mode", "_left", "_chunks",
                 "_done", "_error", "_waiter", "_head_waiter", "_keep", "_buffered", "_paused", "_idle",
                 "_timer", "_wait_start", "_sink", "_held", "_framed", "_tail", "_at_tail", "_deadline")

    def __init__(self, conn: _Conn, idle: float | None, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._idle = idle
        self.status = 0
        self.headers: dict[str, str] = {}
        self._buf = bytearray()
        self._head_done = False
        self._mode = ""          # "length" | "chunked" | "close"
        self._left = 0           # bytes left in the body (length) or in this chunk (chunked)
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head_waiter: asyncio.Future[None] = loop.create_future()
        self._keep = True
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None   # the idle check (`readany`)
        self._deadline: asyncio.TimerHandle | None = None   # `post(deadline=)`, until `clear_deadline`
        self._wait_start = 0.0
        self._sink: Callable[[bytes], None] | None = None   # `relay`: body bytes go here as they are parsed
        self._held = False                                  # `relay`: the sink asked for a pause
        self._framed: Callable[[bytes, bool], None] | None = None  # `relay(framed=)`: whole chunks, framing kept
        self._tail = b""
        self._at_tail = False    # the last payload given to the sink ended with `_tail`

    # -- parsing (called by the protocol) ---------------------------------------------------

    def _feed(self, data: bytes) -> None:
        try:
            if not self._head_done:
                # the usual case, the head whole in the first read: found in `data` itself (the body
                # copied once, not three times: a prefill's 72 kB answer of block ids at 220 kB)
                buf = data if not self._buf else self._buf + data
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise H1Error("response head too large")
                    self._buf = bytearray(buf)
                    return
                self._head(bytes(buf[:end]))
                self._head_done = True
                data = bytes(buf[end + 4:])
                self._buf = bytearray()
                if not self._head_waiter.done():
                    self._head_waiter.set_result(None)
            if data:
                self._body(data)
        except H1Error as e:
            if self._done and self._error is None:
                self._keep = False   # the answer is whole; only the connection is spoiled
            else:
                self._fail(e)
            self._conn.abort()

    def _head(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise H1Error(f"bad status line {lines[0][:80]!r}")
        try:
            self.status = int(parts[1])
        except ValueError:
            raise H1Error(f"bad status code {parts[1][:10]!r}") from None
        h = self.headers
        for line in lines[1:]:
            k, sep, v = line.partition(":")
            if not sep:
                raise H1Error(f"bad header line {line[:80]!r}")
            h[k.strip().lower()] = v.strip()
        if parts[0] == "HTTP/1.0" or h.get("connection", "").lower() == "close":
            self._keep = False
        if "chunked" in h.get("transfer-encoding", "").lower():
            self._mode, self._left = "chunked", -1
        elif "content-length" in h:
            try:
                self._left = int(h["content-length"])
            except ValueError:
                raise H1Error("bad Content-Length") from None
            self._mode = "length"
            if self._left == 0 or self.status in (204, 304):
                self._finish()
        else:
            self._mode, self._keep = "close", False

    def _body(self, data: bytes) -> None:
        if self._done:
            raise H1Error("bytes after the end of the response")
        if self._mode == "length":
            if len(data) > self._left:
                raise H1Error("more bytes than Content-Length")
            self._left -= len(data)
            self._push(data)
            if self._left == 0:
                self._finish()
        elif self._mode == "close":
            self._push(data)
        else:
            self._chunked(data)

    def _chunked(self, data: bytes) -> None:
        if self._left == -1 and not self._buf:
            data = self._whole_chunks(data)
            if not data:
                return
        buf = self._buf
        buf += data
        pos = 0
        out = []
        while True:
            if self._left > 0:                      # inside a chunk's data
                take = min(self._left, len(buf) - pos)
                if take <= 0:
                    break
                out.append(bytes(buf[pos:pos + take]))
                pos += take
                self._left -= take
                if self._left == 0:
                    self._left = -2                 # its CRLF comes next
                continue
            if self._left == -2:                    # CRLF after a chunk
                if len(buf) - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise H1Error("chunk not followed by CRLF")
                pos += 2
                self._left = -1
                continue
            end = buf.find(b"\r\n", pos)            # a size line (or trailers after the last)
            if end < 0:
                if len(buf) - pos > 4096:
                    raise H1Error("chunk size line too long")
                break
            line = bytes(buf[pos:end])
            if self._left == -3:                    # trailers: until an empty line
                pos = end + 2
                if not line:
                    self._finish()
                    break
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise H1Error(f"bad chunk size {line[:20]!r}") from None
            pos = end + 2
            self._left = size if size else -3
        del buf[:pos]
        for c in out:
            self._push(c)
        if self._done and buf:
            raise H1Error("bytes after the last chunk")

    def _whole_chunks(self, data: bytes) -> bytes:
        """The common case of an SSE relay, each read whole chunks: pushed without the buffer
        (one slice each). Returns what is left for the general parser (a partial chunk, the last
        chunk and its trailers, anything odd)."""
        pos, n = 0, len(data)
        queue = self._sink is None   # nobody reads from here yet: the payloads are queued, one push
        out: list[bytes] = []
        while pos < n:
            end = data.find(b"\r\n", pos, pos + 4096)
            if end < 0:
                break
            try:
                size = int(data[pos:end].split(b";", 1)[0], 16)
            except ValueError:
                break   # the general parser raises on it
            stop = end + 2 + size
            if size <= 0 or stop + 2 > n or data[stop:stop + 2] != b"\r\n":
                break
            if queue:
                out.append(data[end + 2:stop])
            else:
                self._push(data[end + 2:stop])
                if self._done:   # a failed relay: what follows is dropped
                    return b""
            pos = stop + 2
        if out:
            self._push(out[0] if len(out) == 1 else b"".join(out))
        return data[pos:] if pos else data

    def _feed_framed(self, data: bytes) -> None:
        """`relay(framed=)`: a read that starts inside a chunk (the last read ended mid-chunk, as
        every read does once the relay was held and a whole socket buffer comes at once) goes to
        the parser only up to that chunk's end; what follows starts at a boundary and goes to
        `_pass`. Without this one split would keep every later read off the framed path."""
        while data:
            if self._framed is None or self._done:
                break
            buf, left = self._buf, self._left
            if left == -1 and buf:            # a partial size line: completed from this read
                data = bytes(buf) + data
                buf.clear()
            if left == -1:
                if not self._at_tail:
                    break
                data = self._pass(data)
                break
            if left > 0:
                need = left + 2               # the chunk's rest and its CRLF
            elif left == -2:
                need = 2 - len(buf)
            else:
                break                         # trailers: the parser's
            if len(data) <= need:
                break
            self._feed(data[:need])
            data = data[need:]
        if data:
            self._feed(data)

    def _pass(self, data: bytes) -> bytes:
        """`relay(framed=)`, at a chunk boundary: the longest run of whole chunks at the start of
        `data` goes to the framed sink as it came, one call, when each chunk is framed as this
        mesh frames one (lower-case hex size, no extension: the client gets valid framing) and its
        payload ends with `tail`; with the last chunk too where nothing else follows it (`end`
        True: the body is whole). Returns the rest, for the parser (a partial chunk, the last
        chunk with trailers, anything else)."""
        pos, n, tail = 0, len(data), self._tail
        while pos < n:
            end = data.find(b"\r\n", pos, pos + 10)
            if end < 0:
                break
            line = data[pos:end]
            try:
                size = int(line, 16)
            except ValueError:
                break
            stop = end + 2 + size
            if (size <= 0 or stop + 2 > n or data[stop:stop + 2] != b"\r\n" or b"%x" % size != line
                    or not data.endswith(tail, end + 2, stop)):
                break
            pos = stop + 2
        if not pos:
            return data
        if self._error is not None:
            return b""   # the relay has failed: the rest is dropped
        if self._idle is not None and self._waiter is not None:
            self._wait_start = self._waiter.get_loop().time()
        end = data.endswith(b"0\r\n\r\n") and pos == n - 5   # and the last chunk, no trailers: the end
        assert self._framed is not None
        try:
            self._framed(data if pos == n or end else data[:pos], end)
        except Exception as e:  # noqa: BLE001 - as `_push`: the sink's failure ends the relay
            self._fail(e)
            self._conn.abort()
            return b""
        if end:
            self._left = -3
            self._finish()
            return b""
        return data[pos:]

    def _push(self, data: bytes) -> None:
        if not data:
            return
        sink = self._sink
        if sink is not None:
            if self._error is not None:
                return   # the relay has failed: the rest is dropped
            if self._idle is not None and self._waiter is not None:
                self._wait_start = self._waiter.get_loop().time()   # bytes came: the idle clock restarts
            if self._framed is not None:
                self._at_tail = data.endswith(self._tail)
            try:
                sink(data)
            except Exception as e:  # noqa: BLE001 - the sink's failure (a client gone) ends the relay with it
                self._fail(e)
                self._conn.abort()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _eof(self, exc: BaseException | None = None) -> None:
        if self._done:
            return
        if self._head_done and self._mode == "close" and exc is None:
            self._finish()
            return
        self._fail(H1Error("connection closed before the response ended"
                           + (f": {exc}" if exc else "")))

    def _fail(self, e: BaseException) -> None:
        if self._error is None:   # the first failure is the one reported
            self._error = e
        self._done = True
        self._keep = False
        if not self._head_waiter.done():
            self._head_waiter.set_exception(e)
            self._head_waiter.exception()  # retrieved: the reader re-raises it from its own await
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- reading (called by the mesh) -------------------------------------------------------

    async def _wait_head(self) -> None:
        await self._head_waiter

    async def readany(self) -> bytes:
        """The next body bytes as they came; b"" at the end. `idle` bounds each wait."""
        while not self._chunks:
            if self._done:
                if self._error is not None:
                    raise self._error
                self._release()
                return b""
            try:
                await self._wait()
            finally:
                self._waiter = None
        return self._take()

    def _wait(self) -> asyncio.Future[None]:
        """A new waiter for the next bytes (or the end), the idle clock started: one timer per
        response, re-armed only when it fires early (not an asyncio.timeout per wait: an SSE relay
        waits once per upstream read, ~4 us each)."""
        loop = self._head_waiter.get_loop()
        self._waiter = loop.create_future()
        if self._idle is not None:
            self._wait_start = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._wait_start + self._idle, self._idle_check)
        return self._waiter

    def _take(self) -> bytes:
        """Everything queued, as one bytes object; reading resumes once the queue has drained."""
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._drain())
        self._buffered -= len(data)
        if self._paused and self._buffered < HIGH_WATER // 4 and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    async def relay(self, sink: Callable[[bytes], None], framed: Callable[[bytes, bool], None] | None = None,
                    tail: bytes = b"", at_tail: bool = True) -> None:
        """The rest of the body to `sink`, called from the connection's `data_received` as the bytes
        are parsed: no wake-up of a reading task per piece (an SSE relay's cost per event). Returns
        at the end; raises as `readany` (an upstream failure; TimeoutError after `idle` without a
        byte while not held); an exception from `sink` ends the relay and is raised here.

        `framed(data, end)` (a chunked body): whole chunks whose payloads end with `tail` go there
        with their framing, as they came (`_pass`), while the last payload given to `sink` ended
        with `tail` (so it starts so): a relay to a chunked client writes them as they are, not
        parsed and framed again per chunk. `end`: `data` ends with the body's last chunk
        (`0\r\n\r\n`, no trailers), whose bytes end the client's answer too. `at_tail`: whether
        what the caller already gave its sink ended with `tail` (a payload that does later puts the
        framed path back in use)."""
        if self._chunks:
            data = self._take()
            at_tail = data.endswith(tail)
            sink(data)
        if not self._done:
            self._sink = sink
            if framed is not None and tail and self._mode == "chunked":
                self._framed, self._tail, self._at_tail = framed, tail, at_tail
            try:
                await self._wait()
            finally:
                self._sink = self._framed = None
                self._waiter = None
        if self._error is not None:
            raise self._error
        self._release()

    def hold(self) -> None:
        """`relay`: stop reading from the upstream (the client reads slower than it writes)."""
        if not self._held and self._conn.transport is not None:
            self._held = True
            self._conn.transport.pause_reading()

    def unhold(self) -> None:
        if self._held:
            self._held = False
            if self._waiter is not None:
                self._wait_start = self._waiter.get_loop().time()   # the idle clock restarts
            if self._conn.transport is not None and not self._conn.closed:
                self._conn.transport.resume_reading()

    def _idle_check(self) -> None:
        """The idle timer fired: fail a wait that has lasted `idle`, else re-arm for the current
        wait's deadline (none waiting: the next wait arms it). A held relay is not idle."""
        self._timer = None
        w = self._waiter
        if w is None or w.done() or self._idle is None:
            return
        loop = w.get_loop()
        if self._held:
            self._timer = loop.call_at(loop.time() + self._idle, self._idle_check)
            return
        due = self._wait_start + self._idle
        if loop.time() >= due:
            w.set_exception(TimeoutError())
        else:
            self._timer = loop.call_at(due, self._idle_check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.clear_deadline()

    def _deadline_hit(self) -> None:
        """`post(deadline=)` passed before `clear_deadline`: the head or body wait fails with
        TimeoutError and the connection is not reused."""
        self._deadline = None
        if not self._done:
            self._fail(TimeoutError())
            self._conn.abort()

    def clear_deadline(self) -> None:
        """The caller has what `post(deadline=)` bounded (the head, the first bytes, the body)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _drain(self) -> list[bytes]:
        out = list(self._chunks)
        self._chunks.clear()
        return out

    async def read(self) -> bytes:
        parts: list[bytes] = []
        while True:
            b = await self.readany()
            if not b:
                return b"".join(parts)
            parts.append(b)

    def _release(self) -> None:
        self._stop_timer()
        conn = self._conn
        if conn.resp is self:
            conn.resp = None
            if self._keep and self._error is None and not conn.closed:
                conn.pool._put(conn)
            else:
                conn.abort()

    def close(self) -> None:
        """Done with this response: the connection goes back to the pool only if it was read to the end."""
        self._stop_timer()
        if self._done and not self._chunks:
            self._release()
        elif self._conn.resp is self:
            self._conn.resp = None
            self._conn.abort()


# under the shortest keep-alive timeout of the servers the mesh talks to (uvicorn's 5 s: vLLM, SGLang)
IDLE_S = 4.0


class H1Pool:
    """`idle_s`: a connection idle longer than this is not reused but closed. Servers close idle
    keep-alive connections on their own clock (uvicorn, so vLLM and SGLang: 5 s); a request sent on
    one the server is closing at that instant dies with a reset, whatever it was. Staying under the
    shortest such timeout, the mesh never sends on a connection the server may be closing."""

    def __init__(self, *, connect_timeout: float = 3.0, max_idle_per_host: int = 512, idle_s: float = IDLE_S,
                 pacer: Pacer | None = None) -> None:
        self.note = pacer.note if pacer is not None else no_note   # on every read of a relayed stream (`mesh.pacer`)
        self.note_whole = pacer.note_whole if pacer is not None else no_note   # on every other read
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle_per_host
        self.idle_s = idle_s
        self._idle: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._ssl: _ssl.SSLContext | None = None
        self._all: set[_Conn] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this pool serves (its connections are its): looked up at the first use only, as
        CPython 3.11's get_running_loop makes a getpid call each time."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def _get(self, host: str, port: int, tls: bool, connect_timeout: float | None = None) -> _Conn:
        key = (host, port, tls)
        idle = self._idle.get(key)
        loop = self.loop
        if idle:
            stale = loop.time() - self.idle_s
            while idle:
                c = idle.pop()
                if c.idle_since < stale:   # idle too long (and so is every older one): close it
                    c.abort()
                    continue
                if not c.closed and c.transport is not None and not c.transport.is_closing():
                    return c
        if tls and self._ssl is None:
            self._ssl = _ssl.create_default_context()
        conn = _Conn(self, key)
        async with asyncio.timeout(self.connect_timeout if connect_timeout is None
                                   else min(connect_timeout, self.connect_timeout)):
            await loop.create_connection(lambda: conn, host, port, ssl=self._ssl if tls else None)
        self._all.add(conn)
        return conn

    def _put(self, conn: _Conn) -> None:
        conn.idle_since = self.loop.time()
        lst = self._idle.setdefault(conn.key, [])
        if len(lst) < self.max_idle:
            lst.append(conn)
        else:
            conn.abort()

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        lst = self._idle.get(conn.key)
        if lst and conn in lst:
            lst.remove(conn)

    async def post(self, host: str, port: int, path: str, body: bytes | memoryview, headers: dict[str, str], *,
                   tls: bool = False, idle: float | None = None, deadline: float | None = None) -> H1Response:
        """Send a POST; return once the status line and headers arrived. `deadline` (the loop's
        clock): the connect, the head and every body wait fail with TimeoutError past it, until the
        caller calls `clear_deadline` (one timer, not an `asyncio.timeout` around the call: that
        costs ~5 us a leg in task bookkeeping)."""
        loop = self.loop
        conn = await self._get(host, port, tls, None if deadline is None else max(0.0, deadline - loop.time()))
        resp = H1Response(conn, idle, loop)
        conn.resp = resp
        if deadline is not None:
            resp._deadline = loop.call_at(deadline, resp._deadline_hit)
        head = [f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        assert conn.transport is not None
        # head and body as two buffers (one writev): a long prompt's body is not copied to join them
        conn.transport.writelines(("".join(head).encode("latin-1"), body))
        try:
            await resp._wait_head()
        except BaseException:
            resp.close()
            raise
        return resp

    async def close(self) -> None:
        for c in list(self._all):
            c.abort()
        self._all.clear()
        self._idle.clear()
        self._loop = None


__all__: list[Any] = ["H1Pool", "H1Response", "H1Error", "split_url"]
