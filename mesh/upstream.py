"""Calls to workers: the hot legs through `Leg` (the one door, over the lean keep-alive client
`mesh/h1.py`), the rest (releases, held listings, vLLM Mooncake bootstrap queries) over the app's one pooled aiohttp `ClientSession`.

A leg counts itself in the fleet's in-flight dict, reports failures to the fleet's passive health
check and to the metrics, and maps transport failures onto the mesh's exception tree: a timeout is
`UpstreamTimeout`, anything else on the wire `UpstreamError`, a worker's 4xx `UpstreamClientError`
(passed on as it came), its 5xx `UpstreamError`; each says whether the worker may still hold KV.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson

from contract.errors import (
    KVSourceLost,
    MeshError,
    ProtocolError,
    UpstreamClientError,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from contract.snapshot import Worker
from mesh.config import Timeouts
from mesh.fleet import Fleet
from mesh.flows import Bootstrap, bootstrap_addr, lift_block_ids, parse_bootstrap, place_block_ids
from mesh.h1 import IDLE_S, H1Error, H1Pool, H1Response
from mesh.metrics import Metrics
from mesh.pacer import Pacer

JSON_HEADERS = {"Content-Type": "application/json"}
BOOTSTRAP_TTL = 5.0  # seconds a prefill's engine ids are trusted before being read again


def upstream_status_error(leg: str, w: Worker, status: int, body: bytes) -> MeshError:
    """A worker's non-2xx answer as the error the client should see (it answered: it holds nothing)."""
    if 400 <= status < 500 and status != 408:
        return UpstreamClientError(status, _as_openai_error(body, status), f"{leg} refused: {status}")
    if status in (503, 429):
        return UpstreamError(f"{leg} worker {w.id} is unavailable ({status})", status=503,
                             code="upstream_unavailable", may_hold_kv=False)
    return UpstreamError(f"{leg} worker {w.id} failed with status {status}: {_error_message(body)}",
                         may_hold_kv=False)


def _error_message(body: bytes) -> str:
    """The message of an error answer: OpenAI's `error.message`, FastAPI's `detail`, or the text."""
    try:
        d = orjson.loads(body)
        if isinstance(d, dict):
            if isinstance(d.get("error"), dict):
                return str(d["error"].get("message"))[:300]
            if "detail" in d:
                return str(d["detail"])[:300]
    except orjson.JSONDecodeError:
        pass
    return body[:300].decode("utf-8", "replace")


def _as_openai_error(body: bytes, status: int) -> bytes:
    try:
        d = orjson.loads(body)
        if isinstance(d, dict) and isinstance(d.get("error"), dict):
            return body
    except orjson.JSONDecodeError:
        pass
    return error_body(f"worker refused the request ({status}): {_error_message(body)}", "invalid_request_error")


