"""Request orchestration: the PD flow (dialect `atom`, PROTOCOL.md sections 4-5) and the
regular single-pool flow.

PD: pick a pipeline and a decode engine -> prefill leg (`max_tokens=1`, `stream=false`,
`kv_transfer_params` asking for remote decode) -> decode leg with the prefill's
`kv_transfer_params` forwarded verbatim -> the decode answer relayed byte for byte.

Failure semantics:
- prefill non-2xx or timeout: an OpenAI error (502/503/504, or the prefill's 4xx as it
  came); decode is never called.
- decode fails before its first byte: another decode engine is tried (`decode_retries`
  times); if none succeeds, an error, and the prefill is told to release the KV.
- decode answers `kv_transfer_failed` (it could not pull from the pipeline): the pipeline is
  blamed, not the decode engine, and the whole request is re-paired on another pipeline while
  nothing has reached the client (`retries` times).
- decode fails mid-stream: the stream ends with an SSE `error` event.
- client disconnect: the running leg is cancelled (its connection closed) and the prefill is
  told to release the KV unless the decode leg already has it (its first byte arrived).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from types import MappingProxyType
from typing import Any, Awaitable, Callable

import orjson
from aiohttp import web

from mesh.config import MeshConfig
from mesh.dialects import ATOM, SGLANG, one_token, sglang_bodies, vllm_decode_params, vllm_prefill_body
from mesh.errors import (KVSourceLost, MeshError, ModelNotFound, NoWorker, ProtocolError, UpstreamError,
                         UpstreamTimeout)
from mesh.fleet import Fleet
from mesh.ledger import UNTRACKED, Ledger
from mesh.metrics import Metrics
from mesh.protocol import KVHandoffParams, KVRequestParams, handoff_for_decode
from mesh.request import ClientRequest
from mesh.sse import Answer
from mesh.snapshot import View, Worker
from mesh.h1 import H1Error, H1Response
from mesh.tracing import KV_PULL_HEADER, Tracing
from mesh.upstream import Upstream, upstream_status_error
from policies import Policy

log = logging.getLogger(__name__)

SSE_END = b"\n\n"


class Background:
    """Fire-and-forget work that must still finish (releases): kept, and awaited at shutdown."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def drain(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)


def prefill_body(body: dict[str, Any], decode: Worker, mesh_id: str) -> dict[str, Any]:
    """Section 4: the client body with stream off, one token, and where the KV will go."""
    out = one_token(body)
    rec = decode.record
    out["kv_transfer_params"] = KVRequestParams(
        remote_engine_id=decode.id, remote_host=decode.host, remote_port=decode.port,
        remote_handshake_port=int(rec.extra.get("kv_port", 0)), remote_tp_size=rec.tp_size,
        extra={"mesh_id": mesh_id}).encode()
    return out


class RePair(Exception):
    """A PD pair failed before anything reached the client: run the request on a new pair, without
    the worker(s) named here, or answer `cause` when no try is left."""

    def __init__(self, cause: MeshError, *, pipeline: Worker | None = None, decode: Worker | None = None) -> None:
        super().__init__(cause.message)
        self.cause, self.pipeline, self.decode = cause, pipeline, decode


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])[:300]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


def error_event(err: MeshError) -> bytes:
    return b"event: error\ndata: " + err.body() + SSE_END


