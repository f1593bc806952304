"""What the prefill and decode adapters share: an aiohttp app around a synchronous engine.

The engine core (stage 0 / rank 0; the other stages and ranks are their own processes) runs on
one dedicated thread: every call into it, `step()` included, goes through a one-thread executor,
so the event loop never blocks on torch and engine state is touched by one thread only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import orjson
from aiohttp import web

from mesh.tracing import kv_pull_header
from mesh.errors import InvalidRequest, MeshError, error_body
from mesh.protocol import OWN_CAPABILITIES, LoadReport
from workers.engine.engine import Engine, StepOutput
from workers.openai_io import Answer, Detokenizer, GenRequest, parse

log = logging.getLogger(__name__)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.Response(body=error_body(message, "invalid_request_error" if status < 500 else "server_error",
                                        param, code), status=status, content_type="application/json")


class EngineServer:
    role = "worker"

    def __init__(self, engine: Engine, model: str, worker_id: str) -> None:
        self.engine = engine
        self.model = model
        self.id = worker_id
        self.ex = ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-engine")
        self.queues: dict[str, asyncio.Queue[StepOutput]] = {}
        self.wake = asyncio.Event()
        self.in_flight = 0
        self.failed: str | None = None      # the engine broke (a rank died): answer 503 from now on
        self.outside = 0                    # blocks the adapter allocated outside any sequence (decode pulls)
        self._seq = 0

    # -- engine access ----------------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.ex, fn, *args)

    async def run_loop(self) -> None:
        sched = self.engine.scheduler
        while True:
            if not sched.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                outs = await self.call(self.engine.step)
            except Exception as e:  # noqa: BLE001 - a dead rank: fail every waiter, stay up to say so
                log.exception("engine step failed")
                self.failed = f"engine failed: {e}"
                for sid, q in self.queues.items():
                    q.put_nowait(StepOutput(sid, [], True, "error", self.failed))
                return
            for o in outs:
                q = self.queues.get(o.seq_id)
                if q is not None:
                    q.put_nowait(o)

    def new_id(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{os.urandom(4).hex()}-{self._seq}"

    async def submit(self, seq_id: str, fn: Callable[..., Any], *args: Any) -> asyncio.Queue[StepOutput]:
        """Add a sequence (engine.add / add_from_kv); its outputs arrive on the returned queue."""
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.queues[seq_id] = q
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self.ex, fn, seq_id, *args)
        try:
            seq = await asyncio.shield(job)   # an engine call cannot be taken back once queued
        except (ValueError, MemoryError) as e:
            del self.queues[seq_id]
            raise InvalidRequest(str(e)) from None
        except asyncio.CancelledError:  # the caller left: the add still runs; abort right after it,
            self.queues.pop(seq_id, None)  # on the same one-thread executor (first in, first out)
            loop.run_in_executor(self.ex, self.engine.abort, seq_id)
            raise
        if seq.finish_reason is not None:  # done on arrival (a PD decode with max_tokens 1)
            q.put_nowait(StepOutput(seq_id, [], True, seq.finish_reason))
        self.wake.set()
        return q

    # -- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/load", self._load)
        app.on_response_prepare.append(kv_pull_header)
        self.add_routes(app)
        app.cleanup_ctx.append(self._lifecycle)
        return app

    def add_routes(self, app: web.Application) -> None:
        pass

    async def start(self) -> None:
        """Background work besides the engine loop (side channels)."""

    async def stop(self) -> None:
        pass

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        await self.start()
        task = asyncio.create_task(self.run_loop(), name=f"{self.role}-engine-loop")
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await self.stop()
            self.ex.shutdown(wait=True)

    async def _models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "atomesh"}]})

    async def _health(self, request: web.Request) -> web.Response:
        if self.failed:
            return error_response(503, self.failed)
        return json_response({"status": "ok", "id": self.id, "role": self.role})

    def census(self) -> tuple[int, int, int]:
        """(free, held by transfers, held by running work) KV blocks, read on the engine thread.
        Held by transfers is what the adapter owns and can list, release and expire (the holder);
        running is the scheduler's running and waiting sequences plus what the adapter allocated
        outside the engine (a decode's blocks under a pull). Blocks in none of these are leaked."""
        live, _ = self.engine.scheduler.census()
        return self.engine.blocks.free, 0, live + self.outside

    def load(self, census: tuple[int, int, int] | None = None) -> LoadReport:
        b = self.engine.blocks
        free, held, running = census if census is not None else (b.free, None, None)
        return LoadReport(in_flight=self.in_flight, queued=len(self.engine.scheduler.waiting), free_blocks=free,
                          num_blocks=b.num_blocks, capabilities=OWN_CAPABILITIES, held_blocks=held,
                          running_blocks=running)

    async def _load(self, request: web.Request) -> web.Response:
        if self.failed:  # the mesh's probe takes a broken worker out
            return error_response(503, self.failed)
        return json_response(self.load(await self.call(self.census)).encode())

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.failed:
            return error_response(503, self.failed)
        self.in_flight += 1
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                return error_response(400, "request body is not valid JSON")
            mc = self.engine.model_cfg
            gen = parse(kind, body, self.engine.tokenizer, mc.vocab_size, mc.max_position_embeddings)
            if gen.model and gen.model != self.model:
                return error_response(404, f"model {gen.model!r} is not served here", "model", "model_not_found")
            return await self.handle(request, gen, body)
        except MeshError as e:
            return web.Response(body=e.body(), status=e.status, content_type="application/json")
        finally:
            self.in_flight -= 1

    async def handle(self, request: web.Request, gen: GenRequest, body: dict[str, Any]) -> web.StreamResponse:
        seq_id = self.new_id("gen")
        q = await self.submit(seq_id, self.engine.add, gen.prompt, gen.params)
        return await self.respond(request, gen, seq_id, q, first=[])

    async def respond(self, request: web.Request, gen: GenRequest, seq_id: str, q: asyncio.Queue[StepOutput],
                      first: list[int], extra: dict[str, Any] | None = None,
                      kvp: dict[str, Any] | None = None) -> web.StreamResponse:
        """Stream (or gather) a sequence's tokens; `first` are tokens already known (PD's first token).
        With `kvp.first_token_early` the mesh already sent the role chunk and the first token."""
        kvp = kvp or {}
        ans = Answer(gen.kind, gen.model or self.model, request.headers.get("X-Request-Id", ""),
                     kvp.get("response_meta"))
        sent_early = bool(kvp.get("first_token_early")) and bool(first)
        detok = Detokenizer(self.engine.tokenizer)
        ids = list(first)
        want_ids = gen.return_token_ids
        finish = None
        try:
            if not gen.stream:
                text = detok.add(first)
                while finish is None:
                    o = await q.get()
                    if o.error:
                        return error_response(500 if self.failed else 400, o.error)
                    ids += o.new_tokens
                    text += detok.add(o.new_tokens, final=o.finished)
                    if o.finished:
                        finish = o.finish_reason
                usage = {"prompt_tokens": len(gen.prompt), "completion_tokens": len(ids),
                         "total_tokens": len(gen.prompt) + len(ids)}
                return web.Response(body=ans.whole(text, finish or "length", usage, extra,
                                                   ids if want_ids else None), content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            head = ans.first_chunk()
            if head and not sent_early:
                await resp.write(head)
            if first:  # PD: the prefill's first token goes out at once (unless the mesh sent it)
                text = detok.add(first)
                if not sent_early:
                    await resp.write(ans.chunk(text, None, list(first) if want_ids else None))
            while finish is None:
                o = await q.get()
                if o.error:
                    await resp.write(b"event: error\ndata: " + error_body(o.error, "server_error") + b"\n\n")
                    await resp.write_eof()
                    return resp
                ids += o.new_tokens
                text = detok.add(o.new_tokens, final=o.finished)
                if o.finished:
                    finish = o.finish_reason or "length"
                await resp.write(ans.chunk(text, finish, o.new_tokens if want_ids else None))
            if gen.include_usage:
                await resp.write(ans.usage_chunk({"prompt_tokens": len(gen.prompt), "completion_tokens": len(ids),
                                                  "total_tokens": len(gen.prompt) + len(ids)}))
            await resp.write(Answer.DONE)
            await resp.write_eof()
            return resp
        finally:
            self.queues.pop(seq_id, None)
            if finish is None and not self.failed:  # the client left (or we failed): stop the work
                asyncio.get_running_loop().run_in_executor(self.ex, self.engine.abort, seq_id)
