"""Calls to workers: the hot legs over the lean keep-alive client (`mesh/h1.py`), the rest
(releases, held listings) over the app's one pooled aiohttp `ClientSession`.

Every call counts itself in the fleet's in-flight dict, reports failures to the fleet's
passive health check and to the metrics, and maps transport failures onto the mesh's
exception tree: a timeout is `UpstreamTimeout`, anything else on the wire `UpstreamError`,
a worker's 4xx `UpstreamClientError` (passed on as it came), its 5xx `UpstreamError`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from mesh.config import Timeouts
from mesh.errors import MeshError, UpstreamClientError, UpstreamError, UpstreamTimeout, error_body
from mesh.fleet import Fleet
from mesh.h1 import H1Error, H1Pool, H1Response
from mesh.metrics import Metrics
from mesh.snapshot import Worker

JSON_HEADERS = {"Content-Type": "application/json"}


def upstream_status_error(leg: str, w: Worker, status: int, body: bytes) -> MeshError:
    """A worker's non-2xx answer as the error the client should see."""
    err: MeshError
    if 400 <= status < 500 and status != 408:
        err = UpstreamClientError(status, _as_openai_error(body, status), f"{leg} refused: {status}")
    elif status in (503, 429):
        err = UpstreamError(f"{leg} worker {w.id} is unavailable ({status})", status=503,
                            code="upstream_unavailable")
    else:
        err = UpstreamError(f"{leg} worker {w.id} failed with status {status}")
    err.answered = True  # type: ignore[attr-defined]  # the worker did answer: it holds nothing for it
    return err


def _as_openai_error(body: bytes, status: int) -> bytes:
    try:
        d = orjson.loads(body)
        if isinstance(d, dict) and isinstance(d.get("error"), dict):
            return body
    except orjson.JSONDecodeError:
        pass
    text = body[:500].decode("utf-8", "replace")
    return error_body(f"worker refused the request ({status}): {text}", "invalid_request_error")


class Upstream:
    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet, metrics: Metrics,
                 timeouts: Timeouts) -> None:
        self.session = session
        self.fleet = fleet
        self.metrics = metrics
        self.timeouts = timeouts
        self.h1 = H1Pool(connect_timeout=timeouts.connect)  # the hot legs
        # connect bound by aiohttp; whole-call bounds by asyncio.timeout around the call
        self.short = aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect)

    def failed(self, leg: str, w: Worker, kind: str, passive: bool = True) -> None:
        self.metrics.upstream_error(leg, kind)
        if passive:
            self.fleet.mark_failed(w.id)

    async def post_json(self, leg: str, w: Worker, path: str, body: dict[str, Any],
                        headers: dict[str, str], timeout: float, settle: bool = True) -> dict[str, Any]:
        """POST a JSON body, return the decoded JSON answer of a 2xx, or raise. A good answer closes
        the worker's breaker unless `settle` is off (the caller decides later: a prefill is good
        once the decode could pull its KV)."""
        flight = self.fleet.in_flight
        flight[w.id] = flight.get(w.id, 0) + 1
        resp: H1Response | None = None
        try:
            async with asyncio.timeout(timeout):
                resp = await self.h1.post(w.host, w.port, path, orjson.dumps(body), headers, tls=w.tls)
                status = resp.status
                data = await resp.read()
        except TimeoutError:
            self.failed(leg, w, "timeout")
            raise UpstreamTimeout(f"{leg} worker {w.id} did not answer within {timeout:g}s") from None
        except OSError as e:
            connect = resp is None and not isinstance(e, H1Error)
            self.failed(leg, w, "connect" if connect else "transport")
            err = UpstreamError(f"{leg} worker {w.id} failed: {e.__class__.__name__}: {e}")
            err.answered = connect  # type: ignore[attr-defined]  # never connected: it holds nothing
            raise err from None
        finally:
            flight[w.id] -= 1
            if resp is not None:
                resp.close()
        if status >= 300:
            self.failed(leg, w, f"status_{status // 100}xx", passive=status >= 500)
            raise upstream_status_error(leg, w, status, data)
        try:
            out = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.failed(leg, w, "garbage")
            raise UpstreamError(f"{leg} worker {w.id} answered with a body that is not JSON") from None
        if not isinstance(out, dict):
            self.failed(leg, w, "garbage")
            raise UpstreamError(f"{leg} worker {w.id} answered with JSON that is not an object")
        if settle:
            self.fleet.succeeded(w.id)
        return out

    async def release(self, w: Worker, transfer_id: str, reason: str) -> bool | None:
        """`POST /kv/release` (idempotent on the holder): True if this call freed the transfer,
        False if it was already free, None if the holder could not be asked."""
        try:
            async with asyncio.timeout(self.timeouts.release):
                async with self.session.post(
                        w.url + "/kv/release", headers=JSON_HEADERS, timeout=self.short,
                        data=orjson.dumps({"transfer_id": transfer_id, "reason": reason})) as r:
                    body = await r.read()
                    status = r.status
            out = bool(orjson.loads(body).get("released")) if status < 300 else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            out = None
        self.metrics.release_sent(reason, {True: "freed", False: "already_free", None: "failed"}[out])
        return out

    async def get_held(self, w: Worker, since: int) -> bytes | None:
        """The raw `GET /kv/held?since=SEQ` answer of a pipeline, None when it cannot be had."""
        try:
            async with asyncio.timeout(self.timeouts.release):
                async with self.session.get(f"{w.url}/kv/held?since={since}", timeout=self.short) as r:
                    if r.status != 200:
                        return None
                    return await r.read()
        except (aiohttp.ClientError, TimeoutError):
            return None
