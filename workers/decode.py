"""Decode adapter: an OpenAI server in front of a TP decode engine that pulls KV for PD.

With `kv_transfer_params.do_remote_prefill` (docs/protocol.md section 5): the prompt is tokenized
as the prefill did, blocks are allocated, every prefill stage is asked to write its layers into
every rank's blocks (side channel, section 6), each rank releases to stage 0, and decoding
continues from the prefill's `first_token_id` (which is emitted, not sampled again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from contract.errors import InvalidRequest, KVTransferError, ProtocolError
from contract.protocol import ConsumerRank, KVHandoffParams
from workers.choices import Choice
from workers.engine.engine import Engine
from workers.faults import cut_connection
from workers.kv.sidechannel import ChannelFaults, ConsumerChannel
from workers.kv.stage import ConsumerKV, EngineConsumerKV
from workers.openai_io import GenRequest
from workers.server import KV_PULL_MS, EngineServer, error_response

log = logging.getLogger(__name__)


class DecodeServer(EngineServer):
    role = "decode"

    def __init__(self, engine: Engine, model: str, worker_id: str, *, kv_backend: str = "mooncake",
                 host: str = "127.0.0.1", pull_deadline_s: float = 30.0, kv: ConsumerKV | None = None,
                 fault_route: bool = False, token: str | None = None) -> None:
        """`kv`: the engine's KV side (default: a real engine's pools on `kv_backend`; the mock
        fleet passes its fake engine's)."""
        super().__init__(engine, model, worker_id, fault_route=fault_route, token=token)
        self.tp = engine
        self.host = host
        self.pull_deadline_s = pull_deadline_s
        self.kv: ConsumerKV = kv if kv is not None else EngineConsumerKV(engine, kv_backend, host)
        self.channel = ConsumerChannel(host=host, token=token)
        self.pulls = 0
        self.pulls_failed = 0

    def ranks(self) -> tuple[ConsumerRank, ...]:
        return self.kv.ranks()

    async def start(self) -> None:
        await self.channel.start()
        self.apply_faults()

    def apply_faults(self) -> None:
        self.channel.faults = ChannelFaults(drop_release=self.faults.drop_release)

    async def stop(self) -> None:
        await self.channel.close()
        await self.call(self.tp.close)
        self.kv.close()

    def crash(self, p: float) -> bool:
        """An injected crash with probability `p` (faults)."""
        return bool(p) and self.rng.random() < p

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if not (isinstance(kvp, dict) and kvp.get("do_remote_prefill")):
            return await super().handle(request, gen, body)
        if gen.n != 1:
            raise InvalidRequest("n must be 1 on a PD decode leg (the mesh splits n into one pair per choice)",
                                 param="n")
        try:
            params = KVHandoffParams.decode(kvp, "kv_transfer_params")
        except ProtocolError as e:
            raise InvalidRequest(e.message, param=e.param) from None
        need = -(-len(gen.prompt) // self.tp.cfg.block_size)
        if len(params.remote_block_ids) != need:
            return error_response(400, f"the prefill holds {len(params.remote_block_ids)} blocks; this prompt needs "
                                  f"{need} here (tokenizer or block size differ?)", "kv_transfer_params")
        if self.crash(self.faults.crash_before_pull):
            return cut_connection(request)
        got = await self.receive(request, gen, need, params)
        if isinstance(got, web.StreamResponse):
            return got
        seq_id, q = got
        flp = kvp.get("first_token_logprobs")
        first_lp = [(flp[0], tuple((int(i), float(v)) for i, v in flp[1]))] \
            if flp is not None and _logprob_entry(flp) else None
        return await self.respond(request, gen, [Choice(0, seq_id, q, [params.first_token_id], first_lp)], kvp=kvp)

    async def receive(self, request: web.Request, gen: GenRequest, need: int, params: KVHandoffParams) -> Any:
        """docs/protocol.md section 5: pull the prefill's KV over the side channel into new blocks,
        release the prefill (every rank, to stage 0), continue from its first token."""
        async def pull(dst: list[int]) -> web.StreamResponse | None:
            ranks = self.kv.ranks()
            t_pull = time.monotonic()
            try:
                await self.channel.pull(params, ranks, tuple(dst), request_id=request.headers.get("X-Request-Id", ""),
                                        deadline_s=self.pull_deadline_s, extra=self.kv.pull_extra())
            except KVTransferError as e:
                self.pulls_failed += 1
                return error_response(502, e.message, code="kv_transfer_failed")
            self.pulls += 1
            request[KV_PULL_MS] = (time.monotonic() - t_pull) * 1000
            if self.crash(self.faults.crash_after_pull):
                return cut_connection(request)
            for r in ranks:
                await self.channel.release(params, r.tp_rank)
            return None

        return await self.continue_from_kv(gen, need, params.first_token_id, pull)

    async def continue_from_kv(self, gen: GenRequest, need: int, first: int,
                               fetch: Callable[[list[int]], Awaitable[web.StreamResponse | None]]) -> Any:
        """Allocate `need` blocks, let `fetch` land the prompt's KV in them (it answers an error
        response, or None), then continue the sequence from token `first`: (sequence id, its
        output queue), or the error response. The blocks are the adapter's (counted in `outside`)
        until the engine's add_from_kv owns them; on every way out before that (a failed fetch, a
        client gone, a cut leg) they go back."""
        try:
            if self.inline:
                dst = self.tp.blocks.allocate(need)
            else:
                loop = asyncio.get_running_loop()
                job = asyncio.ensure_future(self.call(self.tp.blocks.allocate, need))
                try:
                    dst = await asyncio.shield(job)
                except asyncio.CancelledError:  # left while allocating: what the allocation got goes back
                    job.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else
                                          loop.call_soon(self.post, self.tp.blocks.release, f.result()))
                    raise
        except MemoryError as e:
            return error_response(503, f"decode KV pool: {e}", code="kv_exhausted")
        self.outside += need
        owned = False
        try:
            bad = await fetch(dst)
            if bad is not None:
                return bad
            seq_id = self.new_id("dec")
            owned = True  # add_from_kv owns `dst` from the call on, even when it fails or is left
            self.outside -= need
            q = await self.submit(seq_id, self.tp.add_from_kv, gen.prompt, first, dst, gen.params, True)
        finally:
            if not owned:
                self.outside -= need
                self.post(self.tp.blocks.release, dst)
        return seq_id, q


def _logprob_entry(v: Any) -> bool:
    """`first_token_logprobs` as the prefill sends it: [logprob, [[token, logprob], ...]]."""
    return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], (int, float)) and isinstance(v[1], list)
            and all(isinstance(x, list) and len(x) == 2 and type(x[0]) is int and isinstance(x[1], (int, float))
                    for x in v[1]))
