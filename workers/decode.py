"""Decode adapter: an OpenAI server in front of a TP decode engine that pulls KV for PD.

With `kv_transfer_params.do_remote_prefill` (PROTOCOL.md section 5): the prompt is tokenized
as the prefill did, blocks are allocated, every prefill stage is asked to write its layers into
every rank's blocks (side channel, section 6), each rank releases to stage 0, and decoding
continues from the prefill's `first_token_id` (which is emitted, not sampled again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from mesh.errors import InvalidRequest, KVTransferError, ProtocolError
from mesh.protocol import ConsumerRank, KVHandoffParams
from mesh.tracing import KV_PULL_MS
from workers.engine.tp import TPEngine
from workers.kv.sidechannel import ConsumerChannel
from workers.kv.stage import layout_extra, register_pool
from workers.openai_io import GenRequest
from workers.server import Choice, EngineServer, error_response

log = logging.getLogger(__name__)


class DecodeServer(EngineServer):
    role = "decode"

    def __init__(self, engine: TPEngine, model: str, worker_id: str, *, kv_backend: str = "mooncake",
                 host: str = "127.0.0.1", pull_deadline_s: float = 30.0) -> None:
        super().__init__(engine, model, worker_id)
        self.tp: TPEngine = engine
        self.host = host
        self.pull_deadline_s = pull_deadline_s
        assert engine.pool is not None
        self.endpoint = register_pool(engine.pool, kv_backend, host)
        self.layout = layout_extra(engine.pool)
        self.channel = ConsumerChannel(host=host)
        self.pulls = 0

    def ranks(self) -> tuple[ConsumerRank, ...]:
        out = []
        for r in range(self.tp.tp_size):
            a, b = self.tp.head_range(r)
            if r == 0:
                seg, regions = self.endpoint.transport.segment, self.endpoint.regions
            else:
                assert self.tp.ranks is not None
                info = self.tp.ranks.infos[r]
                seg, regions = info["segment"], info["regions"]
            out.append(ConsumerRank(tp_rank=r, segment=seg, head_start=a, head_end=b, region_addrs=tuple(regions)))
        return tuple(out)

    async def start(self) -> None:
        await self.channel.start()

    async def stop(self) -> None:
        await self.channel.close()
        await self.call(self.tp.close)
        self.endpoint.transport.close()

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
        loop = asyncio.get_running_loop()
        job = asyncio.ensure_future(self.call(self.tp.blocks.allocate, need))
        try:
            dst = await asyncio.shield(job)
        except MemoryError as e:
            return error_response(503, f"decode KV pool: {e}", code="kv_exhausted")
        except asyncio.CancelledError:  # left while allocating: what the allocation got goes back
            job.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else
                                  loop.run_in_executor(self.ex, self.tp.blocks.release, f.result()))
            raise
        # `dst` is the adapter's (counted in `outside`) until the engine's add_from_kv owns it; on
        # every way out before that (a failed pull, a client gone, a cut leg) it goes back
        self.outside += need
        owned = False
        rid = request.headers.get("X-Request-Id", "")
        t_pull = time.monotonic()
        try:
            try:
                await self.channel.pull(params, self.ranks(), tuple(dst), request_id=rid,
                                        deadline_s=self.pull_deadline_s, extra={"layout": self.layout})
            except KVTransferError as e:
                return error_response(502, e.message, code="kv_transfer_failed")
            self.pulls += 1
            request[KV_PULL_MS] = (time.monotonic() - t_pull) * 1000
            for r in range(self.tp.tp_size):
                await self.channel.release(params, r)
            seq_id = self.new_id("dec")
            owned = True  # add_from_kv owns `dst` from the call on, even when it fails or is left
            self.outside -= need
            q = await self.submit(seq_id, self.tp.add_from_kv, gen.prompt, params.first_token_id, dst, gen.params,
                                  True)
        finally:
            if not owned:
                self.outside -= need
                loop.run_in_executor(self.ex, self.tp.blocks.release, dst)
        flp = kvp.get("first_token_logprobs")
        first_lp = [(flp[0], tuple((int(i), float(v)) for i, v in flp[1]))] if _logprob_entry(flp) else None
        return await self.respond(request, gen, [Choice(0, seq_id, q, [params.first_token_id], first_lp)], kvp=kvp)


def _logprob_entry(v: Any) -> bool:
    """`first_token_logprobs` as the prefill sends it: [logprob, [[token, logprob], ...]]."""
    return (isinstance(v, list) and len(v) == 2 and isinstance(v[0], (int, float)) and isinstance(v[1], list)
            and all(isinstance(x, list) and len(x) == 2 and type(x[0]) is int and isinstance(x[1], (int, float))
                    for x in v[1]))
