"""A fake SGLang PD pair that meets on bootstrap rooms as SGLang's code does. Mirrors
sgl-project/sglang at these commits:

- `python/sglang/srt/disaggregation/mini_lb.py` @ bda7cc08f1436047a48b794fc78b86f8103a935b: the
  router adds `bootstrap_host`, `bootstrap_port`, `bootstrap_room` (random in [0, 2**63)) to the body
  and posts it to the prefill and the decode at once; a batch (a list of prompts) carries lists of
  each, one room per prompt; the decode's answer is the client's.
- `python/sglang/srt/disaggregation/decode.py` @ 278e503a5e16252fb4ff513018b6a73e30976f63: the
  decode's receiver gets `bootstrap_addr=f"{req.bootstrap_host}:{req.bootstrap_port}"`.
- `python/sglang/srt/disaggregation/common/conn.py` @ ad7733e47421ebbed796513921a7b39e8be0a697:
  `CommonKVReceiver` asks `http://{bootstrap_addr}/route?engine_rank=-1&target_dp_group=-1` for the
  prefill's parallel sizes, then `/route?engine_rank=R&target_dp_group=G` (G = room % dp_size) for
  the prefill rank's `rank_ip`/`rank_port`; `CommonKVBootstrapServer` serves `/route` (PUT from
  prefill ranks, GET for decodes). An IPv6 host must therefore come in brackets: `::1:8998` is no
  address; a failed bootstrap fails the request on the decode.

The KV plane between the fakes is a stand-in (`GET /room/{room}` on the prefill rank's port in place
of the ZMQ/Mooncake sender); the OpenAI bodies are the mock fleet's (deterministic tokens), since
the mesh relays the decode's answer untouched.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from mesh.request import render_prompt
from workers.mock import first_token, token_ids, token_text

SOURCE = "sgl-project/sglang@bda7cc08 (mini_lb.py), @278e503a (decode.py), @ad7733e4 (common/conn.py)"


def _err(status: int, message: str) -> web.Response:
    return web.Response(body=orjson.dumps({"object": "error", "message": message, "type": "BadRequestError"
                                           if status == 400 else "InternalServerError", "param": None,
                                           "code": status}), status=status, content_type="application/json")


class SglangServer:
    def __init__(self, role: str, *, model: str = "sglang-model", host: str = "127.0.0.1") -> None:
        assert role in ("prefill", "decode")
        self.role, self.model, self.host = role, model, host
        self.url = ""
        self.bootstrap_port = 0
        self.rank_port = 0
        self.bodies: list[dict[str, Any]] = []
        self.route_gets: list[str] = []            # prefill: /route queries its bootstrap server saw
        self.bootstrap_errors: list[str] = []      # decode: bootstrap failures
        self.rooms: dict[int, asyncio.Event] = {}  # prefill: rooms whose KV is ready
        self._runners: list[web.AppRunner] = []
        self._http: aiohttp.ClientSession | None = None

    def _netloc(self, port: int) -> str:
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    async def start(self) -> "SglangServer":
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self.url = f"http://{self._netloc(await self._serve(app))}"
        if self.role == "prefill":
            boot = web.Application()
            boot.router.add_route("*", "/route", self._route)
            self.bootstrap_port = await self._serve(boot)
            rank = web.Application()
            rank.router.add_get("/room/{room}", self._room)
            self.rank_port = await self._serve(rank)
        self._http = aiohttp.ClientSession()
        return self

    async def _serve(self, app: web.Application) -> int:
        r = web.AppRunner(app, access_log=None)
        await r.setup()
        site = web.TCPSite(r, self.host, 0)
        await site.start()
        self._runners.append(r)
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        for r in self._runners:
            await r.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": "sglang"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    # -- prefill side: bootstrap server and KV sender -------------------------------------------

    async def _route(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405)
        er, dg = request.query.get("engine_rank"), request.query.get("target_dp_group")
        self.route_gets.append(request.query_string)
        if not er or not dg:
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if int(er) == -1 and int(dg) == -1:
            return web.json_response({"prefill_tp_size": 1, "prefill_dp_size": 1})
        return web.json_response({"rank_ip": self.host, "rank_port": self.rank_port})

    async def _room(self, request: web.Request) -> web.Response:
        ev = self.rooms.setdefault(int(request.match_info["room"]), asyncio.Event())
        await asyncio.wait_for(ev.wait(), 10)
        return web.json_response({"ok": True})

    # -- OpenAI routes ------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        p = body.get("prompt")
        prompts = p if isinstance(p, list) and p and isinstance(p[0], str) else [p]
        return await self._generate(request, "completions", body, [render_prompt("completions", {"prompt": x})
                                                                   for x in prompts])

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = body.get("n") or 1
        return await self._generate(request, "chat", body, [render_prompt("chat", body)] * n)

    async def _generate(self, request: web.Request, kind: str, body: dict[str, Any],
                        prompts: list[str]) -> web.StreamResponse:
        self.bodies.append(body)
        rooms = body.get("bootstrap_room")
        hosts, ports = body.get("bootstrap_host"), body.get("bootstrap_port")
        if rooms is None:
            return _err(400, "disaggregation mode needs bootstrap_room")
        if not isinstance(rooms, list):
            rooms, hosts, ports = [rooms], [hosts], [ports]
        if len(rooms) != len(prompts):
            return _err(400, f"{len(prompts)} requests but {len(rooms)} bootstrap rooms")
        if self.role == "prefill":
            for r in rooms:
                self.rooms.setdefault(r, asyncio.Event()).set()
            toks = [[first_token(p)] for p in prompts]
        else:
            for host, port, room in zip(hosts, ports, rooms):
                err = await self._bootstrap(host, port, room)
                if err:
                    self.bootstrap_errors.append(err)
                    return _err(500, f"KV transfer failed for room {room}: {err}")
            n = body.get("max_tokens") or 16
            toks = [token_ids(first_token(p), n) for p in prompts]
        return await self._answer(request, kind, body, prompts, toks)

    async def _bootstrap(self, host: Any, port: Any, room: int) -> str:
        """CommonKVReceiver: the parallel sizes, then the rank's address, then the KV of the room."""
        bootstrap_addr = f"{host}:{port}"
        assert self._http is not None
        try:
            async with self._http.get(f"http://{bootstrap_addr}/route?engine_rank=-1&target_dp_group=-1") as r:
                info = await r.json()
            async with self._http.get(f"http://{bootstrap_addr}/route?engine_rank=0&target_dp_group="
                                      f"{room % int(info['prefill_dp_size'])}") as r:
                rank = await r.json()
            ip = rank["rank_ip"]
            ip = f"[{ip}]" if ":" in ip else ip
            async with self._http.get(f"http://{ip}:{rank['rank_port']}/room/{room}") as r:
                return "" if r.status == 200 else f"room {room}: {r.status}"
        except (aiohttp.ClientError, ValueError, KeyError) as e:
            return f"bootstrap {bootstrap_addr}: {e.__class__.__name__}: {e}"

    async def _answer(self, request: web.Request, kind: str, body: dict[str, Any], prompts: list[str],
                      toks: list[list[int]]) -> web.StreamResponse:
        rid = uuid.uuid4().hex
        chat = kind == "chat"
        usage = {"prompt_tokens": sum(len(p.encode()) for p in prompts),
                 "completion_tokens": sum(len(t) for t in toks)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if not body.get("stream"):
            choices = [({"index": i, "message": {"role": "assistant", "content": "".join(map(token_text, t))},
                         "finish_reason": "length"} if chat else
                        {"index": i, "text": "".join(map(token_text, t)), "logprobs": None, "finish_reason": "length"})
                       for i, t in enumerate(toks)]
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": int(time.time()), "model": self.model, "choices": choices,
                                      "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, t in enumerate(toks):
            for j, tok in enumerate(t):
                fin = "length" if j == len(t) - 1 else None
                c = ({"index": i, "delta": {"content": token_text(tok)}, "finish_reason": fin} if chat else
                     {"index": i, "text": token_text(tok), "logprobs": None, "finish_reason": fin})
                await resp.write(b"data: " + orjson.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                                           "model": self.model, "choices": [c]}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
