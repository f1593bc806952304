"""Request orchestration: the PD loop (written once, run with each dialect's `Flow`) and the
regular single-pool flow.

PD: pick a (pipeline, decode) pair -> the flow's prefill leg -> its hand-off -> the decode leg ->
relay byte for byte -> settle (ledger, breakers, spans). Flows with `concurrent` send both legs at
once (SGLang). Requests that are several sequences (a list of prompts, `n` > 1) are split into one
pair each and merged (`mesh.fanout`) where the flow says so.

Failure semantics:
- prefill non-2xx or timeout: an OpenAI error (502/503/504, or the prefill's 4xx as it came);
  a prefill that surely holds nothing (it answered 5xx, or never connected) is re-paired.
- decode fails before its first byte: another decode engine with the same params where the flow
  allows it (`retry_decode`), else a new pair; when none is left, an error, and the transfer is
  freed: released through the holder API, or drained (a one-token decode leg) where there is none.
- decode stalls or drops before its first byte while the pipeline it pulls from is down (a stage
  died under the pull): the decode's breaker is left alone (`Leg.source`).
- decode answers `kv_transfer_failed` (it could not pull from the pipeline): the pipeline is
  blamed, not the decode engine, and the request is re-paired on another pipeline while nothing has
  reached the client (`retries` times).
- decode fails mid-stream: the stream ends with an SSE `error` event.
- client disconnect: the running leg is cut; what the prefill holds is released (holder API) or
  drained; an ATOM prefill still running is let finish in the background, then drained.

Size: the request path written once (pair, prefill, hand-off, decode, relay, settle, re-pair,
drain, fan-out); it reads top to bottom as the lifecycle in docs/architecture.md, and each
step's mechanics live elsewhere (flows, upstream, ledger, fanout).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Awaitable, Callable

import orjson

from contract.errors import (
    KVSourceLost,
    MeshError,
    ModelNotFound,
    NoWorker,
    ProtocolError,
    UpstreamClientError,
    UpstreamError,
    UpstreamTimeout,
)
from contract.protocol import KV_PULL_HEADER
from contract.snapshot import View, Worker
from contract.sse import Answer
from mesh.config import MeshConfig
from mesh.downstream import Client, Stream
from mesh.fanout import Merge, Part, needs_split, split
from mesh.fleet import Fleet
from mesh.flows import FLOWS, Bootstrap, Flow, Handoff
from mesh.ledger import Ledger
from mesh.metrics import Metrics
from mesh.reconcile import Reconciler
from mesh.request import ClientRequest
from mesh.tracing import Tracing
from mesh.upstream import Leg, Upstream
from policies import Policy

log = logging.getLogger(__name__)

SSE_END = b"\n\n"
FANOUT_CONCURRENCY = 16


class Background:
    """Fire-and-forget work that must still finish (releases, drains): kept, and awaited at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)


class RePair(Exception):
    """A PD pair failed before anything reached the client: run the request on a new pair, without
    the worker(s) named here, or answer `cause` when no try is left."""

    def __init__(self, cause: MeshError, *, pipeline: Worker | None = None, decode: Worker | None = None) -> None:
        super().__init__(cause.message)
        self.cause, self.pipeline, self.decode = cause, pipeline, decode


class PullBlame:
    """Who a failed KV pull (a decode's `kv_transfer_failed`) is charged to. Normally the pipeline: the
    decode could not get its KV from it. But a decode that fails against two or more distinct
    pipelines within `window` seconds with no successful pull since the first of those failures is
    itself broken (its side channel or transport): charging each pipeline would open the breakers of
    healthy pipelines one after the other (issue 16), so it is charged instead."""

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._fails: dict[str, dict[str, float]] = {}   # decode id -> pipeline id -> last failure
        self._ok: dict[str, float] = {}                 # decode id -> last successful pull

    def ok(self, decode: str) -> None:
        self._ok[decode] = time.monotonic()
        self._fails.pop(decode, None)

    def decode_at_fault(self, decode: str, pipeline: str) -> bool:
        now = time.monotonic()
        fails = {p: t for p, t in self._fails.get(decode, {}).items() if now - t <= self.window}
        fails[pipeline] = now
        self._fails[decode] = fails
        if len(self._fails) > 4096:   # bounded: forget decodes with nothing recent
            self._fails = {d: f for d, f in self._fails.items() if f and now - max(f.values()) <= self.window}
        return len(fails) >= 2 and self._ok.get(decode, -1e18) < min(fails.values())