class Leg:
    """One call to one worker, the only door to it on the request path (docs/design.md item 13).

    From `Upstream.open` to `close()` (or the end of `async with`) the worker is counted in flight;
    every failure is mapped here, once, onto the mesh's errors (with `may_hold_kv` declared by what
    happened) and reported to the metrics and the worker's breaker."""

    __slots__ = ("up", "role", "w", "source", "resp", "_open")

    def __init__(self, up: "Upstream", role: str, w: Worker, source: Worker | None = None) -> None:
        """`source`: a PD decode leg's KV source (the prefill pipeline it pulls from)."""
        self.up, self.role, self.w, self.source = up, role, w, source
        self.resp: H1Response | None = None
        flight = up.fleet.in_flight
        flight[w.id] = flight.get(w.id, 0) + 1
        self._open = True

    async def __aenter__(self) -> "Leg":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            self.up.fleet.in_flight[self.w.id] -= 1
            if self.resp is not None:
                self.resp.close()

    def failed(self, kind: str, passive: bool = True) -> None:
        # a decode that stalls or drops while its KV source is down (a stage died under its pull)
        # is not the decode's fault: its breaker is left alone (the pipeline's probe takes that out)
        if passive and self.source is not None and not self.up.fleet.healthy(self.source.id):
            passive = False
        self.up.failed(self.role, self.w, kind, passive)

    def ok(self) -> None:
        """Close the worker's breaker (its call went well)."""
        self.up.fleet.succeeded(self.w.id)

    async def send(self, path: str, data: bytes | memoryview, headers: dict[str, str], *, first_byte: float,
                   stream: bool, idle: float | None = None) -> bytes:
        """POST `data`; return the first bytes of a 2xx answer (the whole body unless `stream`).
        On any failure the leg is closed and a mapped MeshError raised."""
        w, role = self.w, self.role
        if w.auth:  # the worker's own upstream key wins over a forwarded client key
            headers = {**headers, **w.auth}
        try:
            # `first_byte` bounds the connect, the head and the first bytes (the whole body unless
            # `stream`): one timer on the response (`H1Pool.post(deadline=)`)
            h1 = self.up.h1
            deadline = h1.loop.time() + first_byte
            self.resp = resp = await h1.post(w.host, w.port, path, data, headers, tls=w.tls, idle=idle,
                                             deadline=deadline)
            if resp.status >= 300:
                body = await resp.read()
                if role == "decode" and resp.status == 502 and b'"kv_transfer_failed"' in body:
                    self.failed("kv_transfer", passive=False)
                    raise KVSourceLost(f"decode worker {w.id} could not pull the KV: {_error_message(body)}")
                # a 503 is capacity (e.g. kv_exhausted) or a worker saying it is out: counted,
                # but it does not open the breaker (the health probe takes out what is down)
                self.failed(f"status_{resp.status // 100}xx", passive=resp.status >= 500 and resp.status != 503)
                raise upstream_status_error(role, w, resp.status, body)
            first = await (resp.readany() if stream else resp.read())
            resp.clear_deadline()
            if not first:
                self.failed("empty")
                raise UpstreamError(f"{role} worker {w.id} closed its answer without a byte")
            return first
        except BaseException as e:
            self.close()
            if isinstance(e, TimeoutError):
                self.failed("timeout")
                raise UpstreamTimeout(f"{role} worker {w.id} sent no answer within {first_byte:g}s") from None
            if isinstance(e, OSError):
                connect = self.resp is None and not isinstance(e, H1Error)
                self.failed("connect" if connect else "transport")
                raise UpstreamError(f"{role} worker {w.id} failed: {e.__class__.__name__}: {e}",
                                    may_hold_kv=not connect) from None
            raise

    async def json(self, path: str, body: dict[str, Any], headers: dict[str, str], timeout: float, *,
                   lift: bool = False) -> dict[str, Any]:
        """POST a JSON body and return the JSON object of its 2xx answer; the leg is closed after.
        `lift`: the answer's `kv_transfer_params.remote_block_ids` stays JSON bytes where it can
        (`mesh.flows.RawBlockIds`)."""
        try:
            data = await self.send(path, orjson.dumps(body), headers, first_byte=timeout, stream=False)
        finally:
            self.close()
        try:
            ids = None
            if lift:
                short, ids = lift_block_ids(data)
                if ids is not None:
                    out = orjson.loads(short)
                    if not (isinstance(out, dict) and place_block_ids(out, ids)):
                        ids = None
            if ids is None:
                out = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.failed("garbage")
            raise UpstreamError(f"{self.role} worker {self.w.id} answered with a body that is not JSON") from None
        if not isinstance(out, dict):
            self.failed("garbage")
            raise UpstreamError(f"{self.role} worker {self.w.id} answered with JSON that is not an object")
        return out


