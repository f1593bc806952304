"""The client's side of a generation request, behind one small interface.

Two servers answer the OpenAI routes: aiohttp (every route; `AioClient` wraps its request) and
`mesh.h1server` (the two hot routes on well-formed requests; `FastClient`). The request path
(`mesh.app.generate`, `mesh.proxy`) is written once against `Client`: the request's headers, its
body, a whole answer (`reply`) and a streamed one (`open_stream`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web


class Stream(Protocol):
    """An answer sent as it is made (SSE); its status and headers are out once it exists."""
    @property
    def status(self) -> int: ...

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self) -> None: ...


class Client(Protocol):
    @property
    def headers(self) -> Any: ...   # a case-insensitive mapping of the request's headers

    @property
    def complete(self) -> bool: ...   # the whole body has been read (`body` returns at once)

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...   # the loop serving it (no lookup per call)

    async def body(self, limit: int) -> bytes | memoryview: ...   # a view: `mesh.h1server` (no copy out of its read)

    def reply(self, body: bytes, status: int, headers: dict[str, str], close: bool = False) -> Any: ...

    async def open_stream(self, status: int, headers: dict[str, str]) -> Stream: ...


class AioClient:
    """aiohttp's request as a `Client`; its answers are aiohttp's (a stream: the prepared
    `StreamResponse`, which the route returns)."""

    __slots__ = ("request",)

    def __init__(self, request: web.Request) -> None:
        self.request = request

    @property
    def headers(self) -> Any:
        return self.request.headers

    @property
    def complete(self) -> bool:
        return False   # read through aiohttp's stream, under the body timeout

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    async def body(self, limit: int) -> bytes:
        """The body as one bytes object, copied at most once (the pieces joined; one piece as it
        came): aiohttp's `read()` grows a bytearray and copies it out again, two to three copies of
        a long prompt (bench/overhead.py --prompt-bytes). PayloadTooLarge past `limit` bytes."""
        from contract.errors import PayloadTooLarge

        pieces: list[bytes] = []
        size = 0
        content = self.request.content
        content.set_read_chunk_size(limit)   # as aiohttp's read(): no pause / resume cycles under the limit
        while chunk := await content.readany():
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes")
            pieces.append(chunk)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def reply(self, body: bytes, status: int, headers: dict[str, str], close: bool = False) -> web.Response:
        r = web.Response(body=body, status=status, headers=headers)
        if close:
            r.force_close()
        return r

    async def open_stream(self, status: int, headers: dict[str, str]) -> web.StreamResponse:
        r = web.StreamResponse(status=status, headers=headers)
        await r.prepare(self.request)
        return r
