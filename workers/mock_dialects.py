"""The mock fleet speaking vLLM's and SGLang's PD dialects (see `contract.dialects`): the real
prefill and decode adapters, with the hand-off of each engine in place of docs/protocol.md's.

What each mock checks is what the real engine needs from the mesh, so a test through the mesh
fails when the mesh sends the wrong thing:

- vllm prefill: `kv_transfer_params.do_remote_decode`, `max_tokens` 1, not streamed; it holds the
  prompt's blocks under a `remote_request_id` and answers vLLM's params (`do_remote_prefill`,
  `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`,
  `tp_size`), as vllm-project/vllm `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`
  (`request_finished`) builds them. vllm decode: reads those blocks from `remote_host:remote_port`
  (the prefill frees them once read, or after its TTL, as vLLM's abort timeout does) and writes
  every token itself (it samples the first token again from the pulled KV).
- sglang prefill: `bootstrap_host`/`bootstrap_port` naming its own bootstrap server and a
  `bootstrap_room`; it holds the KV under the room until a decode claims it (or the TTL), as
  sgl-project/sglang `python/sglang/srt/disaggregation/prefill.py` does. sglang decode: waits at
  the bootstrap server for the room (the mesh must have sent the prefill the same room) and
  answers, streamed or not.
The real engines' own answers are checked against their running code where one runs here
(tests/test_vllm_real.py, tests/test_vllm_mooncake.py) and against fakes citing their sources
(tests/fakes/).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from contract.dialects import ATOM, SGLANG, VLLM
from workers.choices import Choice
from workers.decode import DecodeServer
from workers.fake import first_token
from workers.openai_io import GenRequest
from workers.prefill import PrefillServer
from workers.server import EngineServer, error_response, json_response

VLLM_NEEDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id")


def _one_token_checks(gen: GenRequest) -> web.Response | None:
    if gen.params.max_tokens != 1:
        return error_response(400, "a prefill leg must ask for max_tokens 1", "max_tokens")
    if gen.stream:
        return error_response(400, "a prefill leg must not be streamed", "stream")
    return None


class _Client:
    """vllm / sglang decode: the engine's own client to the prefill side (KV reads, rooms)."""

    _http: aiohttp.ClientSession | None = None
    pull_deadline_s: float
    pulls_failed: int

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.pull_deadline_s + 5))
        return self._http

    async def fetched(self, method: str, url: str, body: dict[str, Any] | None = None) -> bool:
        """The decode's KV fetch from the prefill side; a failure is counted on the engine."""
        try:
            async with self.http.request(method, url, json=body) as r:
                ok = r.status == 200
                await r.read()
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if not ok:
            self.pulls_failed += 1
        return ok

    async def close_http(self) -> None:
        if self._http is not None:
            await self._http.close()

    async def stop(self) -> None:   # before the adapter's own stop (the next class in the MRO)
        await self.close_http()
        await super().stop()  # type: ignore[misc]  # the mixin runs before the adapter class in the MRO


# -- vllm -------------------------------------------------------------------------------------

class VllmPrefill(PrefillServer):
    dialect = VLLM

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/mock/vllm/read", self._read)

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if not isinstance(kvp, dict):
            return await EngineServer.handle(self, request, gen, body)
        if not kvp.get("do_remote_decode") or kvp.get("do_remote_prefill"):
            return error_response(400, "kv_transfer_params must ask for remote decode", "kv_transfer_params")
        bad = _one_token_checks(gen)
        if bad is not None:
            return bad
        rid = f"{self.id}-{os.urandom(8).hex()}"
        got = await self.prefill_and_hold(request, gen, rid)
        if isinstance(got, web.Response):
            return got
        seq, o = got
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.id,
                  "remote_block_ids": list(seq.blocks), "remote_host": self.host, "remote_port": self.port,
                  "remote_request_id": rid, "tp_size": 1}
        return self.first_token_answer(request, gen, o, {"kv_transfer_params": params})

    async def _read(self, request: web.Request) -> web.Response:
        """The decode read the blocks (NIXL's read plus its notification): free them."""
        try:
            d = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return error_response(400, "body is not JSON")
        rid, blocks = (d.get("remote_request_id"), d.get("remote_block_ids")) if isinstance(d, dict) else (None, None)
        held = self.holder.blocks_of(rid) if isinstance(rid, str) else None
        if held is None or rid is None or list(held) != blocks:
            return error_response(404, f"no blocks held for {rid!r}", "remote_request_id")
        self.holder.release_rank(rid, 0)
        return json_response({"read": len(held)})


