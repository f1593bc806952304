"""The mesh's aiohttp application: routes, the error middleware, background work.

`create_app(cfg)` builds it; `start_site(app, host, port)` serves it with handler cancellation on
(a client that leaves cancels its request, so both legs are cut and the KV released);
`mesh.cli.serve_until` runs it until SIGTERM.
Long-lived work (the pooled ClientSession, health probes, pending releases) lives in
`cleanup_ctx` and is cancelled and awaited on shutdown.

Size: the routes, their two middlewares and the runtime they share one `MeshState`; each route
is a few lines.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from contract.errors import Forbidden, MeshError, RequestTimeout, Unauthorized, error_body
from contract.snapshot import RoutingTable
from mesh import __version__
from mesh.admission import Admission
from mesh.config import MeshConfig
from mesh.dashboard import dashboard
from mesh.downstream import AioClient, Client
from mesh.fleet import Fleet, Registry, StaticRegistry
from mesh.h1server import FastClient, FastServer
from mesh.ledger import Ledger
from mesh.metrics import Metrics
from mesh.openapi import document as _openapi_document
from mesh.pacer import Pacer
from mesh.proxy import Background, Proxy
from mesh.reconcile import Reconciler
from mesh.request import check_request_id, parse
from mesh.tracing import Tracing
from mesh.upstream import Upstream
from policies import Policy, create

log = logging.getLogger(__name__)


def check_api_key(keys: tuple[str, ...], header: str) -> str:
    """The id ('key-N', never the secret) of the client's key; raises Unauthorized otherwise.
    Every key is compared, in constant time, whatever matches first."""
    if not header.startswith("Bearer "):
        raise Unauthorized("an API key is required: Authorization: Bearer <key>")
    given = header[7:].encode()
    found = -1
    for i, k in enumerate(keys):
        if hmac.compare_digest(given, k.encode()):
            found = i
    if found < 0:
        raise Unauthorized("invalid API key")
    return f"key-{found}"


@dataclass(slots=True)
class MeshState:
    cfg: MeshConfig
    mesh_id: str
    fleet: Fleet
    metrics: Metrics
    policies: dict[str, Policy]
    background: Background
    started_at: float
    ledger: Ledger
    reconciler: Reconciler
    admission: Admission
    upstream: Upstream
    proxy: Proxy
    pacer: Pacer
    fast: FastServer | None = None   # the hot routes' server, once `start_site` serves the app


STATE = web.AppKey("atomesh_state", MeshState)
TRACING = web.AppKey("atomesh_tracing", object)  # a mesh.tracing.Tracing, or None
OPENAPI = _openapi_document()


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


def error_headers(e: MeshError, request_id: str | None = None) -> dict[str, str]:
    """An error answer's headers: the error's own (Retry-After, Allow), its type, the request id."""
    headers = {**e.headers, "Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers


def error_response(e: MeshError, request_id: str | None = None) -> web.Response:
    return web.Response(body=e.body(), status=e.status, headers=error_headers(e, request_id))


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where exceptions become HTTP answers; never a traceback in a body."""
    try:
        return await handler(request)
    except MeshError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None  # a 405 says what is allowed
        return web.Response(body=error_body(e.reason, "invalid_request_error", None, str(e.status)),
                            status=e.status, content_type="application/json", headers=allow)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:  # noqa: BLE001 - the boundary: log it, answer 500 without internals
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.Response(body=error_body("internal error in the mesh", "server_error"), status=500,
                            content_type="application/json")


ADMIN_ROUTES = frozenset({"/workers", "/kv/ledger"})