class Upstream:
    """Built once by `create_app`; `start()` (in the app's cleanup_ctx) opens the pooled session."""

    def __init__(self, fleet: Fleet, metrics: Metrics, timeouts: Timeouts, pacer: Pacer | None = None) -> None:
        self._session: aiohttp.ClientSession | None = None
        self.fleet = fleet
        self.metrics = metrics
        self.timeouts = timeouts
        self.h1 = H1Pool(connect_timeout=timeouts.connect, pacer=pacer)  # the hot legs
        # connect bound by aiohttp; whole-call bounds by asyncio.timeout around the call
        self.short = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect)
        self._bootstrap: dict[str, tuple[float, Bootstrap]] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() has not run")
        return self._session

    async def start(self) -> None:
        # idle connections closed before a server's own keep-alive can close them under a request (h1.IDLE_S)
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=IDLE_S)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              json_serialize=lambda o: orjson.dumps(o).decode())

    async def close(self) -> None:
        await self.h1.close()
        if self._session is not None:
            await self._session.close()

    def open(self, role: str, w: Worker, source: Worker | None = None) -> Leg:
        """A leg to `w`, counted in flight until it is closed (`source`: see `Leg`)."""
        return Leg(self, role, w, source)

    def failed(self, leg: str, w: Worker, kind: str, passive: bool = True) -> None:
        self.metrics.upstream_error(leg, kind)
        if passive:
            self.fleet.mark_failed(w.id)

    async def release(self, w: Worker, transfer_id: str, reason: str) -> bool | None:
        """`POST /kv/release` (idempotent on the holder): True if this call freed the transfer,
        False if it was already free, None if the holder could not be asked."""
        try:
            async with asyncio.timeout(self.timeouts.release):
                async with self.session.post(
                        w.url + "/kv/release", headers={**JSON_HEADERS, **w.auth}, timeout=self.short,
                        data=orjson.dumps({"transfer_id": transfer_id, "reason": reason})) as r:
                    body = await r.read()
                    status = r.status
            out = bool(orjson.loads(body).get("released")) if status < 300 else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            out = None
        self.metrics.release_sent(reason, {True: "freed", False: "already_free", None: "failed"}[out])
        return out

    async def bootstrap(self, w: Worker, fresh: bool = False) -> Bootstrap:
        """A vLLM Mooncake prefill's bootstrap answer (`GET {bootstrap}/query`), cached for
        BOOTSTRAP_TTL seconds (an engine id changes when the engine restarts); `fresh` asks again.
        An answer that cannot be had is the pipeline's failure: UpstreamError, holding nothing."""
        now = time.monotonic()
        hit = self._bootstrap.get(w.id)
        if hit is not None and not fresh and now - hit[0] < BOOTSTRAP_TTL:
            return hit[1]
        addr = bootstrap_addr(w)
        try:
            async with asyncio.timeout(self.timeouts.release):
                async with self.session.get(addr + "/query", timeout=self.short) as r:
                    body = await r.read()
                    status = r.status
            if status != 200:
                raise ProtocolError(f"bootstrap {addr}/query answered {status}")
            out = parse_bootstrap(addr, orjson.loads(body))
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ProtocolError) as e:
            self._bootstrap.pop(w.id, None)
            self.failed("prefill", w, "bootstrap")
            msg = e.message if isinstance(e, ProtocolError) else f"{e.__class__.__name__}: {e}"
            raise UpstreamError(f"prefill worker {w.id}: its bootstrap server could not be read: {msg}",
                                may_hold_kv=False) from None
        self._bootstrap[w.id] = (now, out)
        return out

    def forget_bootstrap(self, w: Worker) -> None:
        self._bootstrap.pop(w.id, None)

    async def get_held(self, w: Worker, since: int) -> bytes | None:
        """The raw `GET /kv/held?since=SEQ` answer of a pipeline, None when it cannot be had."""
        try:
            async with asyncio.timeout(self.timeouts.release):
                async with self.session.get(f"{w.url}/kv/held?since={since}", timeout=self.short,
                                            headers=w.auth) as r:
                    if r.status != 200:
                        return None
                    return await r.read()
        except (aiohttp.ClientError, TimeoutError):
            return None
