"""A fake ATOM OpenAI server (prefill `kv_producer` or decode `kv_consumer`) that answers the mesh as
ATOM's code does. Mirrors ROCm/ATOM at commit ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21:

- `atom/entrypoints/openai/api_server.py`: routes `/v1/completions`, `/v1/chat/completions`,
  `/v1/models`, `/health`, `/kv_transfer_info`, `/metrics`; nothing else (FastAPI's 404
  `{"detail": "Not Found"}`): no `/load`, no `/kv/held`, no `/kv/release`. `validate_model` -> 400
  `{"detail": ...}`; errors inside a handler -> `HTTPException(500, detail=str(e))`.
- `atom/entrypoints/openai/protocol.py`: `CompletionRequest.prompt: str` (a list is a pydantic 422),
  `stop: list[str] | None` (a string is a 422), `extra = "ignore"`, `get_max_tokens()` prefers
  `max_completion_tokens`; `CompletionResponse`/`ChatCompletionResponse` always carry
  `kv_transfer_params` (null unless set).
- `serving_completion.py` / `serving_chat.py`: stream ids `cmpl-<uuid hex>` / `chatcmpl-...` of the
  engine's own; completion chunks `{index, text, finish_reason, logprobs: null}`; the finishing
  output's chunk, then a `""`/"stop" chunk, a usage chunk (always, whatever `stream_options`
  says) and `[DONE]`; chat starts with a role chunk. Finish reason "max_tokens" (scheduler.py).
- `kv_transfer/disaggregation/mooncake/mooncake_connector.py` `request_finished`: the prefill's
  `kv_transfer_params` (transfer_id = `seq.id`, an int from `Sequence.counter`; every field below).
  The producer frees a transfer only once a consumer pulled it: no release API, no TTL.
  The consumer's pull goes to `remote_handshake_port + side_channel_port_offset(remote_dp_rank,
  tp_rank, remote_tp_size(= tp_size), pp_rank, remote_pp_size, remote_dp_size)` (`port_offset.py`;
  ReqMeta defaults `remote_dp_rank` 0, `remote_dp_size` 1 in `types.py`); the producer waits
  `PREFILL_LOOKUP_TIMEOUT` (60 s) for a transfer it does not have, then fails, and the decode
  recomputes the prompt locally (no error to the client).
- `model_engine/scheduler.py` `_schedule_first_decode_after_remote_kv`: the decode appends the
  prefill's `first_token_id` to its output and EMITS it (the first step's output holds T0 and T1).

The KV plane between the two fakes is a stand-in: an HTTP `POST /pull` on the side-channel port in
place of ATOM's ZMQ write_request / release. The mesh never touches that plane; the ports, the
rank layout and the free-on-pull rule are ATOM's. Tokens follow the mock fleet's deterministic
model, so PD output equals the same fake answering alone.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
import uuid
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from mesh.request import render_prompt
from workers.mock import first_token, next_token, token_text

SOURCE = "ROCm/ATOM@ffdf3bb5ddf8a15a64d521a2eeb3bc7438f9ac21"
_seq_ids = itertools.count(1)   # Sequence.counter: one per process, shared by every engine here


def port_offset(dp_rank: int, tp_rank: int, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
                dp_size: int = 1) -> int:
    """atom/kv_transfer/disaggregation/port_offset.py `side_channel_port_offset`."""
    return pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank


def _free_base(n: int) -> int:
    """A base port with the next `n` ports free on 127.0.0.1."""
    for _ in range(200):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def _detail(status: int, detail: Any) -> web.Response:
    return web.Response(body=orjson.dumps({"detail": detail}), status=status, content_type="application/json")


def _422(field: str, msg: str, value: Any, kind: str) -> web.Response:
    return _detail(422, [{"type": kind, "loc": ["body", field], "msg": msg, "input": value}])


class AtomServer:
    """One ATOM api_server process: `role` "prefill" (kv_producer) or "decode" (kv_consumer)."""

    def __init__(self, role: str, *, model: str = "atom-model", dp_size: int = 1, tp_size: int = 1,
                 num_blocks: int = 4096, block_size: int = 16, lookup_timeout: float = 60.0,
                 host: str = "127.0.0.1") -> None:
        assert role in ("prefill", "decode")
        self.role, self.model, self.host = role, model, host
        self.dp_size, self.tp_size = dp_size, tp_size
        self.block_size = block_size
        self.lookup_timeout = lookup_timeout
        self.free_ids = list(range(num_blocks))
        self.num_blocks = num_blocks
        self.held: list[dict[int, list[int]]] = [{} for _ in range(dp_size)]   # per DP rank
        self.arrived: list[dict[int, asyncio.Event]] = [{} for _ in range(dp_size)]
        self.bodies: list[dict[str, Any]] = []     # every generate body received, as sent
        self.pulls = 0
        self.pull_failures = 0                      # the decode recomputed locally
        self.fail_next = 0                          # decode: answer 500 before pulling this many times
        self.prefill_delay = 0.0
        self.decode_delay = 0.0                     # decode: wait this long before pulling
        self.aborted = 0                            # decode: client gone before the pull (seq aborted)
        self.outputs: list[dict[str, Any]] = []     # prefill: every kv_transfer_params it answered
        self.paths: list[str] = []                  # every path asked, routed or not
        self._rr = itertools.count()
        self.url = ""
        self.handshake_port = 0
        self._runners: list[web.AppRunner] = []
        self._http: aiohttp.ClientSession | None = None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> "AtomServer":
        app = web.Application(middlewares=[self._record_path])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_transfer_info", self._kv_transfer_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        port = await self._serve(app, 0)
        self.url = f"http://{self.host}:{port}"
        if self.role == "prefill":  # one side channel per (dp, tp) rank of the one PP stage
            self.handshake_port = _free_base(self.dp_size * self.tp_size)
            for dp in range(self.dp_size):
                side = web.Application()
                side.router.add_post("/pull", self._pull_handler(dp))
                await self._serve(side, self.handshake_port + port_offset(dp, 0, self.tp_size, 0, 1, self.dp_size))
        self._http = aiohttp.ClientSession()
        return self

    async def _serve(self, app: web.Application, port: int) -> int:
        r = web.AppRunner(app, access_log=None)
        await r.setup()
        site = web.TCPSite(r, self.host, port)
        await site.start()
        self._runners.append(r)
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
        for r in self._runners:
            await r.cleanup()

    def held_blocks(self) -> int:
        return sum(len(b) for rank in self.held for b in rank.values())

    def held_transfers(self) -> int:
        return sum(len(rank) for rank in self.held)

    # -- routes -----------------------------------------------------------------------------

    @web.middleware
    async def _record_path(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.paths.append(request.path)
        return await handler(request)

    async def _not_found(self, request: web.Request) -> web.Response:
        return _detail(404, "Not Found")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "atom"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _kv_transfer_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tp_size": self.tp_size, "dp_size": self.dp_size,
                                  "kv_role": "kv_producer" if self.role == "prefill" else "kv_consumer",
                                  "handshake_port": self.handshake_port or 6301})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# atom fake\n", content_type="text/plain")

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return _422("body", "JSON decode error", None, "json_invalid")
        if not isinstance(body, dict):
            return _422("body", "Input should be a valid dictionary", body, "model_attributes_type")
        for f, kinds, name in (("model", (str,), "string"), ("max_tokens", (int,), "integer"),
                               ("max_completion_tokens", (int,), "integer"), ("stream", (bool,), "boolean"),
                               ("kv_transfer_params", (dict,), "dictionary"), ("n", (int,), "integer"),
                               ("data_parallel_rank", (int,), "integer")):
            v = body.get(f)
            if v is not None and not isinstance(v, kinds):
                return _422(f, f"Input should be a valid {name}", v, f"{name}_type")
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            return _422("stop", "Input should be a valid list", stop, "list_type")
        model = body.get("model")
        if model is not None and model.rstrip("/") != self.model.rstrip("/"):
            return _detail(400, f"Requested model '{model}' does not match server model '{self.model}'")
        self.bodies.append(body)
        return body

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("prompt"), str):
            return _422("prompt", "Input should be a valid string", body.get("prompt"), "string_type")
        return await self._generate(request, "completions", body, body["prompt"])

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        msgs = body.get("messages", body.get("prompt"))
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 for m in msgs):
            return _422("messages", "Input should be a valid list", msgs, "list_type")
        return await self._generate(request, "chat", body, render_prompt("chat", {"messages": msgs}))

    # -- the engine ---------------------------------------------------------------------------

    async def _generate(self, request: web.Request, kind: str, body: dict[str, Any], prompt: str) -> web.StreamResponse:
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 8192
        kvp = body.get("kv_transfer_params") or {}
        prompt_tokens = len(prompt.encode())
        t_start = time.time()
        if self.role == "prefill" and kvp.get("do_remote_decode"):
            # the prefill runs to its end even when the client leaves (the sequence finishes HELD)
            out = await asyncio.shield(self._prefill(body, prompt, prompt_tokens))
            return self._whole(kind, [out["first_token_id"]], prompt_tokens, t_start, out)
        if self.role == "decode" and kvp.get("do_remote_prefill"):
            if self.fail_next:
                self.fail_next -= 1
                return _detail(500, "injected: decode failed before its pull")
            t0 = kvp.get("first_token_id")
            if self.decode_delay:
                await asyncio.sleep(self.decode_delay)
                if request.transport is None or request.transport.is_closing():
                    self.aborted += 1   # _run_nonstream_with_disconnect / stream cleanup: abort_request
                    return _detail(499, "client disconnected")
            await self._pull(kvp)
            toks = [t0] if t0 is not None else [first_token(prompt)]
        else:
            toks = [first_token(prompt)]
        while len(toks) < max_tokens:
            toks.append(next_token(toks[-1]))
        if body.get("stream"):
            return await self._stream(request, kind, toks, prompt_tokens)
        return self._whole(kind, toks, prompt_tokens, t_start, None)

    async def _prefill(self, body: dict[str, Any], prompt: str, prompt_tokens: int) -> dict[str, Any]:
        if self.prefill_delay:
            await asyncio.sleep(self.prefill_delay)
        dp = body.get("data_parallel_rank")
        dp = dp if isinstance(dp, int) and 0 <= dp < self.dp_size else next(self._rr) % self.dp_size
        need = -(-prompt_tokens // self.block_size)
        blocks, self.free_ids = self.free_ids[:need], self.free_ids[need:]
        sid = next(_seq_ids)
        self.held[dp][sid] = blocks
        self.arrived[dp].setdefault(sid, asyncio.Event()).set()
        out = {  # mooncake_connector.py request_finished, every field
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(blocks), "remote_swa_block_ids": [],
            "remote_engine_id": "None", "remote_host": self.host,
            "remote_port": self.handshake_port + port_offset(dp, 0, self.tp_size, 0, 1, self.dp_size),
            "remote_handshake_port": self.handshake_port, "tp_size": self.tp_size, "dp_rank": dp,
            "remote_pp_size": 1, "transfer_id": sid, "first_token_id": first_token(prompt),
            "draft_token_ids": [], "local_slot_index": -1, "prefix_cache_hit_tokens": 0,
        }
        self.outputs.append(out)
        return out

    def _pull_handler(self, dp: int) -> Any:
        async def pull(request: web.Request) -> web.Response:
            tid = orjson.loads(await request.read()).get("transfer_id")
            ev = self.arrived[dp].setdefault(tid, asyncio.Event())
            try:  # _wait_for_prefill_data: PREFILL_LOOKUP_TIMEOUT
                await asyncio.wait_for(ev.wait(), self.lookup_timeout)
            except TimeoutError:
                self.arrived[dp].pop(tid, None)
                return web.json_response({"ok": False}, status=404)
            blocks = self.held[dp].pop(tid, None)
            self.arrived[dp].pop(tid, None)
            if blocks is None:
                return web.json_response({"ok": False}, status=404)
            self.free_ids.extend(blocks)   # all consumers served: page freed
            return web.json_response({"ok": True, "blocks": len(blocks)})
        return pull

    async def _pull(self, kvp: dict[str, Any]) -> None:
        """The consumer's write_request to the owning producer rank; a failed pull is recomputed."""
        port = kvp.get("remote_handshake_port", 0) + port_offset(
            kvp.get("remote_dp_rank", 0), 0, kvp.get("tp_size", kvp.get("remote_tp_size", 1)), 0,
            max(1, kvp.get("remote_pp_size", 1)), kvp.get("remote_dp_size", 1))
        assert self._http is not None
        try:
            async with self._http.post(f"http://{kvp.get('remote_host')}:{port}/pull",
                                       data=orjson.dumps({"transfer_id": kvp.get("transfer_id")})) as r:
                ok = r.status == 200
        except aiohttp.ClientError:
            ok = False
        self.pulls += 1
        self.pull_failures += not ok

    # -- answers ------------------------------------------------------------------------------

    def _whole(self, kind: str, toks: list[int], prompt_tokens: int, t_start: float,
               kv_out: dict[str, Any] | None) -> web.Response:
        text = "".join(token_text(t) for t in toks)
        lat = round(time.time() - t_start, 4)
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(toks),
                                 "total_tokens": prompt_tokens + len(toks)}
        if kind == "chat":
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "max_tokens"}
            head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        usage.update(ttft_s=lat, tpot_s=0.0, latency_s=lat)
        return web.json_response({**head, "created": int(time.time()), "model": self.model, "choices": [choice],
                                  "usage": usage, "kv_transfer_params": kv_out})

    async def _stream(self, request: web.Request, kind: str, toks: list[int], prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        chat = kind == "chat"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def frame(choice: dict[str, Any], **extra: Any) -> bytes:
            return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                             "model": self.model, "choices": [choice], **extra}) + b"\n\n"

        def chunk(text: str, finish: str | None) -> bytes:
            if chat:
                return frame({"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish,
                              "logprobs": None})
            return frame({"index": 0, "text": text, "finish_reason": finish, "logprobs": None})

        # engine steps: the first decode step outputs T0 and T1 together, then one token a step
        steps = [toks[:2]] + [[t] for t in toks[2:]]
        if chat:
            await resp.write(chunk("", None).replace(b'"delta":{}', b'"delta":{"role":"assistant","content":""}'))
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            text = "".join(token_text(t) for t in step)
            if not last:
                await resp.write(chunk(text, None))
                continue
            usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": len(toks),
                                     "total_tokens": prompt_tokens + len(toks)}
            if chat:
                usage["prompt_tokens_details"] = {"cached_tokens": 0}
                tail = chunk(text, None) + chunk("", "stop")
            else:
                tail = chunk(text, "max_tokens") + chunk("", "stop")
            usage_chunk = b"data: " + orjson.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                                    "model": self.model, "choices": [], "usage": usage}) + b"\n\n"
            await resp.write(tail + usage_chunk + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
