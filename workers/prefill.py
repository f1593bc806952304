"""Prefill adapter: an OpenAI server in front of a PP stage engine (or a TP engine whose ranks
each serve their KV heads), holding KV for PD.

With `kv_transfer_params.do_remote_decode` the prompt is prefilled, its first token sampled,
its blocks held (TransferHolder) and `kv_transfer_params` returned (PROTOCOL.md section 4); the
decode engine pulls the blocks over the side channel (every stage serves its own layers) and
releases them to stage 0, or the mesh posts `/kv/release`, or the TTL fires. Without it: a whole
generation (the engine alone).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import orjson
from aiohttp import web

from mesh.errors import InvalidRequest, ProtocolError
from mesh.protocol import KVHandoffParams, KVRequestParams, LoadReport, ReleaseCommand, StageAddr
from workers.engine.pp import PPEngine
from workers.engine.tp import TPEngine
from workers.engine.ctrl import kv_grant
from workers.kv.holder import Held, TransferHolder
from workers.kv.sidechannel import StageChannel
from workers.kv.stage import make_writer, register_pool
from workers.openai_io import Answer, Detokenizer, GenRequest, logprobs_json
from workers.server import EngineServer, error_response, json_response

log = logging.getLogger(__name__)


class PrefillServer(EngineServer):
    role = "prefill"

    def __init__(self, engine: PPEngine | TPEngine, model: str, worker_id: str, *, kv_backend: str = "mooncake",
                 host: str = "127.0.0.1", ttl_s: float = 120.0) -> None:
        super().__init__(engine, model, worker_id)
        self.pp = engine
        self.units = engine.producer_units()  # (rank, layers, first KV head) of each KV producer
        self.host = host
        self.holder = TransferHolder(None, ttl_s=ttl_s, on_free=self._freed)
        assert engine.pool is not None
        self.endpoint = register_pool(engine.pool, kv_backend, host)
        self.kv_backend = kv_backend
        self.stage0: StageChannel | None = None
        self._expiry: asyncio.Task[None] | None = None

    def stage_addrs(self) -> tuple[StageAddr, ...]:
        assert self.stage0 is not None
        out = [StageAddr(pp_rank=0, host=self.host, port=self.stage0.port, layers=self.units[0][1])]
        for r, layers, _ in self.units[1:]:
            assert self.pp.ranks is not None
            out.append(StageAddr(pp_rank=r, host=self.host, port=self.pp.ranks.infos[r]["kv_port"], layers=layers))
        return tuple(out)

    async def start(self) -> None:
        _, (a, b), head0 = self.units[0]
        self.stage0 = StageChannel(host=self.host, port=0, pp_rank=0, holder=self.holder,
                                   writer=make_writer(self.endpoint, a, b, head0))
        await self.stage0.start()
        self._expiry = asyncio.create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self.stage0 is not None:
            await self.stage0.close()
        await self.call(self.pp.close)
        self.endpoint.transport.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.holder.ttl_s / 4))
            for tid in self.holder.expire():
                log.warning("transfer %s expired after %.0fs without release", tid, self.holder.ttl_s)

    def _freed(self, held: Held, path: str) -> None:
        asyncio.get_running_loop().run_in_executor(self.ex, self.pp.release, held.transfer_id)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/kv/held", self._held)
        app.router.add_post("/kv/release", self._release)

    def census(self) -> tuple[int, int, int]:
        """Held by transfers: the holder's blocks only. A sequence the scheduler keeps HELD that the
        holder does not own (between its last step and the handler) counts nowhere until it does."""
        free, _, running = super().census()
        return free, self.holder.held_blocks, running

    def load(self, census: tuple[int, int, int] | None = None) -> LoadReport:
        return dataclasses.replace(super().load(census), held_transfers=len(self.holder))

    async def _held(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return error_response(400, "since must be an integer", "since")
        return json_response(self.holder.listing(since).encode())

    async def _release(self, request: web.Request) -> web.Response:
        try:
            cmd = ReleaseCommand.decode(orjson.loads(await request.read()))
        except (ProtocolError, orjson.JSONDecodeError) as e:
            return error_response(400, f"bad release: {e}")
        return json_response({"transfer_id": cmd.transfer_id, "released": self.holder.release(cmd.transfer_id,
                                                                                               cmd.reason)})

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if not (isinstance(kvp, dict) and kvp.get("do_remote_decode")):
            return await super().handle(request, gen, body)
        if gen.n != 1:
            raise InvalidRequest("n must be 1 on a PD prefill leg (the mesh splits n into one pair per choice)",
                                 param="n")
        try:
            want = KVRequestParams.decode(kvp, "kv_transfer_params")
        except ProtocolError as e:
            raise InvalidRequest(e.message, param=e.param) from None
        tid = self.new_id(self.id)
        q = await self.submit(tid, self.pp.add, gen.prompt, gen.params, True)
        held = False
        try:  # until the holder owns its blocks, a cut leg, a client gone or an error aborts the sequence
            o = await q.get()
            if o.error:
                return error_response(503 if self.failed else 400, o.error)
            seq = self.pp.seqs.get(tid)
            if seq is None or o.finish_reason not in ("hold", "stop", "length"):
                return error_response(500, f"prefill of {tid} ended without holding its KV ({o.finish_reason})")
            self.holder.hold(tid, tuple(seq.blocks), request_id=request.headers.get("X-Request-Id", ""),
                             mesh_id=str(want.extra.get("mesh_id", "")), consumers=want.remote_tp_size)
            held = True
        finally:
            self.queues.pop(tid, None)
            if not held and not self.failed:
                asyncio.get_running_loop().run_in_executor(self.ex, self.pp.abort, tid)
        st = self.stage_addrs()
        params = KVHandoffParams(
            remote_engine_id=self.id, remote_host=self.host, remote_port=st[0].port,
            remote_handshake_port=st[0].port, remote_block_ids=tuple(seq.blocks), transfer_id=tid,
            first_token_id=o.new_tokens[0], remote_pp_size=len(st), tp_size=getattr(self.pp, "tp_size", 1), dp_rank=0,
            stages=st,
            extra={"kv_backend": self.kv_backend,
                   **({"kv_grant": kv_grant(self.pp.ranks.secret, tid, tuple(seq.blocks))}
                      if getattr(self.pp, "ranks", None) is not None else {}),
                   **({"first_token_logprobs": [o.logprobs[0][0], [list(x) for x in o.logprobs[0][1]]]}
                      if o.logprobs else {})})
        tok = self.engine.tokenizer
        text = Detokenizer(tok).add(o.new_tokens)  # as a stream's first chunk would say it
        ans = Answer(gen.kind, gen.model or self.model, request.headers.get("X-Request-Id", ""))
        usage = {"prompt_tokens": len(gen.prompt), "completion_tokens": 1, "total_tokens": len(gen.prompt) + 1}
        lps = logprobs_json(gen.kind, tok, o.new_tokens, o.logprobs) if o.logprobs else None
        return web.Response(body=ans.whole_choices([{"index": 0, "text": text, "finish": "length", "logprobs": lps}],
                                                   usage, {"kv_transfer_params": params.encode()}),
                            content_type="application/json")