class VllmDecode(_Client, DecodeServer):
    dialect = VLLM

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if not (isinstance(kvp, dict) and kvp.get("do_remote_prefill")):
            return await EngineServer.handle(self, request, gen, body)
        for k in VLLM_NEEDS:
            if kvp.get(k) is None:
                return error_response(400, f"kv_transfer_params.{k} is missing", f"kv_transfer_params.{k}")
        url = f"http://{kvp['remote_host']}:{kvp['remote_port']}/mock/vllm/read"

        async def read(dst: list[int]) -> web.StreamResponse | None:
            if await self.fetched("POST", url, {"remote_request_id": kvp["remote_request_id"],
                                                "remote_block_ids": kvp["remote_block_ids"]}):
                return None
            return error_response(500, f"KV read from {kvp['remote_engine_id']} failed")

        return await _continue(self, request, gen, read)


# -- sglang -----------------------------------------------------------------------------------

def _bootstrap(body: dict[str, Any]) -> tuple[str, int, int] | web.Response:
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if not isinstance(host, str) or not host:
        return error_response(400, "bootstrap_host is required", "bootstrap_host")
    if not isinstance(port, int) or isinstance(port, bool):
        return error_response(400, "bootstrap_port is required", "bootstrap_port")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2 ** 63:
        return error_response(400, "bootstrap_room must be an integer in [0, 2^63)", "bootstrap_room")
    return host, port, room


class SglangPrefill(PrefillServer):
    dialect = SGLANG

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.rooms: dict[int, asyncio.Event] = {}  # bootstrap rooms that arrived or are awaited

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/mock/sglang/room/{room:[0-9]+}", self._room)

    def expired(self, transfer_id: str) -> None:
        if transfer_id.startswith("room-"):
            self.rooms.pop(int(transfer_id[5:]), None)

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        if "bootstrap_room" not in body:
            return await EngineServer.handle(self, request, gen, body)
        boot = _bootstrap(body)
        if isinstance(boot, web.Response):
            return boot
        host, port, room = boot
        if (host, port) != (self.host, self.port):
            return error_response(400, f"bootstrap {host}:{port} is not this prefill's ({self.host}:{self.port})",
                                  "bootstrap_port")
        got = await self.prefill_and_hold(request, gen, f"room-{room}")
        if isinstance(got, web.Response):
            return got
        self.rooms.setdefault(room, asyncio.Event()).set()
        return self.first_token_answer(request, gen, got[1], None)

    async def _room(self, request: web.Request) -> web.Response:
        """The bootstrap server: a decode waits here for its room, then takes the KV."""
        room = int(request.match_info["room"])
        try:
            wait = min(float(request.query.get("wait", "10")), 60.0)
        except ValueError:
            return error_response(400, "wait must be a number", "wait")
        ev = self.rooms.setdefault(room, asyncio.Event())
        tid = f"room-{room}"
        try:
            async with asyncio.timeout(wait):
                await ev.wait()
        except TimeoutError:
            return error_response(404, f"room {room} never arrived", "bootstrap_room")
        finally:
            if not ev.is_set() or self.holder.blocks_of(tid) is not None:
                self.rooms.pop(room, None)  # claimed now, or given up
        n = len(self.holder.blocks_of(tid) or ())
        self.holder.release_rank(tid, 0)
        return json_response({"room": room, "blocks": n})


class SglangDecode(_Client, DecodeServer):
    dialect = SGLANG

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        if "bootstrap_room" not in body:
            return await EngineServer.handle(self, request, gen, body)
        boot = _bootstrap(body)
        if isinstance(boot, web.Response):
            return boot
        host, port, room = boot
        url = f"http://{host}:{port}/mock/sglang/room/{room}?wait={self.pull_deadline_s}"

        async def claim(dst: list[int]) -> web.StreamResponse | None:
            if await self.fetched("GET", url):
                return None
            return error_response(500, f"KV for room {room} never arrived from {host}:{port}")

        return await _continue(self, request, gen, claim)


async def _continue(w: DecodeServer, request: web.Request, gen: GenRequest, fetch: Any) -> web.StreamResponse:
    """vLLM's and SGLang's decodes: the KV lands in new blocks, the engine samples the first token
    again from it and writes every token itself."""
    if gen.n != 1:
        return error_response(400, "n must be 1 on a PD decode leg", "n")
    first = first_token(gen.prompt, gen.params.seed)
    got = await w.continue_from_kv(gen, -(-len(gen.prompt) // w.tp.cfg.block_size), first, fetch)
    if isinstance(got, web.StreamResponse):
        return got
    seq_id, q = got
    return await w.respond(request, gen, [Choice(0, seq_id, q, [first])])


PREFILL: dict[str, type[PrefillServer]] = {ATOM: PrefillServer, VLLM: VllmPrefill, SGLANG: SglangPrefill}
DECODE: dict[str, type[DecodeServer]] = {ATOM: DecodeServer, VLLM: VllmDecode, SGLANG: SglangDecode}
