"""The client side of the two hot routes without aiohttp's server.

Why: aiohttp's request and response objects cost the mesh, per request, about 36 us of its CPU
for a JSON answer and about 0.12 ms for a 64-event SSE stream against a plain asyncio protocol
(measured side by side, docs/benchmarks.md); the mesh's own work per request is ~0.3 ms.

What this server takes: `POST /v1/completions` and `POST /v1/chat/completions`, HTTP/1.1, a body
framed by Content-Length (over the body limit: a 413 once the API key is checked, the body never
read), no `Transfer-Encoding`, no `Expect` other than `100-continue` (answered at once, as aiohttp
does). Anything else on the connection (another route, a
malformed or oversized head, a repeated framing header, chunked uploads, HTTP/1.0)
is handed, with the bytes already read, to aiohttp's own protocol for the rest of the connection:
aiohttp keeps answering every other route, and every odd case, as before. Requests are answered
one at a time per connection, in order (pipelined requests wait their turn; a client that sends
more than `PIPELINE_LIMIT` bytes ahead is paused).

Kept from the aiohttp path: the route's handler is `mesh.app.generate` (API keys before the body,
admission, errors, request ids, metrics, tracing), the body timeout (`generate`), a client that
leaves cancels its request (handler cancellation), keep-alive and head deadlines (`keepalive_s`
after the connection opened or its last answer, as `mesh.app.start_site` documents), write
back-pressure, and a 408/413 closing the connection after at most `LINGER_S` of the rest read and
dropped.

Size: one protocol and the small answer types it writes; they only make sense together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Awaitable, Callable

from contract.errors import PayloadTooLarge, error_body
from mesh.pacer import Pacer

log = logging.getLogger(__name__)

HOT = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
MAX_HEAD = 8190            # as aiohttp's line limit: a head past it goes to aiohttp, which refuses it
PIPELINE_LIMIT = 1 << 20   # bytes buffered past the request being answered before reading pauses (plus one read)
LINGER_S = 1.0
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_date: list[Any] = [0, b""]


def _http_date() -> bytes:
    now = int(time.time())
    if _date[0] != now:
        _date[0], _date[1] = now, formatdate(now, usegmt=True).encode()
    return _date[1]  # type: ignore[no-any-return]  # the cache holds bytes at index 1


def _head(status: int, headers: dict[str, str], extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))]
    for k, v in headers.items():
        lines.append(f"{k}: {v}\r\n".encode("latin-1"))
    lines.append(b"Date: " + _http_date() + b"\r\n")
    lines.append(extra)
    return b"".join(lines)


class Headers(dict[str, str]):
    """The request's headers, names lower-cased; looked up in any case."""

    def __getitem__(self, k: str) -> str:
        return dict.__getitem__(self, k.lower())

    def __contains__(self, k: object) -> bool:
        return isinstance(k, str) and dict.__contains__(self, k.lower())

    def get(self, k: str, default: Any = None) -> Any:   # a lookup in any case
        return dict.get(self, k.lower(), default)


class Reply:
    """A whole answer: written by the server once the handler returns it."""
    __slots__ = ("status", "body", "headers", "close")

    def __init__(self, body: bytes, status: int, headers: dict[str, str], close: bool) -> None:
        self.body, self.status, self.headers, self.close = body, status, headers, close


