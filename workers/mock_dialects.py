"""The mock fleet speaking vLLM's and SGLang's PD dialects (see `mesh.dialects`).

What each mock checks is what the real engine needs from the mesh, so a test through the mesh
fails when the mesh sends the wrong thing:

- vllm prefill: `kv_transfer_params.do_remote_decode`, `max_tokens` 1, not streamed; it holds the
  prompt's blocks under a `remote_request_id` and answers vLLM's params (`do_remote_prefill`,
  `remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, `remote_request_id`,
  `tp_size`). vllm decode: reads those blocks from `remote_host:remote_port` (the prefill frees
  them once read, or after its TTL, as vLLM's abort timeout does) and writes every token itself.
- sglang prefill: `bootstrap_host`/`bootstrap_port` naming its own bootstrap server and a
  `bootstrap_room`; it holds the KV under the room until a decode claims it (or the TTL).
  sglang decode: waits at the bootstrap server for the room (the mesh must have sent the prefill
  the same room) and answers, streamed or not.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

import workers.mock as m
from mesh.request import render_prompt

if TYPE_CHECKING:
    from workers.mock import MockDecode, MockPrefill

VLLM_NEEDS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id")


def _prompt(kind: str, body: dict[str, Any]) -> str:
    return render_prompt(kind, body)  # type: ignore[arg-type]


def _one_token_checks(body: dict[str, Any]) -> web.Response | None:
    if (body.get("max_tokens") or body.get("max_completion_tokens")) != 1:
        return m._error(400, "a prefill leg must ask for max_tokens 1", "max_tokens")
    if body.get("stream"):
        return m._error(400, "a prefill leg must not be streamed", "stream")
    return None


async def _hold(w: "MockPrefill", request: web.Request, body: dict[str, Any], prompt: str,
                transfer_id: str) -> tuple[int, ...] | web.Response:
    n_tok = m._prompt_tokens(body, prompt)
    blocks = w.holder.pool.alloc(-(-n_tok // w.block_size))
    if blocks is None:
        return m._error(503, f"KV pool exhausted: {w.holder.pool.free} blocks free", None, code="kv_exhausted")
    try:
        await asyncio.sleep(w.delay(w.timing.prefill_ms_per_token * n_tok))
    except BaseException:
        w.holder.pool.release(blocks)
        raise
    w.holder.hold(transfer_id, blocks, request_id=request.headers.get("X-Request-Id", ""), consumers=1)
    return blocks


async def _pulled(w: "MockDecode", method: str, url: str, body: dict[str, Any] | None = None) -> bool:
    """The decode's KV fetch from the prefill side; a failure is counted on the engine."""
    try:
        async with w.http.request(method, url, json=body) as r:
            ok = r.status == 200
            await r.read()
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    if not ok:
        w.pulls_failed += 1
    return ok


# -- vllm -------------------------------------------------------------------------------------

async def vllm_prefill(w: "MockPrefill", request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
    kvp = body["kv_transfer_params"]
    if not kvp.get("do_remote_decode") or kvp.get("do_remote_prefill"):
        return m._error(400, "kv_transfer_params must ask for remote decode", "kv_transfer_params")
    bad = _one_token_checks(body)
    if bad is not None:
        return bad
    prompt = _prompt(kind, body)
    rid = f"{w.id}-{os.urandom(8).hex()}"
    blocks = await _hold(w, request, body, prompt, rid)
    if isinstance(blocks, web.Response):
        return blocks
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": w.id,
              "remote_block_ids": list(blocks), "remote_host": w.host, "remote_port": w.port,
              "remote_request_id": rid, "tp_size": 1}
    return await w.answer(request, kind, body, prompt, m.first_token(prompt), extra={"kv_transfer_params": params})


async def vllm_read(w: "MockPrefill", request: web.Request) -> web.Response:
    """The decode read the blocks (NIXL's read plus its notification): free them."""
    d = await request.json()
    rid, blocks = d.get("remote_request_id"), d.get("remote_block_ids")
    if w.holder.blocks_of(rid) is None or list(w.holder.blocks_of(rid) or ()) != blocks:
        return m._error(404, f"no blocks held for {rid!r}", "remote_request_id")
    w.holder.release_rank(rid, 0)
    return m._json({"read": len(blocks)})


async def vllm_decode(w: "MockDecode", request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
    kvp = body["kv_transfer_params"]
    for k in VLLM_NEEDS:
        if kvp.get(k) is None:
            return m._error(400, f"kv_transfer_params.{k} is missing", f"kv_transfer_params.{k}")
    url = f"http://{kvp['remote_host']}:{kvp['remote_port']}/mock/vllm/read"
    if not await _pulled(w, "POST", url, {"remote_request_id": kvp["remote_request_id"],
                                          "remote_block_ids": kvp["remote_block_ids"]}):
        return m._error(500, f"KV read from {kvp['remote_engine_id']} failed", None)
    prompt = _prompt(kind, body)
    return await w.answer(request, kind, body, prompt, m.first_token(prompt))


# -- sglang -----------------------------------------------------------------------------------

def _bootstrap(body: dict[str, Any]) -> tuple[str, int, int] | web.Response:
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if not isinstance(host, str) or not host:
        return m._error(400, "bootstrap_host is required", "bootstrap_host")
    if not isinstance(port, int) or isinstance(port, bool):
        return m._error(400, "bootstrap_port is required", "bootstrap_port")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 2 ** 63:
        return m._error(400, "bootstrap_room must be an integer in [0, 2^63)", "bootstrap_room")
    return host, port, room


async def sglang_prefill(w: "MockPrefill", request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
    boot = _bootstrap(body)
    if isinstance(boot, web.Response):
        return boot
    host, port, room = boot
    if (host, port) != (w.host, w.port):
        return m._error(400, f"bootstrap {host}:{port} is not this prefill's ({w.host}:{w.port})", "bootstrap_port")
    prompt = _prompt(kind, body)
    blocks = await _hold(w, request, body, prompt, f"room-{room}")
    if isinstance(blocks, web.Response):
        return blocks
    w.room_arrived(room)
    return await w.answer(request, kind, {**body, "max_tokens": 1, "stream": False}, prompt, m.first_token(prompt))


async def sglang_room(w: "MockPrefill", request: web.Request) -> web.Response:
    """The bootstrap server: a decode waits here for its room, then takes the KV."""
    room = int(request.match_info["room"])
    wait = min(float(request.query.get("wait", "10")), 60.0)
    if not await w.wait_room(room, wait):
        return m._error(404, f"room {room} never arrived", "bootstrap_room")
    tid = f"room-{room}"
    n = len(w.holder.blocks_of(tid) or ())
    w.holder.release_rank(tid, 0)
    return m._json({"room": room, "blocks": n})


async def sglang_decode(w: "MockDecode", request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
    boot = _bootstrap(body)
    if isinstance(boot, web.Response):
        return boot
    host, port, room = boot
    url = f"http://{host}:{port}/mock/sglang/room/{room}?wait={w.pull_deadline_s}"
    if not await _pulled(w, "GET", url):
        return m._error(500, f"KV for room {room} never arrived from {host}:{port}", None)
    prompt = _prompt(kind, body)
    return await w.answer(request, kind, body, prompt, m.first_token(prompt))