class Proxy:
    def __init__(self, cfg: MeshConfig, fleet: Fleet, upstream: Upstream, metrics: Metrics,
                 policies: dict[str, Policy], background: Background, mesh_id: str, ledger: Ledger,
                 tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.up = upstream
        self.metrics = metrics
        self.policies = policies
        self.bg = background
        self.mesh_id = mesh_id
        self.ledger = ledger
        self.load = MappingProxyType(fleet.in_flight)
        self.kv_free = MappingProxyType(fleet.kv_free)
        self.tracing = tracing
        self.handle: Callable[[web.Request, ClientRequest], Awaitable[web.StreamResponse]] = (
            self.pd if cfg.pd else self.regular)
        if tracing is not None:
            self.handle = self._traced(self.handle)

    def _traced(self, handle: Callable[[web.Request, ClientRequest], Awaitable[web.StreamResponse]]
                ) -> Callable[[web.Request, ClientRequest], Awaitable[web.StreamResponse]]:
        tracing = self.tracing
        assert tracing is not None

        async def traced(request: web.Request, creq: ClientRequest) -> web.StreamResponse:
            with tracing.request(creq.request_id, creq.path, creq.model, creq.stream) as span:
                try:
                    resp = await handle(request, creq)
                except MeshError as e:
                    span.set_attribute("http.response.status_code", e.status)
                    tracing.end_error(span, e)
                    raise
                span.set_attribute("http.response.status_code", resp.status)
                return resp
        return traced

    def _leg(self, name: str, creq: ClientRequest, w: Worker, headers: dict[str, str]) -> tuple[Any, dict[str, str]]:
        """A leg's span and the headers that carry it (the same headers when tracing is off)."""
        if self.tracing is None:
            return None, headers
        h = dict(headers)
        return self.tracing.start_leg(name, creq.request_id, w, h), h

    def _end(self, span: Any, error: BaseException | None = None) -> None:
        if span is not None:
            self.tracing.end(span, error)  # type: ignore[union-attr]

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with full jitter, capped at 1 s."""
        return min(1.0, self.cfg.retry_backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

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

    async def pd(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        """Run the request on a (pipeline, decode) pair; while nothing has reached the client, a
        failed pair is replaced by a new one (`retries` times, jittered backoff)."""
        t0 = asyncio.get_running_loop().time()
        headers = {"Content-Type": "application/json", "X-Request-Id": creq.request_id}
        not_p: tuple[Worker, ...] = ()
        not_d: tuple[Worker, ...] = ()
        attempt = 0
        while True:
            try:
                pw = self._pick("prefill", creq, exclude=not_p)
                dw = self._pick("decode", creq, exclude=not_d, dialect=pw.record.dialect)
                if pw.record.dialect == SGLANG:
                    return await self._pd_sglang(request, creq, headers, t0, pw, dw)
                return await self._pd_prefill_first(request, creq, headers, t0, pw, dw)
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

    async def _pd_prefill_first(self, request: web.Request, creq: ClientRequest, headers: dict[str, str],
                                t0: float, pw: Worker, dw: Worker) -> web.StreamResponse:
        """Dialects `atom` and `vllm`: the prefill leg, then the decode leg with its params."""
        atom = pw.record.dialect == ATOM
        ledger = self.ledger if atom else UNTRACKED  # vLLM engines free their KV themselves
        e = ledger.begin(creq.request_id, pw)
        body = prefill_body(creq.body, dw, self.mesh_id) if atom else vllm_prefill_body(creq.body)
        span, ph = self._leg("prefill", creq, pw, headers)
        try:
            pres = await self.up.post_json("prefill", pw, creq.path, body, ph, self.cfg.timeouts.prefill,
                                           settle=False)
            self._end(span)
        except MeshError as err:
            self._end(span, err)
            # a prefill that answered with an error (or never connected) holds nothing; one cut
            # off mid-flight may: only the first kind is retried, on a new pair
            sure = bool(getattr(err, "answered", False))
            ledger.prefill_failed(e, uncertain=not sure)
            if sure and err.status >= 500:
                raise RePair(err, pipeline=pw) from None
            raise
        except BaseException as err:  # cancelled by a client that left
            self._end(span, err)
            ledger.prefill_failed(e, uncertain=True)
            raise
        t1 = asyncio.get_running_loop().time()
        self.metrics.leg("prefill", t1 - t0)
        raw = pres.get("kv_transfer_params")
        try:
            kv = KVHandoffParams.decode(raw, "kv_transfer_params") if atom else vllm_decode_params(raw)
        except ProtocolError as err:
            if atom and isinstance(raw, dict) and isinstance(raw.get("transfer_id"), str):
                ledger.held(e, raw["transfer_id"], 0)
                await ledger.reclaim(e, "bad-handoff")
            else:
                ledger.prefill_failed(e, uncertain=True)
            self.up.failed("prefill", pw, "garbage")
            raise UpstreamError(f"prefill pipeline {pw.id} answered without valid kv_transfer_params: "
                                f"{err.message}") from None
        dbody = dict(creq.body)
        early = None
        fte = False
        if isinstance(kv, KVHandoffParams):
            ledger.held(e, kv.transfer_id, len(kv.remote_block_ids))
            dkv = dbody["kv_transfer_params"] = handoff_for_decode(raw)
            # our additions: the response's id and created, so the stream is the same bytes however
            # it is sent, and (first token early) that the role chunk and token 0 are already out
            meta = {"id": ("chatcmpl-" if creq.kind == "chat" else "cmpl-") + creq.request_id,
                    "created": int(time.time())}
            dkv["response_meta"] = meta
            fte = self.cfg.first_token_early and creq.stream
            if fte:
                dkv["first_token_early"] = True
        else:  # vllm: the prefill's params verbatim; the decode engine writes every token itself
            dbody["kv_transfer_params"] = kv
        data = orjson.dumps(dbody)
        span, dh = self._leg("decode", creq, dw, headers)
        if span is not None and isinstance(kv, KVHandoffParams):
            span.set_attribute("atomesh.kv.transfer_id", kv.transfer_id)
            span.set_attribute("atomesh.kv.blocks", len(kv.remote_block_ids))
        try:
            if fte:
                early = await self._send_first_token(request, creq, pres, kv, meta, t0)
            t_open = time.time_ns()
            dw, resp, first = await self._open_with_retry("decode", dw, creq, data, dh)
            self.fleet.succeeded(pw.id)  # the decode has its KV: the pipeline served well
            if span is not None:
                self.tracing.kv_pull(creq.request_id, dw, t_open, resp.headers.get(KV_PULL_HEADER))  # type: ignore[union-attr]
        except (asyncio.CancelledError, ConnectionResetError) as err:  # the client left before decode had the KV
            self._end(span, err)
            self.bg.spawn(ledger.reclaim(e, "client-disconnect"))
            raise
        except Exception as err:
            self._end(span, err)
            # freed before the client hears of the failure
            await ledger.reclaim(e, "decode-failed")
            if isinstance(err, KVSourceLost):  # the pipeline, not the decode engine, is at fault
                self.up.failed("prefill", pw, "kv_source")
                if early is None:
                    raise RePair(err, pipeline=pw) from None
            if early is None:
                raise
            if isinstance(err, MeshError):  # the stream has begun: end it with an error event
                await early.write(error_event(err))
                await early.write_eof()
                return early
            raise
        ledger.decoding(e)
        try:
            return await self._relay(request, creq, dw, resp, first, t0, t1, early)
        finally:
            ledger.decode_done(e)
            self._end(span)

    async def _pd_sglang(self, request: web.Request, creq: ClientRequest, headers: dict[str, str],
                         t0: float, pw: Worker, dw: Worker) -> web.StreamResponse:
        """Dialect `sglang`: both legs at once, meeting on a bootstrap room; the decode answers."""
        pbody, dbody = sglang_bodies(creq.body, pw)
        pspan, ph = self._leg("prefill", creq, pw, headers)
        dspan, dh = self._leg("decode", creq, dw, headers)
        pre = asyncio.ensure_future(self.up.post_json("prefill", pw, creq.path, pbody, ph,
                                                      self.cfg.timeouts.prefill, settle=False))
        if pspan is not None:
            pre.add_done_callback(lambda f: self._end(pspan, None if f.cancelled() else f.exception()))
        dec = asyncio.ensure_future(self._open("decode", dw, creq, orjson.dumps(dbody), dh))
        try:
            done, _ = await asyncio.wait((pre, dec), return_when=asyncio.FIRST_COMPLETED)
            if dec not in done and pre.exception() is not None:
                perr = pre.exception()  # the decode would wait for a room nobody fills
                dec.cancel()
                await asyncio.gather(dec, return_exceptions=True)
                if isinstance(perr, MeshError) and perr.status >= 500:
                    raise RePair(perr, pipeline=pw) from None
                raise perr  # type: ignore[misc]
            try:
                resp, first = await dec
            except (UpstreamError, UpstreamTimeout) as err:
                raise RePair(err, decode=dw) from None
        except BaseException as err:
            self._end(dspan, err)
            for t in (pre, dec):
                t.cancel()
            await asyncio.gather(pre, dec, return_exceptions=True)
            raise
        self.bg.spawn(self._settle_prefill(pre, pw, t0))
        try:
            return await self._relay(request, creq, dw, resp, first, t0, t0)
        finally:
            self._end(dspan)

    async def _settle_prefill(self, pre: asyncio.Future[dict[str, Any]], pw: Worker, t0: float) -> None:
        """An sglang prefill leg finishing beside its decode: time it, close its breaker if it went well."""
        try:
            await pre
        except MeshError:
            return  # counted against the pipeline by post_json
        self.metrics.leg("prefill", asyncio.get_running_loop().time() - t0)
        self.fleet.succeeded(pw.id)

    async def _send_first_token(self, request: web.Request, creq: ClientRequest, pres: dict[str, Any],
                                kv: KVHandoffParams, meta: dict[str, Any], t0: float) -> web.StreamResponse:
        """Open the client's stream with the prefill's token: TTFT is the prefill's latency."""
        try:
            c0 = pres["choices"][0]
            text = c0["message"]["content"] if creq.kind == "chat" else c0["text"]
        except (KeyError, IndexError, TypeError):
            text = None
        if not isinstance(text, str):
            raise UpstreamError("prefill answer has no first-token text to send early")
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": creq.request_id})
        await out.prepare(request)
        ans = Answer(creq.kind, creq.model, creq.request_id, meta)
        head = ans.first_chunk()
        ids = [kv.first_token_id] if creq.body.get("return_token_ids") else None
        await out.write(head + ans.chunk(text, None, ids))
        self.metrics.ttft(creq.kind, asyncio.get_running_loop().time() - t0)
        return out

    # -- regular --------------------------------------------------------------------------

    async def regular(self, request: web.Request, creq: ClientRequest) -> web.StreamResponse:
        t0 = asyncio.get_running_loop().time()
        w = self._pick("worker", creq)
        headers = {"Content-Type": "application/json", "X-Request-Id": creq.request_id}
        w, resp, first = await self._open_with_retry("worker", w, creq, await request.read(), headers)
        return await self._relay(request, creq, w, resp, first, t0, t0)

    # -- the streamed leg -------------------------------------------------------------------

    async def _open_with_retry(self, role: str, w: Worker, creq: ClientRequest, data: bytes,
                               headers: dict[str, str]) -> tuple[Worker, H1Response, bytes]:
        tried: tuple[Worker, ...] = ()
        while True:
            try:
                resp, first = await self._open(role, w, creq, data, headers)
                return w, resp, first
            except KVSourceLost:
                raise  # another decode engine would pull from the same source: re-pair instead
            except (UpstreamError, UpstreamTimeout) as e:
                tried += (w,)
                if len(tried) > self.cfg.decode_retries:
                    raise
                try:
                    w = self._pick(role, creq, exclude=tried)
                except NoWorker:
                    raise e from None
                self.metrics.retry(role)
                log.info("request %s: %s leg failed (%s); retrying on %s", creq.request_id, role,
                         e.message, w.id)
                await asyncio.sleep(self._backoff(len(tried)))

    async def _open(self, role: str, w: Worker, creq: ClientRequest, data: bytes,
                    headers: dict[str, str]) -> tuple[H1Response, bytes]:
        """Send the leg; return its response and first bytes (the whole body unless streaming).
        On return the worker is counted in flight; `_relay` uncounts it."""
        flight = self.fleet.in_flight
        flight[w.id] = flight.get(w.id, 0) + 1
        resp: H1Response | None = None
        limit = self.cfg.timeouts.decode_first_byte
        try:
            async with asyncio.timeout(limit):
                resp = await self.up.h1.post(w.host, w.port, creq.path, data, headers, tls=w.tls,
                                             idle=self.cfg.timeouts.decode_idle)
                if resp.status >= 300:
                    body = await resp.read()
                    if role == "decode" and resp.status == 502 and b'"kv_transfer_failed"' in body:
                        self.up.failed(role, w, "kv_transfer", passive=False)
                        raise KVSourceLost(f"decode worker {w.id} could not pull the KV: "
                                           f"{_error_message(body)}")
                    self.up.failed(role, w, f"status_{resp.status // 100}xx", passive=resp.status >= 500)
                    raise upstream_status_error(role, w, resp.status, body)
                first = await (resp.readany() if creq.stream else resp.read())
            if not first:
                self.up.failed(role, w, "empty")
                raise UpstreamError(f"{role} worker {w.id} closed its answer without a byte")
            self.fleet.succeeded(w.id)
            return resp, first
        except BaseException as e:
            flight[w.id] -= 1
            if resp is not None:
                resp.close()
            if isinstance(e, TimeoutError):
                self.up.failed(role, w, "timeout")
                raise UpstreamTimeout(f"{role} worker {w.id} sent no byte within {limit:g}s") from None
            if isinstance(e, OSError):
                self.up.failed(role, w, "transport" if isinstance(e, H1Error) else "connect")
                raise UpstreamError(f"{role} worker {w.id} failed: {e.__class__.__name__}: {e}") from None
            raise

    async def _relay(self, request: web.Request, creq: ClientRequest, w: Worker, resp: H1Response, first: bytes,
                     t0: float, t_leg: float, early: web.StreamResponse | None = None) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        role = "worker" if not self.cfg.pd else "decode"
        try:
            ctype = resp.headers.get("content-type", "application/json")
            if not creq.stream:
                self.metrics.leg(role, loop.time() - t_leg)
                out = web.Response(body=first, status=resp.status,
                                   headers={"Content-Type": ctype, "X-Request-Id": creq.request_id})
                return out
            if early is not None:  # the stream is open: the first token went out already
                out = early
            else:
                out = web.StreamResponse(status=resp.status, headers={
                    "Content-Type": ctype, "Cache-Control": "no-cache", "X-Request-Id": creq.request_id})
                await out.prepare(request)
                self.metrics.ttft(creq.kind, loop.time() - t0)
            try:
                await self._pump(out, resp, first, w, role)
            except ConnectionResetError:  # the client left mid-stream: the decode leg is cut below
                log.debug("request %s: client left mid-stream", creq.request_id)
                return out
            self.metrics.leg(role, loop.time() - t_leg)
            return out
        finally:
            self.fleet.in_flight[w.id] -= 1
            resp.close()

    async def _pump(self, out: web.StreamResponse, resp: H1Response, first: bytes,
                    w: Worker, role: str) -> None:
        """Relay SSE bytes as they come. Only whole events go out, so an upstream cut mid-event
        can be followed by a clean `error` event the client's SSE parser understands."""
        read = resp.readany
        pending = b""
        chunk = first
        while True:
            if not pending and chunk.endswith(SSE_END):
                await out.write(chunk)
            else:
                buf = pending + chunk
                cut = buf.rfind(SSE_END)
                if cut >= 0:
                    await out.write(buf[:cut + 2])
                pending = buf[cut + 2:] if cut >= 0 else buf
            try:
                chunk = await read()
            except OSError as e:  # H1Error, TimeoutError (idle), socket errors
                kind = "timeout" if isinstance(e, TimeoutError) else "transport"
                self.up.failed(role, w, f"midstream_{kind}")
                err: MeshError = (UpstreamTimeout(f"{role} worker {w.id} stalled mid-stream")
                                  if kind == "timeout" else
                                  UpstreamError(f"{role} worker {w.id} failed mid-stream: {e}"))
                await out.write(error_event(err))
                break
            if not chunk:
                if pending:
                    await out.write(pending)
                break
        await out.write_eof()