@dataclass(slots=True)
class Decoded:
    """An open decode leg and its first bytes (the whole body unless streaming)."""
    leg: Leg
    first: bytes
    t_leg: float                                  # when the decode's part of the request began
    early: Stream | None = None       # the client's stream, open with token 0 already
    settle: Callable[[], None] | None = None      # the ledger's decode_done and the span's end

    def close(self) -> None:
        self.leg.close()
        if self.settle is not None:
            self.settle()
            self.settle = None


class Events:
    """Whole SSE events out of a byte stream; what follows the last event boundary waits."""
    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self.pending and chunk.endswith(SSE_END):
            return chunk
        buf = self.pending + chunk
        cut = buf.rfind(SSE_END)
        if cut < 0:
            self.pending = buf
            return b""
        self.pending = buf[cut + 2:]
        return buf[:cut + 2]


def error_event(err: MeshError) -> bytes:
    return b"event: error\ndata: " + err.body() + SSE_END


class Proxy:
    def __init__(self, cfg: MeshConfig, fleet: Fleet, upstream: Upstream, metrics: Metrics,
                 policies: dict[str, Policy], background: Background, mesh_id: str, ledger: Ledger, reconciler: Reconciler,
                 tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.up = upstream
        self.metrics = metrics
        self.policies = policies
        self.bg = background
        self.mesh_id = mesh_id
        self.ledger = ledger
        self.reclaim = reconciler.reclaim
        self.load = MappingProxyType(fleet.in_flight)
        self.kv_free = MappingProxyType(fleet.kv_free)
        self.tracing = tracing
        self._pulls = PullBlame()

    async def handle(self, request: Client, creq: ClientRequest) -> Any:
        if self.tracing is None:
            return await (self.pd(request, creq) if self.cfg.pd else self.regular(request, creq))
        with self.tracing.request(creq.request_id, creq.path, creq.model, creq.stream) as span:
            try:
                resp = await (self.pd(request, creq) if self.cfg.pd else self.regular(request, creq))
            except MeshError as e:
                span.set_attribute("http.response.status_code", e.status)
                self.tracing.end_error(span, e)
                raise
            span.set_attribute("http.response.status_code", resp.status)
            return resp

    def _headers(self, request: Client, creq: ClientRequest) -> dict[str, str]:
        h = {"Content-Type": "application/json", "X-Request-Id": creq.request_id}
        if self.cfg.forward_client_auth and "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        return h

    def _span(self, name: str, creq: ClientRequest, w: Worker, headers: dict[str, str]) -> tuple[Any, dict[str, str]]:
        """A leg's span and the headers that carry it (the same headers when tracing is off)."""
        if self.tracing is None:
            return None, headers
        h = dict(headers)
        return self.tracing.start_leg(name, creq.request_id, w, h), h

    def _end(self, span: Any, error: BaseException | None = None) -> None:
        if span is not None:
            self.tracing.end(span, error)  # type: ignore[union-attr]  # a span exists only when tracing is on

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter, capped at 1 s."""
        return min(1.0, self.cfg.retry_backoff * 2.0 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    # -- selection ------------------------------------------------------------------------

    def _pick(self, role: str, creq: ClientRequest, exclude: tuple[Worker, ...] = (),
              dialect: str | None = None) -> Worker:
        cands = self.fleet.table.candidates(role, creq.model, dialect)
        if exclude:
            cands = tuple(w for w in cands if w not in exclude)
        if not cands:
            if exclude:
                raise NoWorker(f"no other healthy {role} worker for model {creq.model!r}")
            if creq.model not in self.fleet.table.models:
                raise ModelNotFound(f"model {creq.model!r} is not served here; see GET /v1/models",
                                    param="model")
            what = f"{dialect} " if dialect else ""
            raise NoWorker(f"no healthy {what}{role} worker for model {creq.model!r}",
                           headers={"Retry-After": "1"})
        return self.policies[role].select(creq, View(cands, self.load, self.kv_free))

    # -- PD -------------------------------------------------------------------------------

    async def pd(self, request: Client, creq: ClientRequest) -> Any:
        t0 = request.loop.time()
        if needs_split(creq):
            cands = self.fleet.table.candidates("prefill", creq.model)
            if cands and FLOWS[cands[0].record.dialect].fanout:
                return await self._fanout(request, creq, t0)
        d = await self._pair(request, creq, t0, allow_early=True)
        if not isinstance(d, Decoded):   # the stream ended early (an error event)
            return d
        return await self._relay(request, creq, d, t0)

    async def _pair(self, request: Client, creq: ClientRequest, t0: float,
                    allow_early: bool) -> Decoded | Any:
        """Run the request on a (pipeline, decode) pair; while nothing has reached the client, a
        failed pair is replaced by a new one (`retries` times, jittered backoff)."""
        not_p: tuple[Worker, ...] = ()
        not_d: tuple[Worker, ...] = ()
        attempt = 0
        while True:
            try:
                pw = self._pick("prefill", creq, exclude=not_p)
                dw = self._pick("decode", creq, exclude=not_d, dialect=pw.record.dialect)
                flow = FLOWS[pw.record.dialect]
                flow.check(creq)
                if flow.concurrent:
                    return await self._concurrent(request, creq, flow, pw, dw, t0)
                return await self._prefill_first(request, creq, flow, pw, dw, t0, allow_early)
            except RePair as rp:
                not_p += (rp.pipeline,) if rp.pipeline is not None else ()
                not_d += (rp.decode,) if rp.decode is not None else ()
                attempt += 1
                if attempt > self.cfg.retries:
                    raise rp.cause from None
                try:
                    nxt = self._pick("prefill", creq, exclude=not_p)
                    self._pick("decode", creq, exclude=not_d, dialect=nxt.record.dialect)
                except NoWorker:
                    raise rp.cause from None
                self.metrics.retry("prefill")
                log.info("request %s: %s; re-pairing", creq.request_id, rp.cause.message)
                await asyncio.sleep(self._backoff(attempt))

    async def _prefill_first(self, request: Client, creq: ClientRequest, flow: Flow, pw: Worker,
                             dw: Worker, t0: float, allow_early: bool) -> Decoded | Any:
        """The prefill leg, then the decode leg with the flow's hand-off."""
        tracked = flow.tracked(pw)
        drains = flow.drains and not tracked
        ledger = self.ledger
        ctx = None
        if flow.rendezvous:
            try:
                ctx = await self.up.bootstrap(pw)
            except MeshError as err:
                raise RePair(err, pipeline=pw) from None
        e = ledger.begin(creq.request_id, pw) if tracked else None   # only what the mesh can settle
        headers = self._headers(request, creq)
        span, ph = self._span("prefill", creq, pw, headers)
        pbody = flow.prefill_body(creq, pw, dw, self.mesh_id)
        call = self.up.open("prefill", pw).json(creq.path, pbody, ph, self.cfg.timeouts.prefill,
                                                lift=flow.lift_block_ids)
        # an engine without a release API keeps what a cut prefill held: let it finish, then drain
        job = request.loop.create_task(call) if drains else None
        try:
            pres = await (asyncio.shield(job) if job is not None else call)
            self._end(span)
        except MeshError as err:
            self._end(span, err)
            if e is not None:
                ledger.prefill_failed(e, uncertain=err.may_hold_kv)
            if not err.may_hold_kv and err.status >= 500:
                raise RePair(err, pipeline=pw) from None
            raise
        except BaseException as err:  # cancelled by a client that left
            self._end(span, err)
            if e is not None:
                ledger.prefill_failed(e, uncertain=True)
            if job is not None:
                self.bg.spawn(self._drain_after(job, flow, creq, pw, dw, pbody, ctx))
            raise
        t1 = request.loop.time()
        self.metrics.leg("prefill", t1 - t0)
        try:
            h = flow.handoff(creq, pw, dw, pres, allow_early and self.cfg.first_token_early, pbody, ctx)
        except ProtocolError as err:
            raw = pres.get("kv_transfer_params")
            tid = raw.get("transfer_id") if isinstance(raw, dict) else None
            if e is not None and isinstance(tid, (str, int)):
                ledger.held(e, str(tid), 0)
                await self.reclaim(e, "bad-handoff")
            elif e is not None:
                ledger.prefill_failed(e, uncertain=True)
            self.up.failed("prefill", pw, "garbage")
            raise UpstreamError(f"prefill pipeline {pw.id} answered without valid kv_transfer_params: "
                                f"{err.message}") from None
        if e is not None:
            ledger.held(e, h.key, h.blocks)
        data = orjson.dumps(h.decode_body)
        span, dh = self._span("decode", creq, dw, headers)
        if span is not None and h.key:
            span.set_attribute("atomesh.kv.transfer_id", h.key)
            span.set_attribute("atomesh.kv.blocks", h.blocks)
        early = None
        try:
            if h.early:
                early = await self._send_first_token(request, creq, pres, h, t0)
            t_open = time.time_ns()
            leg, first = await self._open_leg("decode", dw, creq, data, dh, flow.retry_decode, source=pw)
            self.fleet.succeeded(pw.id)  # the decode has its KV: the pipeline served well
            self._pulls.ok(leg.w.id)
            if span is not None:
                # (type: ignore below) a span exists only when tracing is on
                self.tracing.kv_pull(creq.request_id, leg.w, t_open,  # type: ignore[union-attr]
                                     leg.resp.headers.get(KV_PULL_HEADER) if leg.resp else None)
        except (asyncio.CancelledError, ConnectionResetError) as err:  # the client left before decode had the KV
            self._end(span, err)
            if e is not None:
                self.bg.spawn(self.reclaim(e, "client-disconnect"))
            elif drains and flow.drain_on(err):
                self.bg.spawn(self._drain(flow, creq, pw, h, None))
            raise
        except Exception as err:
            self._end(span, err)
            if flow.rendezvous:  # a stale engine id fails the pull: read it again next time
                self.up.forget_bootstrap(pw)
            if e is not None:  # freed before the client hears of the failure
                await self.reclaim(e, "decode-failed")
            elif drains and flow.drain_on(err):
                self.bg.spawn(self._drain(flow, creq, pw, h, dw))
            if h.lifted is not None and isinstance(err, UpstreamClientError) and not h.lifted.valid():
                # the decode refused block ids the mesh passed on unparsed (mesh.flows.lift_block_ids):
                # the prefill's garbage, as the whole parse would have found before the decode leg
                self.up.failed("prefill", pw, "garbage")
                err = UpstreamError(f"prefill pipeline {pw.id} answered without valid kv_transfer_params: "
                                    "kv_transfer_params.remote_block_ids must be an array of integers")
                if early is None:
                    raise err from None
            if isinstance(err, KVSourceLost):  # the pipeline is at fault, unless the decode fails them all
                if self._pulls.decode_at_fault(dw.id, pw.id):
                    self.up.failed("decode", dw, "kv_pull")
                else:
                    self.up.failed("prefill", pw, "kv_source")
                if early is None:
                    raise RePair(err, pipeline=pw) from None
            elif early is None and not flow.retry_decode and isinstance(err, (UpstreamError, UpstreamTimeout)):
                # params are spent: a new prefill (where the pull may have failed on the prefill's
                # side, e.g. a stale engine id, the decode engine is not blamed)
                raise RePair(err, decode=None if flow.rendezvous else dw) from None
            if early is None:
                raise
            if isinstance(err, MeshError):  # the stream has begun: end it with an error event
                await early.write(error_event(err))
                await early.write_eof()
                return early
            raise
        if e is not None:
            ledger.decoding(e)

        def settle() -> None:
            if e is not None:
                ledger.decode_done(e)
            self._end(span)
        return Decoded(leg, first, t1, early, settle)

    async def _concurrent(self, request: Client, creq: ClientRequest, flow: Any, pw: Worker, dw: Worker,
                          t0: float) -> Decoded:
        """Both legs at once, meeting on the flow's rendezvous; the decode answers the client.

        The prefill leg is a task; the decode leg runs in this request's own task (a task, its
        start and its done-callback hop less per request: the loop's wake-ups per SGLang JSON
        request went from 6.4 to 4.5, bench/mesh_dialect.py). A prefill that fails while the
        decode still waits for its first bytes cancels this task (the decode would wait for a room
        nobody fills); that cancel, and only that one, becomes the prefill's error here."""
        pbody, dbody = flow.bodies(creq, pw)
        headers = self._headers(request, creq)
        pspan, ph = self._span("prefill", creq, pw, headers)
        dspan, dh = self._span("decode", creq, dw, headers)
        loop = request.loop
        me = asyncio.current_task(loop)
        assert me is not None
        pre = loop.create_task(self.up.open("prefill", pw).json(creq.path, pbody, ph, self.cfg.timeouts.prefill))
        if pspan is not None:
            pre.add_done_callback(lambda f: self._end(pspan, None if f.cancelled() else f.exception()))
        cut = False      # the prefill failed first and cancelled this task
        waiting = True   # the decode leg has no answer yet

        def prefill_done(f: asyncio.Future[Any]) -> None:
            nonlocal cut
            if waiting and not f.cancelled() and f.exception() is not None:
                cut = True
                me.cancel()
        pre.add_done_callback(prefill_done)
        try:
            try:
                leg, first = await self._open_leg("decode", dw, creq, orjson.dumps(dbody), dh, retry=False,
                                                  source=pw)
            except asyncio.CancelledError:
                if cut and me.uncancel() == 0:   # ours alone (not also a client that left)
                    perr = pre.exception()
                    if isinstance(perr, MeshError) and perr.status >= 500:
                        raise RePair(perr, pipeline=pw) from None
                    raise perr  # type: ignore[misc]  # set: the prefill failed, that is why `cut`
                raise
            except (UpstreamError, UpstreamTimeout) as err:
                raise RePair(err, decode=dw) from None
            finally:
                waiting = False
                pre.remove_done_callback(prefill_done)
        except BaseException as err:
            self._end(dspan, err)
            pre.cancel()
            await asyncio.gather(pre, return_exceptions=True)
            raise
        pre.add_done_callback(lambda f: self._settle_prefill(f, pw, t0))
        self.bg.spawn(pre)   # (a callback, not a task awaiting it: one task less per request)
        return Decoded(leg, first, t0, None, lambda: self._end(dspan))

    def _settle_prefill(self, pre: asyncio.Future[dict[str, Any]], pw: Worker, t0: float) -> None:
        """A prefill leg finished beside its decode: time it, close its breaker if it went well."""
        if pre.cancelled():
            return
        err = pre.exception()
        if err is not None:
            if not isinstance(err, MeshError):   # a MeshError is counted against the pipeline by its leg
                log.error("request's prefill leg on %s failed", pw.id, exc_info=err)
            return
        self.metrics.leg("prefill", pre.get_loop().time() - t0)
        self.fleet.succeeded(pw.id)

    # -- orphans on engines without a release API --------------------------------------------

    async def _drain_after(self, job: asyncio.Future[dict[str, Any]], flow: Flow, creq: ClientRequest,
                           pw: Worker, dw: Worker, sent: dict[str, Any], ctx: Bootstrap | None) -> None:
        """The client left during the prefill: let it finish (bounded by the prefill timeout), then
        drain what it holds."""
        try:
            pres = await job
            h = flow.handoff(creq, pw, dw, pres, False, sent, ctx)
        except (MeshError, asyncio.CancelledError):
            return  # it failed: it holds nothing the mesh can name
        await self._drain(flow, creq, pw, h, None)

    async def _drain(self, flow: Flow, creq: ClientRequest, pw: Worker, h: Handoff, avoid: Worker | None) -> None:
        """Free an orphaned transfer: a one-token decode leg on the prefill's params, its answer
        discarded, so the engine's consumer-driven release frees the producer."""
        if not h.key:
            return
        e = self.ledger.orphan(creq.request_id, pw, h.key, h.blocks)
        try:
            body = flow.drain_body(creq, h, await self.up.bootstrap(pw, fresh=True) if flow.rendezvous else None)
        except MeshError as err:
            self.metrics.drain("failed")
            self.ledger.unreclaimable(e, err.message)
            return
        if body is None:
            self.ledger.unreclaimable(e, f"the {flow.dialect} flow has no drain leg")
            return
        data = orjson.dumps(body)
        headers = {"Content-Type": "application/json", "X-Request-Id": f"{creq.request_id}-drain"}
        cands = [w for w in self.fleet.table.candidates("decode", creq.model, flow.dialect) if w != avoid]
        if avoid is not None:
            cands.append(avoid)  # the engine that failed goes last, but goes
        why = f"no healthy {flow.dialect} decode engine for model {creq.model!r}"
        for w in cands[:3]:
            try:
                async with self.up.open("decode", w) as leg:
                    await leg.send(creq.path, data, headers, first_byte=self.cfg.timeouts.decode_first_byte,
                                   stream=False)
                    leg.ok()
            except MeshError as err:
                why = err.message
                continue
            self.metrics.drain("drained")
            self.ledger.drained(e)
            return
        self.metrics.drain("failed")
        self.ledger.unreclaimable(e, why)

    async def _send_first_token(self, request: Client, creq: ClientRequest, pres: dict[str, Any],
                                h: Handoff, t0: float) -> Any:
        """Open the client's stream with the prefill's token: TTFT is the prefill's latency."""
        try:
            c0 = pres["choices"][0]
            text = c0["message"]["content"] if creq.kind == "chat" else c0["text"]
            lps = c0.get("logprobs")   # the first token's, where the client asked for logprobs
        except (KeyError, IndexError, TypeError, AttributeError):
            text, lps = None, None
        if not isinstance(text, str):
            raise UpstreamError("prefill answer has no first-token text to send early")
        out = await request.open_stream(200, {
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": creq.request_id})
        ans = Answer(creq.kind, creq.model, creq.request_id, h.params.get("response_meta"))
        ids = [h.first_token_id] if creq.body.get("return_token_ids") and h.first_token_id is not None else None
        await out.write(ans.first_chunk() + ans.chunk(text, None, ids, logprobs=lps if isinstance(lps, dict) else None))
        self.metrics.ttft(creq.kind, request.loop.time() - t0)
        return out

    # -- several sequences in one request ------------------------------------------------------

    async def _fanout(self, request: Client, creq: ClientRequest, t0: float) -> Any:
        parts = split(creq)
        sem = asyncio.Semaphore(FANOUT_CONCURRENCY)

        async def run(p: Part) -> Decoded:
            async with sem:
                d = await self._pair(request, p.creq, t0, allow_early=False)
                assert isinstance(d, Decoded)  # no early stream: nothing answered the client yet
                return d

        tasks = [request.loop.create_task(run(p)) for p in parts]
        try:
            decs = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            for r in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(r, Decoded):
                    r.close()
            raise
        merge = Merge(creq)
        if not creq.stream:
            try:
                body = merge.whole(parts, [d.first for d in decs])
            finally:
                for d in decs:
                    d.close()
            self.metrics.leg("decode", request.loop.time() - min(d.t_leg for d in decs))
            return request.reply(body, 200, {"Content-Type": "application/json", "X-Request-Id": creq.request_id})
        return await self._merged_stream(request, creq, parts, decs, merge, t0)

    async def _merged_stream(self, request: Client, creq: ClientRequest, parts: list[Part],
                             decs: list[Decoded], merge: Merge, t0: float) -> Any:
        out: Stream | None = None
        q: asyncio.Queue[tuple[Part, bytes | None]] = asyncio.Queue()

        async def pump(p: Part, d: Decoded) -> None:
            buf = d.first
            try:
                while True:
                    while (i := buf.find(SSE_END)) >= 0:
                        await q.put((p, buf[:i + 2]))
                        buf = buf[i + 2:]
                    # (type: ignore below) a decode leg that answered has its response
                    chunk = await d.leg.resp.readany()  # type: ignore[union-attr]
                    if not chunk:
                        break
                    buf += chunk
            except OSError as e:
                d.leg.failed("midstream_transport")
                await q.put((p, error_event(UpstreamError(f"decode worker {d.leg.w.id} failed mid-stream: {e}"))))
            finally:
                d.close()
                q.put_nowait((p, None))

        tasks = [request.loop.create_task(pump(p, d)) for p, d in zip(parts, decs)]
        try:
            out = await request.open_stream(200, {
                "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": creq.request_id})
            self.metrics.ttft(creq.kind, request.loop.time() - t0)
            left = len(tasks)
            while left:
                p, ev = await q.get()
                if ev is None:
                    left -= 1
                    continue
                m = merge.event(p, ev)
                if m is not None:
                    await out.write(m)
                if ev.startswith(b"event: error"):
                    await out.write_eof()
                    return out
            await out.write(merge.tail())
            await out.write_eof()
            return out
        except ConnectionResetError:   # the client left
            return out if out is not None else request.reply(b"", 499, {})
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- regular --------------------------------------------------------------------------

    async def regular(self, request: Client, creq: ClientRequest) -> Any:
        t0 = request.loop.time()
        w = self._pick("worker", creq)
        headers = self._headers(request, creq)
        leg, first = await self._open_leg("worker", w, creq, creq.raw or orjson.dumps(creq.body), headers, retry=True)
        return await self._relay(request, creq, Decoded(leg, first, t0), t0)

    # -- the streamed leg -------------------------------------------------------------------

    async def _open_leg(self, role: str, w: Worker, creq: ClientRequest, data: bytes | memoryview,
                        headers: dict[str, str], retry: bool, source: Worker | None = None) -> tuple[Leg, bytes]:
        """Open the streamed leg; with `retry`, a failure before the first byte moves it to another
        worker of the same dialect (`decode_retries` times). A KVSourceLost is never retried here:
        another decode engine would pull from the same source."""
        tried: tuple[Worker, ...] = ()
        while True:
            leg = self.up.open(role, w, source)
            try:
                first = await leg.send(creq.path, data, headers, first_byte=self.cfg.timeouts.decode_first_byte,
                                       stream=creq.stream, idle=self.cfg.timeouts.decode_idle)
                leg.ok()
                return leg, first
            except KVSourceLost:
                raise
            except (UpstreamError, UpstreamTimeout) as e:
                tried += (w,)
                if not retry or len(tried) > self.cfg.decode_retries:
                    raise
                try:
                    w = self._pick(role, creq, exclude=tried,
                                   dialect=w.record.dialect if role == "decode" else None)
                except NoWorker:
                    raise e from None
                self.metrics.retry(role)
                log.info("request %s: %s leg failed (%s); retrying on %s", creq.request_id, role,
                         e.message, w.id)
                await asyncio.sleep(self._backoff(len(tried)))

    async def _relay(self, request: Client, creq: ClientRequest, d: Decoded, t0: float) -> Any:
        loop = request.loop
        role = d.leg.role
        resp = d.leg.resp
        assert resp is not None
        try:
            ctype = resp.headers.get("content-type", "application/json")
            if not creq.stream:
                self.metrics.leg(role, loop.time() - d.t_leg)
                return request.reply(d.first, resp.status, {"Content-Type": ctype, "X-Request-Id": creq.request_id})
            if d.early is not None:  # the stream is open: the first token went out already
                out = d.early
            else:
                out = await request.open_stream(resp.status, {
                    "Content-Type": ctype, "Cache-Control": "no-cache", "X-Request-Id": creq.request_id})
                self.metrics.ttft(creq.kind, loop.time() - t0)
            try:
                await self._pump(out, d.leg, d.first)
            except ConnectionResetError:  # the client left mid-stream: the decode leg is cut below
                log.debug("request %s: client left mid-stream", creq.request_id)
                return out
            self.metrics.leg(role, loop.time() - d.t_leg)
            return out
        finally:
            d.close()

    async def _pump(self, out: Stream, leg: Leg, first: bytes) -> None:
        """Relay SSE bytes as they come. Only whole events go out, so an upstream cut mid-event
        can be followed by a clean `error` event the client's SSE parser understands. To the fast
        server's stream (`write_now`) the bytes go from the upstream's `data_received` itself
        (`H1Response.relay`): no task wakes per event."""
        resp = leg.resp
        assert resp is not None
        events = Events()
        now = getattr(out, "write_now", None)
        try:
            if now is not None:
                def sink(chunk: bytes) -> None:
                    whole = events.feed(chunk)
                    if whole and now(whole):   # the client reads slower than the decode writes
                        resp.hold()
                        out.on_resume(resp.unhold)  # type: ignore[attr-defined]  # a FastStream, as write_now

                framed = out.write_framed  # type: ignore[attr-defined]  # a FastStream, as write_now

                def whole_chunks(data: bytes, end: bool) -> None:   # chunks each ending an event: as they came
                    if framed(data, end):
                        resp.hold()
                        out.on_resume(resp.unhold)  # type: ignore[attr-defined]  # a FastStream, as write_now
                sink(first)
                # the framed path only while no partial event waits here (it would go out after):
                # `relay` tracks that from here on, as each payload ends with SSE_END or not
                await resp.relay(sink, whole_chunks, SSE_END, at_tail=not events.pending)
            else:
                read = resp.readany
                chunk = first
                while True:
                    whole = events.feed(chunk)
                    if whole:
                        await out.write(whole)
                    chunk = await read()
                    if not chunk:
                        break
        except ConnectionResetError:   # the client left (an upstream's failure is an H1Error)
            raise
        except OSError as e:  # H1Error, TimeoutError (idle), socket errors
            kind = "timeout" if isinstance(e, TimeoutError) else "transport"
            leg.failed(f"midstream_{kind}")
            err: MeshError = (UpstreamTimeout(f"{leg.role} worker {leg.w.id} stalled mid-stream")
                              if kind == "timeout" else
                              UpstreamError(f"{leg.role} worker {leg.w.id} failed mid-stream: {e}"))
            await out.write(error_event(err))
            await out.write_eof()
            return
        if events.pending:
            await out.write(events.pending)
        await out.write_eof()