class FastStream:
    """A chunked answer, written as the handler goes. Its head goes out with its first bytes
    (one send, not two: the first write follows the head at once on every path)."""
    __slots__ = ("_conn", "status", "_ended", "_head")

    def __init__(self, conn: "Conn", status: int, head: bytes) -> None:
        self._conn, self.status, self._ended, self._head = conn, status, False, head

    def _send(self, t: asyncio.Transport, data: bytes) -> None:
        head = self._head
        if head:
            self._head = b""
            if len(data) < 65536:
                t.write(head + data)
            else:
                t.writelines((head, data))
        else:
            t.write(data)

    async def write(self, data: bytes) -> None:
        if self.write_now(data):
            await self._conn.drained()

    def write_now(self, data: bytes) -> bool:
        """Write without waiting (from an upstream's `data_received`); True while the client's
        buffer is full (the caller stops reading its source until `on_resume`)."""
        c = self._conn
        t = c.open_transport()
        if data:
            self._send(t, b"%x\r\n%b\r\n" % (len(data), data) if len(data) < 65536
                       else b"".join((b"%x\r\n" % len(data), data, b"\r\n")))
        return c.paused

    def write_framed(self, data: bytes, end: bool = False) -> bool:
        """As `write_now`, for bytes already framed as chunks (`H1Response.relay(framed=)`: an
        upstream's chunks checked whole and framed as this server frames them); `end`: they end
        with the last chunk, which ends this answer (`write_eof` then writes nothing)."""
        c = self._conn
        self._send(c.open_transport(), data)
        if end:
            self._ended = True
        return c.paused

    def on_resume(self, fn: Callable[[], None]) -> None:
        """Call `fn` once the client's buffer drains (at once if it has)."""
        c = self._conn
        if not c.paused:
            fn()
        else:
            c.resumers.append(fn)

    async def write_eof(self) -> None:
        if self._ended:
            return
        self._ended = True
        self._send(self._conn.open_transport(), b"0\r\n\r\n")


class FastClient:
    """One request on a `Conn`, as `mesh.downstream.Client`."""
    __slots__ = ("_conn", "headers", "_body", "_need", "_waiter", "stream", "_over")

    def __init__(self, conn: "Conn", headers: Headers, need: int, over: bool = False) -> None:
        self._conn, self.headers, self._need, self._over = conn, headers, need, over
        self._body: list[bytes | memoryview] = []
        self._waiter: asyncio.Future[None] | None = None
        self.stream: FastStream | None = None

    def _feed(self, data: bytes | memoryview) -> bytes:
        """Take this request's part of `data` (a view: the body as it came in the head's read, not
        copied out of it); returns the rest (the next request's bytes)."""
        if self._over:
            return b""   # a body over the limit is never read: dropped until the connection closes
        if len(data) <= self._need:
            self._body.append(data)
            self._need -= len(data)
            rest = b""
        else:
            self._body.append(data[:self._need])
            rest = bytes(data[self._need:])
            self._need = 0
        if not self._need and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        return rest

    @property
    def complete(self) -> bool:
        return not self._need and not self._over

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._conn.loop

    async def body(self, limit: int) -> bytes | memoryview:
        """The body: one piece as it came (a view of the head's read where it came with the head),
        more pieces joined."""
        if self._over:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
        if self._need:
            self._waiter = self._conn.loop.create_future()
            await self._waiter
        b = self._body
        return b[0] if len(b) == 1 else b"".join(b)

    def reply(self, body: bytes, status: int, headers: dict[str, str], close: bool = False) -> Reply:
        return Reply(body, status, headers, close)

    async def open_stream(self, status: int, headers: dict[str, str]) -> FastStream:
        c = self._conn
        c.open_transport()   # ConnectionResetError once the client has left
        self.stream = FastStream(c, status, _head(status, headers, b"Transfer-Encoding: chunked\r\n\r\n"))
        return self.stream


Handler = Callable[[str, FastClient], Awaitable[Any]]