@web.middleware
async def admin_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Admin routes need the admin bearer token when one is configured (constant-time check)."""
    token = request.app[STATE].cfg.admin_token
    if token is not None and (request.path in ADMIN_ROUTES or request.method not in ("GET", "HEAD")
                              and not request.path.startswith("/v1/")):
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            raise Unauthorized("this route needs the admin token: Authorization: Bearer <token>")
        if not hmac.compare_digest(auth[7:].encode(), token.encode()):
            raise Forbidden("wrong admin token")
    return await handler(request)


# -- OpenAI routes --------------------------------------------------------------------------

async def generate(st: MeshState, kind: str, client: Client) -> Any:
    """One generation request, whichever server took it (`mesh.downstream`): the API key before the
    body (an unauthenticated client gets its 401 without us reading a byte), the body within its
    deadline, parse, admission, the proxy. Returns the client's answer (whole, or the stream the
    proxy wrote)."""
    loop = client.loop
    t0 = loop.time()
    status = 500
    rid = None
    try:
        h = client.headers
        key_id = check_api_key(st.cfg.api_keys, h.get("Authorization", "")) if st.cfg.api_keys else None
        if client.complete:   # the body is here already (the fast server read it with the head)
            raw = await client.body(st.cfg.limits.max_body_bytes)
        else:
            try:
                async with asyncio.timeout(st.cfg.limits.body_timeout_s):  # a slow upload holds no slot for long
                    raw = await client.body(st.cfg.limits.max_body_bytes)
            except TimeoutError:
                raise RequestTimeout(f"the request body did not arrive within {st.cfg.limits.body_timeout_s:g}s") from None
        # (type: ignore below) the route table maps this handler to one of the parser's request kinds
        creq = parse(kind, raw, st.cfg.limits, request_id=check_request_id(h.get("X-Request-Id")),  # type: ignore[arg-type]
                     session_key=h.get(st.cfg.session_header))
        rid = creq.request_id
        if st.admission.unlimited(key_id):
            resp = await st.proxy.handle(client, creq)
        else:
            async with st.admission.slot(key_id):
                resp = await st.proxy.handle(client, creq)
        status = resp.status
        return resp
    except MeshError as e:
        status = e.status
        if e.status >= 500:
            log.warning("request %s failed: %s", rid, e.message)
        # a 408 leaves the rest of the body unread: no keep-alive after it
        return client.reply(e.body(), e.status, error_headers(e, rid), close=isinstance(e, RequestTimeout))
    except asyncio.CancelledError:
        status = 499  # the client left
        raise
    except ConnectionResetError:  # the client left while we wrote to it: nobody to answer
        status = 499
        return client.reply(b"", 499, {})
    finally:
        st.metrics.request_done(kind, status, loop.time() - t0)


async def completions(request: web.Request) -> web.StreamResponse:
    resp: web.StreamResponse = await generate(request.app[STATE], "completions", AioClient(request))
    return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    resp: web.StreamResponse = await generate(request.app[STATE], "chat", AioClient(request))
    return resp


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    if st.cfg.api_keys:
        check_api_key(st.cfg.api_keys, request.headers.get("Authorization", ""))
    created = int(st.started_at)
    cards: dict[str, dict[str, Any]] = {}
    for w in st.fleet.table.all_workers:  # the engines' own fields (max_model_len, root, ...) are kept
        card = st.fleet.cards.get(w.id)
        if card and w.model and w.model not in cards:
            cards[w.model] = {k: v for k, v in card.items() if k != "id"}
    return json_response({"object": "list", "data": [
        {"object": "model", "created": created, "owned_by": "atomesh", **cards.get(m, {}), "id": m}
        for m in st.fleet.table.models]})


# -- operations routes ----------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    return json_response({"status": "ok", "mesh_id": request.app[STATE].mesh_id})


def readiness(st: MeshState) -> dict[str, Any]:
    table = st.fleet.table
    if st.cfg.pd:
        servable = [m for m in table.models
                    if table.candidates("prefill", m) and table.candidates("decode", m)]
    else:
        servable = [m for m in table.models if table.candidates("worker", m)]
    return {"ready": bool(servable), "models": servable, "healthy": st.fleet.healthy_counts(),
            "registry_stale": st.fleet.registry.stale, "kv_unaccounted": dict(st.fleet.kv_unaccounted)}


async def ready(request: web.Request) -> web.Response:
    body = readiness(request.app[STATE])
    return json_response(body, status=200 if body["ready"] else 503)


async def metrics(request: web.Request) -> web.Response:
    st = request.app[STATE]
    st.metrics.set_healthy(st.fleet.healthy_counts())
    st.metrics.sync_live()
    return web.Response(body=generate_latest(st.metrics.exposed),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def workers(request: web.Request) -> web.Response:
    st = request.app[STATE]
    fl = st.fleet
    rows = []
    for w in fl.workers():
        load = fl.loads.get(w.id)
        rows.append({"id": w.id, "role": w.role, "url": w.url, "model": w.model,
                     "healthy": fl.healthy(w.id), "draining": w.record.draining,
                     "in_flight": fl.in_flight.get(w.id, 0), "kv_unaccounted": fl.kv_unaccounted.get(w.id, 0),
                     "load": load.encode() if load else None, "record": w.record.encode()})
    return json_response({"mesh_id": st.mesh_id, "mode": "pd" if st.cfg.pd else "regular",
                          "workers": rows})


async def openapi(request: web.Request) -> web.Response:
    return json_response(OPENAPI)


async def kv_ledger(request: web.Request) -> web.Response:
    return json_response(request.app[STATE].ledger.snapshot())


# -- lifecycle ------------------------------------------------------------------------------

async def _runtime(app: web.Application) -> AsyncIterator[None]:
    st = app[STATE]
    cfg = st.cfg
    await st.upstream.start()
    session = st.upstream.session
    await st.fleet.registry.start(st.fleet.on_membership)
    await st.fleet.probe_all(session, timeout=min(2.0, cfg.health_interval * 2))
    tasks = [asyncio.create_task(st.fleet.run_probes(session, cfg.health_interval), name="health-probes")]
    if cfg.pd:
        await st.reconciler.reconcile(full=True)  # after a restart: adopt what pipelines hold for this mesh id
        tasks.append(asyncio.create_task(st.reconciler.run(), name="kv-ledger"))
    if st.metrics.multiprocess:   # `mesh serve --workers N`: live gauges into the shared files
        tasks.append(asyncio.create_task(_sync_metrics(st), name="metrics-sync"))
    replica = None
    if cfg.etcd is not None:
        replica = _replica_keeper(st)
        tasks.append(asyncio.create_task(_enroll_replica(replica), name="replica-enrollment"))
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if replica is not None:
            await replica.close(revoke=True)
        await st.background.drain(cfg.timeouts.release)
        await st.fleet.registry.close()
        await st.upstream.close()
        if st.metrics.multiprocess:
            from prometheus_client import multiprocess

            st.metrics.flush()   # this process's last tallies into its files (its counts outlive it)

            # (type: ignore below) prometheus-client's multiprocess helpers are untyped
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]


async def _sync_metrics(st: MeshState) -> None:
    while True:
        st.metrics.set_healthy(st.fleet.healthy_counts())
        st.metrics.sync_live()
        await asyncio.sleep(1.0)


def _replica_keeper(st: MeshState) -> Any:
    from contract.enroll import LeaseKeeper
    from contract.protocol import MeshRecord

    cfg = st.cfg
    assert cfg.etcd is not None
    keeper = LeaseKeeper(cfg.etcd, cfg.registry_ttl)
    url = cfg.advertise_url or f"http://{cfg.host}:{cfg.port}"
    rec = MeshRecord(url=url, version=__version__, started_at=st.started_at)
    keeper.add("mesh", {cfg.etcd.keys.mesh(st.mesh_id): orjson.dumps(rec.encode())})
    return keeper


async def _enroll_replica(keeper: Any) -> None:
    """Register this replica under `mesh/<id>` (retrying while etcd is away), then keep it alive."""
    while True:
        try:
            await keeper.start(deadline_s=3600 * 24)
            break
        except ConnectionError:
            await asyncio.sleep(1)
    await keeper.run()


def create_app(cfg: MeshConfig, registry: Registry | None = None, mesh_id: str | None = None,
               tracer_provider: Any = None) -> web.Application:
    """The mesh. `tracer_provider`: OpenTelemetry spans go there (else to the global SDK provider
    when one is configured; else no tracing)."""
    from contract import badlog

    badlog.install()   # malformed requests: one log line per peer per minute, no raw bytes
    if registry is None and cfg.etcd is not None:
        from mesh.etcd_registry import EtcdRegistry

        registry = EtcdRegistry(cfg.etcd)
    if registry is None:
        registry = StaticRegistry((*cfg.prefill, *cfg.decode, *cfg.workers))
    roles = ("prefill", "decode") if cfg.pd else ("worker",)
    names = {"prefill": cfg.prefill_policy, "decode": cfg.decode_policy, "worker": cfg.worker_policy}
    policies = {r: create(names[r], **cfg.policy_options.get(names[r], {})) for r in roles}

    def on_rebuild(table: RoutingTable) -> None:
        for role, p in policies.items():
            retain = getattr(p, "retain", None)
            if retain is not None:
                retain(w.id for w in table.all_workers if w.role == role)

    fleet = Fleet(registry, unhealthy_after=cfg.unhealthy_after, breaker_open_s=cfg.breaker_open_s,
                  on_rebuild=on_rebuild, kv_leak_after=cfg.kv_leak_after)
    ledger: Ledger  # the metrics read its gauges; bound below, before anything runs
    metrics_ = Metrics(fleet.in_flight_rows,
                       lambda: (registry.stale, getattr(registry, "watch_restarts", 0)),
                       lambda: ledger.gauge_rows(), lambda: fleet.kv_unaccounted.items())
    mesh_id = mesh_id or cfg.mesh_id or (f"mesh-{socket.gethostname()}-{cfg.port}" if cfg.port
                                         else f"mesh-{os.urandom(4).hex()}")
    pacer = metrics_.pacer = Pacer(cfg.pace_us / 1e6)
    upstream = Upstream(fleet, metrics_, cfg.timeouts, pacer)
    ledger = Ledger(mesh_id, fleet, metrics_, grace_s=cfg.ledger_grace)
    reconciler = Reconciler(ledger, fleet, upstream, interval_s=cfg.ledger_interval)
    background = Background()
    tracing = Tracing.from_env(tracer_provider)
    proxy = Proxy(cfg, fleet, upstream, metrics_, policies, background, mesh_id, ledger, reconciler, tracing)
    st = MeshState(cfg=cfg, mesh_id=mesh_id, fleet=fleet, metrics=metrics_, policies=policies,
                   background=background, started_at=time.time(), ledger=ledger, reconciler=reconciler,
                   admission=Admission(cfg.admission), upstream=upstream, proxy=proxy, pacer=pacer)
    app = web.Application(middlewares=[errors_middleware, admin_middleware],
                          client_max_size=cfg.limits.max_body_bytes)
    app[STATE] = st
    app[TRACING] = tracing
    app.cleanup_ctx.append(_runtime)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/workers", workers)
    app.router.add_get("/kv/ledger", kv_ledger)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/dashboard", dashboard)
    return app


class _FastSite(web.BaseSite):
    """A TCP site whose connections start on `mesh.h1server` (the hot routes) and go to aiohttp's
    protocol for everything else."""

    def __init__(self, runner: web.AppRunner, fast: FastServer, host: str, port: int, reuse_port: bool,
                 backlog: int) -> None:
        super().__init__(runner, backlog=backlog)
        self._fast, self._host, self._port, self._reuse_port = fast, host, port, reuse_port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self._fast, self._host, self._port, reuse_address=True, reuse_port=self._reuse_port or None,
            backlog=self._backlog)

    async def stop(self) -> None:
        """Stop listening; requests in flight get the runner's shutdown timeout to finish."""
        if self._server is not None:
            self._server.close()
        await self._fast.shutdown(getattr(self._runner, "_shutdown_timeout", 60.0))
        await super().stop()


