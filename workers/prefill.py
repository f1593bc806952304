"""Prefill adapter: an OpenAI server in front of a PP stage engine (or a TP engine whose ranks
each serve their KV heads), holding KV for PD.

With `kv_transfer_params.do_remote_decode` the prompt is prefilled, its first token sampled,
its blocks held (TransferHolder) and `kv_transfer_params` returned (docs/protocol.md section 4); the
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

from contract.dialects import ATOM
from contract.errors import InvalidRequest, ProtocolError
from contract.protocol import KVHandoffParams, KVRequestParams, LoadReport, ReleaseCommand, StageAddr
from contract.sse import Answer
from workers.engine.engine import Engine, StepOutput
from workers.kv.holder import Held, TransferHolder
from workers.kv.sidechannel import ChannelFaults, StageChannel
from workers.kv.stage import EngineProducerKV, ProducerKV
from workers.openai_io import Detokenizer, GenRequest, logprobs_json
from workers.server import EngineServer, error_response, json_response

log = logging.getLogger(__name__)


class PrefillServer(EngineServer):
    role = "prefill"

    def __init__(self, engine: Engine, model: str, worker_id: str, *, kv_backend: str = "mooncake",
                 host: str = "127.0.0.1", ttl_s: float = 120.0, kv: ProducerKV | None = None,
                 fault_route: bool = False, token: str | None = None) -> None:
        """`kv`: the engine's KV side (default: a real engine's pools on `kv_backend`; the mock
        fleet passes its fake engine's)."""
        super().__init__(engine, model, worker_id, fault_route=fault_route, token=token)
        self.pp = engine
        self.kv: ProducerKV = kv if kv is not None else EngineProducerKV(engine, kv_backend, host)
        self.units = self.kv.units()  # (rank, layers, first KV head) of each KV producer
        self.host = host
        self.holder = TransferHolder(None, ttl_s=ttl_s, on_free=self._freed)
        self.channels: dict[int, StageChannel] = {}   # the producers served from this process
        self._expiry: asyncio.Task[None] | None = None

    @property
    def stage0(self) -> StageChannel | None:
        return self.channels.get(self.units[0][0])

    def stage_addrs(self) -> tuple[StageAddr, ...]:
        return tuple(StageAddr(pp_rank=r, host=self.host, layers=layers,
                               port=self.channels[r].port if r in self.channels else self.kv.remote_port(r))
                     for r, layers, _ in self.units)

    async def start(self) -> None:
        for r, writer in self.kv.local_writers().items():
            ch = StageChannel(host=self.host, port=0, pp_rank=r, holder=self.holder, writer=writer, token=self.token)
            await ch.start()
            self.channels[r] = ch
        self.apply_faults()
        self._expiry = asyncio.create_task(self._expire_loop())

    def apply_faults(self) -> None:
        for ch in self.channels.values():
            ch.faults = ChannelFaults(drop_write_done=self.faults.drop_write_done)

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        for ch in self.channels.values():
            await ch.close()
        await self.call(self.pp.close)
        self.kv.close()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.holder.ttl_s / 4))
            for tid in self.holder.expire():
                log.warning("transfer %s expired after %.0fs without release", tid, self.holder.ttl_s)
                self.expired(tid)

    def expired(self, transfer_id: str) -> None:
        """A dialect's bookkeeping for a transfer the TTL freed."""

    def _freed(self, held: Held, path: str) -> None:
        self.post(self.pp.release, held.transfer_id)

    def add_routes(self, app: web.Application) -> None:
        if self.dialect == ATOM:  # vLLM's and SGLang's engines free their KV themselves
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
        if not self.authorized(request):
            return self.unauthorized()
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return error_response(400, "since must be an integer", "since")
        return json_response(self.holder.listing(since).encode())

    async def _release(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return self.unauthorized()
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
        got = await self.prefill_and_hold(request, gen, tid, mesh_id=str(want.extra.get("mesh_id", "")),
                                          consumers=want.remote_tp_size)
        if isinstance(got, web.Response):
            return got
        seq, o = got
        st = self.stage_addrs()
        blocks = tuple(seq.blocks)
        params = KVHandoffParams(
            remote_engine_id=self.id, remote_host=self.host, remote_port=st[0].port,
            remote_handshake_port=st[0].port, remote_block_ids=blocks, transfer_id=tid,
            first_token_id=o.new_tokens[0], remote_pp_size=len(st), tp_size=self.kv.tp_size, dp_rank=0,
            stages=st,
            extra={**({"kv_backend": self.kv.backend} if self.kv.backend else {}), **self.kv.grant(tid, blocks),
                   **({"first_token_logprobs": [o.logprobs[0][0], [list(x) for x in o.logprobs[0][1]]]}
                      if o.logprobs else {})})
        return self.first_token_answer(request, gen, o, {"kv_transfer_params": params.encode()})

    async def prefill_and_hold(self, request: web.Request, gen: GenRequest, tid: str, *, mesh_id: str = "",
                               consumers: int = 1) -> Any:
        """Prefill `gen` as sequence `tid` and hand its blocks to the holder: (the sequence, its first
        token's output), or an error response. Until the holder owns the blocks, a cut leg, a client
        gone or an error aborts the sequence (its blocks go back); from then on the holder lists,
        releases and expires them."""
        q = await self.submit(tid, self.add_checked, gen.prompt, gen.params, True)
        held = False
        try:
            o = await q.get()
            if o.error:
                # a sequence the engine refused (a prompt no pool here can hold): the prompt's fault
                return error_response(503, o.error) if self.failed else error_response(400, o.error, "prompt")
            seq = self.pp.seqs.get(tid)
            if seq is None or o.finish_reason not in ("hold", "stop", "length"):
                return error_response(500, f"prefill of {tid} ended without holding its KV ({o.finish_reason})")
            self.holder.hold(tid, tuple(seq.blocks), request_id=request.headers.get("X-Request-Id", ""),
                             mesh_id=mesh_id, consumers=consumers)
            held = True
        finally:
            self.queues.pop(tid, None)
            if not held and not self.failed:
                self.post(self.pp.abort, tid)
        return seq, o

    def first_token_answer(self, request: web.Request, gen: GenRequest, o: StepOutput,
                           extra: dict[str, Any] | None) -> web.Response:
        """A prefill leg's answer: its one token (text, logprobs), `extra` beside the choices."""
        tok = self.engine.tokenizer
        text = Detokenizer(tok).add(o.new_tokens)  # as a stream's first chunk would say it
        ans = Answer(gen.kind, gen.model or self.model, request.headers.get("X-Request-Id", ""))
        usage = {"prompt_tokens": len(gen.prompt), "completion_tokens": 1, "total_tokens": len(gen.prompt) + 1}
        lps = logprobs_json(gen.kind, tok, o.new_tokens, o.logprobs) if o.logprobs else None
        return web.Response(body=ans.whole_choices([{"index": 0, "text": text, "finish": "length", "logprobs": lps}],
                                                   usage, extra), content_type="application/json")