class Conn(asyncio.Protocol):
    """One client connection: requests parsed here while they are the hot routes' plain case."""

    def __init__(self, server: "FastServer") -> None:
        self.srv = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""              # bytes not yet taken by a request
        self.req: FastClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.closing = False
        self.paused = False         # the transport's write buffer is full
        self.reading = True
        self._drain: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.keep_alive = True
        self.resumers: list[Callable[[], None]] = []   # `FastStream.on_resume`
        # the loop, looked up once per connection: CPython 3.11's get_running_loop makes a getpid
        # call each time (~19 a request on the hot path before: bench/overhead.py, perf stat)
        self.loop = asyncio.get_running_loop()

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (type: ignore below) asyncio types a Protocol's transport as BaseTransport; a stream connection's is a Transport
        self.transport = transport  # type: ignore[assignment]
        self.srv.conns.add(self)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return               # lingering after a 408 / 413: the rest is dropped
        req = self.req
        if req is not None:
            if not req.complete:
                data = req._feed(data)
                if not data:
                    return
            self.buf += data     # pipelined: the next request waits for this answer
            if len(self.buf) > PIPELINE_LIMIT and self.reading and self.transport is not None:
                self.reading = False
                self.transport.pause_reading()
            return
        self.buf = self.buf + data if self.buf else data
        self._next()

    def eof_received(self) -> bool:
        return False             # the transport closes: a running request is cancelled in connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.srv.conns.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()   # the client left: its request is cut (both legs, the KV released)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client left"))
        self.transport = None

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None
        fns, self.resumers = self.resumers, []
        for fn in fns:
            fn()

    def open_transport(self) -> asyncio.Transport:
        """The transport to write an answer to; ConnectionResetError once the client has left."""
        if self.transport is None or self.closing:
            raise ConnectionResetError("the client left")
        return self.transport

    async def drained(self) -> None:
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain

    # -- requests ---------------------------------------------------------------------------

    def _arm(self) -> None:
        """The deadline for the next whole head (keep-alive idle, or a head trickled slowly)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.srv.keepalive_s, self._idle)

    def _idle(self) -> None:
        self._timer = None
        if self.req is None and self.transport is not None:
            self.closing = True
            self.transport.close()

    def _next(self) -> None:
        """Start the request at the head of `buf` when its head is whole; else wait for more."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n", 0, MAX_HEAD + 4)
        if end < 0:
            if len(buf) > MAX_HEAD or b"\n\n" in buf or b"\n\r\n" in buf:   # too long, or bare-LF lines
                self._hand_over()
            return
        try:
            head = buf[:end].decode("latin-1")
        except UnicodeDecodeError:   # pragma: no cover - latin-1 decodes every byte
            self._hand_over()
            return
        lines = head.split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or parts[0] != "POST" or parts[2] != "HTTP/1.1":
            self._hand_over()
            return
        kind = HOT.get(parts[1].encode("latin-1"))
        if kind is None:
            self._hand_over()
            return
        headers = Headers()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            name = name.lower()
            # anything odd (no colon, folded or spaced names, a repeated framing header) is aiohttp's to refuse
            if (not sep or not name or name != name.strip() or not name.isascii() or not name.isprintable()
                    or " " in name or not value.isprintable()
                    or (name in headers and name in ("content-length", "host", "authorization"))):
                self._hand_over()
                return
            headers[name] = value.strip(" \t")
        cl = headers.get("content-length", "0")
        expect = headers.get("expect")
        if ("transfer-encoding" in headers or not cl.isdigit() or not cl.isascii()
                or (expect is not None and expect.lower() != "100-continue")):
            self._hand_over()   # (aiohttp answers another expectation with its 417)
            return
        over = int(cl) > self.srv.max_body   # refused (413) once the API key is checked; the body never read
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        conn_hdr = headers.get("connection", "").lower()
        self.keep_alive = "close" not in conn_hdr
        req = self.req = FastClient(self, headers, 0 if over else int(cl), over)
        if expect is not None and not over and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")   # curl's large uploads wait for it
        # the body that came with the head: a view, not a copy (a 220 kB prompt's bytes copied once
        # less; a short one is cheaper copied than viewed)
        rest = buf[end + 4:] if len(buf) - end < 16384 else memoryview(buf)[end + 4:]
        self.buf = b""
        if rest:
            rest = req._feed(rest)
            self.buf = rest
        self.task = self.loop.create_task(self._run(kind, req))

    async def _run(self, kind: str, req: FastClient) -> None:
        pacer = self.srv.pacer
        pacer.active += 1
        if pacer.active > pacer.peak:
            pacer.peak = pacer.active
        t0 = time.monotonic()
        try:
            ans = await self.srv.handler(kind, req)
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001 - the boundary, as mesh.app's error middleware
            log.exception("unhandled error on POST %s", kind)
            if req.stream is None:
                ans = Reply(error_body("internal error in the mesh", "server_error"), 500,
                            {"Content-Type": "application/json"}, False)
            else:
                ans = None
        finally:
            pacer.active -= 1
            pacer.finished(time.monotonic() - t0)
        t = self.transport
        if t is None or self.closing:
            return
        if req.stream is not None:   # a stream: written, ended by the handler (or cut: then the connection)
            if not req.stream._ended:
                self._close(t)
                return
        elif isinstance(ans, Reply):
            close = ans.close or not self.keep_alive or not req.complete
            try:
                head = _head(ans.status, ans.headers, b"Content-Length: %d\r\n%s\r\n" % (
                    len(ans.body), b"Connection: close\r\n" if close else b""))
            except UnicodeEncodeError:   # pragma: no cover - the mesh's own headers are ASCII
                log.exception("unwritable answer headers")
                self._close(t)
                return
            if len(ans.body) < 65536:
                t.write(head + ans.body)
            else:
                t.writelines((head, ans.body))
            if close:
                self._close(t, linger=not req.complete)
                return
        else:   # pragma: no cover - generate answers a Reply or a stream
            self._close(t)
            return
        if not self.keep_alive:
            self._close(t)
            return
        self.req = None
        self.task = None
        if not self.reading:
            self.reading = True
            t.resume_reading()
        self._arm()
        if self.buf:
            self._next()

    def _close(self, t: asyncio.Transport, linger: bool = False) -> None:
        """Close after what was written; `linger`: the body was not all read, so read and drop the
        rest for up to `LINGER_S` first (closing on unread bytes resets the connection, and the
        client would lose the answer)."""
        self.closing = True
        if linger:
            if not self.reading:
                self.reading = True
                t.resume_reading()
            self.loop.call_later(LINGER_S, t.close)
        else:
            t.close()

    def _hand_over(self) -> None:
        """The rest of this connection is aiohttp's, starting with the bytes read so far."""
        t = self.transport
        if t is None:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.srv.conns.discard(self)
        self.srv.handed += 1
        proto = self.srv.aiohttp()
        t.set_protocol(proto)
        proto.connection_made(t)
        buf, self.buf = self.buf, b""
        self.transport = None
        if not self.reading:
            t.resume_reading()
        if buf:
            proto.data_received(buf)


class FastServer:
    """The protocol factory: `Conn`s for the hot routes, aiohttp's protocol (`aiohttp`, a factory)
    for what they hand over. `pacer` (`mesh.pacer`): counts the requests in flight."""

    def __init__(self, handler: Handler, aiohttp: Callable[[], asyncio.Protocol], keepalive_s: float,
                 max_body: int, pacer: Pacer | None = None) -> None:
        self.handler = handler
        self.pacer = pacer if pacer is not None else Pacer(0.0)
        self.aiohttp = aiohttp
        self.keepalive_s = keepalive_s
        self.max_body = max_body
        self.conns: set[Conn] = set()
        self.handed = 0   # connections given to aiohttp (tests read it)

    def __call__(self) -> Conn:
        return Conn(self)

    async def shutdown(self, timeout: float) -> None:
        """Close idle connections; give requests in flight `timeout` to finish, then cancel them."""
        for c in list(self.conns):
            if c.req is None and c.transport is not None:
                c.closing = True
                c.transport.close()
        tasks = [c.task for c in self.conns if c.task is not None and not c.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