async def start_site(app: web.Application, host: str, port: int, keepalive_timeout: float = 75.0,
                     reuse_port: bool = False) -> web.AppRunner:
    """Start serving `app`; returns the runner (call `cleanup()` to stop). A connection is closed
    `keepalive_timeout` after it opened or answered its last request if no whole request head has
    arrived meanwhile: idle keep-alive connections, and slowloris ones trickling a head (aiohttp
    does not move that deadline for bytes that complete nothing; its default is about an hour).
    The mesh's app is served through `mesh.h1server` (the two hot routes without aiohttp's
    request objects; every other route and odd request still aiohttp's); any other app (a
    worker's) by aiohttp alone."""
    # lingering_time: after an answer given before its body was read (a 408, a 413), at most 1 s of
    # the rest is read and dropped, then the connection closes (aiohttp's default is 10 s)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=keepalive_timeout,
                           lingering_time=1.0)
    await runner.setup()
    site: web.BaseSite
    if STATE in app and runner.server is not None:
        st = app[STATE]

        def handler(kind: str, client: FastClient) -> Awaitable[Any]:
            return generate(st, kind, client)

        fast = FastServer(handler, runner.server, keepalive_timeout, st.cfg.limits.max_body_bytes, st.pacer)
        st.fast = fast
        site = _FastSite(runner, fast, host, port, reuse_port, 1024)
    else:
        site = web.TCPSite(runner, host, port, reuse_address=True, reuse_port=reuse_port or None, backlog=1024)
    await site.start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    raise RuntimeError("site is not started")
