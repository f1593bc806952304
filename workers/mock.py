"""Mock fleet: prefill pipelines and decode engines that speak PROTOCOL.md, without torch.

A product feature for load tests and mesh tests at scale. Each mock prefill pipeline serves
the OpenAI routes on its stage-0 HTTP port, keeps a fixed block pool, holds each transfer's
blocks until released (side channel or `POST /kv/release`) or expired, and runs one
side-channel ROUTER per stage. Each mock decode engine pulls "KV" with the real
write_request / write_done / release exchange before it answers, then streams tokens.

Tokens are deterministic: the first from a hash of the rendered prompt, each next from the
previous, so a PD answer equals the same mock's monolithic answer. Timing: prefill ms per
prompt token, decode ms per token, a jitter fraction; all 0 for overhead benchmarks.
Faults can be set at start or at run time with `POST /mock/faults`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from mesh.dialects import check_dialect
from mesh.errors import KVTransferError, ProtocolError, error_body
from mesh.protocol import (OWN_CAPABILITIES, ConsumerRank, KVHandoffParams, KVRequestParams, LoadReport, ReleaseCommand,
                           StageAddr, WriteRequest)
from mesh.request import render_prompt
from mesh.sse import Answer
from mesh.tracing import KV_PULL_MS, kv_pull_header
from workers.kv.holder import BlockPool, TransferHolder
from workers.kv.sidechannel import ChannelFaults, ConsumerChannel, StageChannel

import workers.mock_dialects as dialects  # noqa: E402  (it reads this module's helpers at call time)

log = logging.getLogger(__name__)
VOCAB = 50000


@dataclass(frozen=True, slots=True)
class MockTiming:
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    jitter: float = 0.0            # +- fraction applied to every delay
    kv_ms_per_block: float = 0.0   # side-channel write time per block

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0")


@dataclass(frozen=True, slots=True)
class MockFaults:
    """What a mock worker does wrong. All off by default."""
    status: int = 0                # answer every generation request with this HTTP status
    hang: bool = False             # accept, never answer
    garbage: bool = False          # answer 200 with a body that is not JSON
    no_kv_params: bool = False     # prefill: answer without kv_transfer_params
    die_after_tokens: int = -1     # decode stream: cut the connection after this many tokens
    slow_stage: int = -1           # prefill: this stage's side-channel writes are slow ...
    slow_stage_ms: float = 0.0     # ... by this much
    drop_write_done: float = 0.0
    drop_release: float = 0.0
    unhealthy: bool = False        # GET /health answers 503
    crash_before_pull: float = 0.0  # decode: fraction of PD requests whose connection dies before the KV pull
    crash_after_pull: float = 0.0   # decode: ... dies after the pull, before any release (a lost release)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "MockFaults":
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(d) - names
        if bad:
            raise ValueError(f"unknown fault(s): {', '.join(sorted(bad))}")
        return cls(**d)


def token_text(tok: int) -> str:
    return f" t{tok}"


def first_token(prompt: str) -> int:
    h = 1469598103934665603
    for b in prompt.encode()[-4096:]:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h % VOCAB


def next_token(prev: int) -> int:
    return (prev * 48271 + 11) % VOCAB


def token_ids(first: int, n: int) -> list[int]:
    out = [first]
    while len(out) < n:
        out.append(next_token(out[-1]))
    return out[:n]


class _Worker:
    """What both mock roles share: request parsing, timing, answers, load."""

    role = "worker"

    def __init__(self, *, worker_id: str, model: str, host: str, timing: MockTiming, faults: MockFaults,
                 seed: int | None = None, dialect: str = "atom") -> None:
        self.id, self.model, self.host = worker_id, model, host
        self.dialect = check_dialect(dialect)
        # PROTOCOL.md section 8: the mock speaking this project's protocol serves all three; a mock
        # speaking vLLM's or SGLang's dialect serves none of them, as those engines do not
        self.capabilities = OWN_CAPABILITIES if self.dialect == "atom" else ()
        self.timing = timing
        self._faults = faults
        self.rng = random.Random(seed)
        self.in_flight = 0
        self.url = ""
        self.port = 0
        self.requests = 0

    @property
    def faults(self) -> MockFaults:
        return self._faults

    @faults.setter
    def faults(self, f: MockFaults) -> None:
        """Faults change at run time too (tests, `POST /mock/faults`); side-channel ones included."""
        self._faults = f
        self.apply_faults()

    def delay(self, ms: float) -> float:
        if ms <= 0:
            return 0.0
        j = self.timing.jitter
        return ms / 1000.0 * (1 + self.rng.uniform(-j, j) if j else 1)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.dialect == "atom":  # vLLM and SGLang engines have no /load: the mesh probes /health
            app.router.add_get("/load", self._load)
        app.router.add_post("/mock/faults", self._set_faults)
        app.on_response_prepare.append(kv_pull_header)
        self.add_routes(app)
        return app

    def add_routes(self, app: web.Application) -> None:
        pass

    async def _models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "mock"}]})

    async def _health(self, request: web.Request) -> web.Response:
        if self.faults.unhealthy:
            return _error(503, "injected: unhealthy", None)
        return _json({"status": "ok", "id": self.id, "role": self.role, "requests_total": self.requests})

    async def _load(self, request: web.Request) -> web.Response:
        return _json(self.load().encode())

    def load(self) -> LoadReport:
        return LoadReport(in_flight=self.in_flight, capabilities=self.capabilities)

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            self.faults = MockFaults.from_json(orjson.loads(await request.read()))
        except (ValueError, TypeError, AttributeError, orjson.JSONDecodeError) as e:
            return _error(400, f"bad faults: {e}", "faults")
        return _json(dataclasses.asdict(self.faults))

    def apply_faults(self) -> None:
        """Push the side-channel part of `faults` into the running channels."""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        self.in_flight += 1
        self.requests += 1
        try:
            try:
                body = orjson.loads(await request.read())
            except orjson.JSONDecodeError:
                return _error(400, "body is not JSON", None)
            if not isinstance(body, dict):
                return _error(400, "body must be an object", None)
            if kind == "completions" and "prompt" not in body:
                return _error(400, "prompt is required", "prompt")
            if kind == "chat" and not isinstance(body.get("messages"), list):
                return _error(400, "messages is required", "messages")
            if self.model and body.get("model") != self.model:
                return _error(404, f"model {body.get('model')!r} is not served here", "model",
                              code="model_not_found")
            f = self.faults
            if f.hang:
                await asyncio.sleep(3600)
            if f.status:
                return _error(f.status, f"injected failure {f.status}", None, code="injected")
            if f.garbage:
                return web.Response(body=b"<html>oops</html>", content_type="text/html")
            return await self.generate(request, kind, body)
        finally:
            self.in_flight -= 1

    async def generate(self, request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
        prompt = render_prompt(kind, body)  # type: ignore[arg-type]
        await asyncio.sleep(self.delay(self.timing.prefill_ms_per_token * _prompt_tokens(body, prompt)))
        return await self.answer(request, kind, body, prompt, first_token(prompt))

    async def answer(self, request: web.Request, kind: str, body: dict[str, Any], prompt: str,
                     first: int, extra: dict[str, Any] | None = None) -> web.StreamResponse:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        toks = token_ids(first, int(n))
        usage = {"prompt_tokens": _prompt_tokens(body, prompt), "completion_tokens": len(toks),
                 "total_tokens": _prompt_tokens(body, prompt) + len(toks)}
        kvp = body.get("kv_transfer_params") if isinstance(body.get("kv_transfer_params"), dict) else {}
        ans = Answer(kind, body["model"], request.headers.get("X-Request-Id") or os.urandom(8).hex(),
                     kvp.get("response_meta"))
        if not body.get("stream"):
            await asyncio.sleep(self.delay(self.timing.decode_ms_per_token * (len(toks) - 1)))
            return web.Response(body=ans.whole("".join(token_text(t) for t in toks), "length", usage, extra),
                                content_type="application/json")
        return await self._stream(request, body, toks, usage, ans, bool(kvp.get("first_token_early")))

    async def _stream(self, request: web.Request, body: dict[str, Any], toks: list[int], usage: dict[str, int],
                      ans: Answer, sent_early: bool) -> web.StreamResponse:
        """One chunk per token; with `sent_early` the mesh already sent the role chunk and token 0."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        so = body.get("stream_options") or {}
        per_tok = self.timing.decode_ms_per_token
        head = ans.first_chunk()
        if head and not sent_early:
            await resp.write(head)
        for i, t in enumerate(toks):
            if i and per_tok:
                await asyncio.sleep(self.delay(per_tok))
            if i == self.faults.die_after_tokens:
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == 0 and sent_early:
                continue
            # token 0's chunk never carries the finish reason: the same bytes whoever sends token 0
            await resp.write(ans.chunk(token_text(t), "length" if 0 < i == len(toks) - 1 else None))
        if len(toks) == 1:
            await resp.write(ans.chunk("", "length"))
        if so.get("include_usage"):
            await resp.write(ans.usage_chunk(usage))
        await resp.write(Answer.DONE)
        await resp.write_eof()
        return resp


class MockPrefill(_Worker):
    """A prefill pipeline of `pp_size` stages in one process."""

    role = "prefill"

    def __init__(self, *, pp_size: int = 1, num_layers: int = 32, block_size: int = 16,
                 num_blocks: int = 4096, ttl_s: float = 120.0, **kw: Any) -> None:
        super().__init__(**kw)
        if pp_size < 1:
            raise ValueError("pp_size must be >= 1")
        self.pp_size, self.block_size = pp_size, block_size
        self.num_layers = num_layers
        self.holder = TransferHolder(BlockPool(num_blocks), ttl_s=ttl_s)
        self.stages: list[StageChannel] = []
        self._expiry: asyncio.Task[None] | None = None
        self.rooms: dict[int, asyncio.Event] = {}  # sglang: bootstrap rooms that arrived or are awaited

    def room_arrived(self, room: int) -> None:
        self.rooms.setdefault(room, asyncio.Event()).set()

    async def wait_room(self, room: int, wait: float) -> bool:
        ev = self.rooms.setdefault(room, asyncio.Event())
        try:
            async with asyncio.timeout(wait):
                await ev.wait()
        except TimeoutError:
            return False
        finally:
            if not ev.is_set() or self.holder.blocks_of(f"room-{room}") is not None:
                self.rooms.pop(room, None)  # claimed now, or given up
        return True

    def layers_of(self, rank: int) -> tuple[int, int]:
        per, rem = divmod(self.num_layers, self.pp_size)
        start = rank * per + min(rank, rem)
        return start, start + per + (1 if rank < rem else 0)

    async def start_kv(self) -> None:
        for r in range(self.pp_size):
            ch = StageChannel(host=self.host, port=0, pp_rank=r, holder=self.holder, writer=self._writer(r))
            await ch.start()
            self.stages.append(ch)
        self.apply_faults()
        self._expiry = asyncio.create_task(self._expire_loop())

    def apply_faults(self) -> None:
        for ch in self.stages:
            ch.faults = ChannelFaults(drop_write_done=self.faults.drop_write_done)

    async def close_kv(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        for ch in self.stages:
            await ch.close()

    def _writer(self, rank: int) -> Any:
        async def write(req: WriteRequest, consumer: ConsumerRank) -> None:
            ms = self.timing.kv_ms_per_block * len(req.src_block_ids)
            if rank == self.faults.slow_stage:
                ms += self.faults.slow_stage_ms
            if ms:
                await asyncio.sleep(self.delay(ms))
        return write

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.holder.ttl_s / 4))
            for tid in self.holder.expire():
                log.info("prefill %s: transfer %s expired (ttl)", self.id, tid)
                if tid.startswith("room-"):
                    self.rooms.pop(int(tid[5:]), None)

    def add_routes(self, app: web.Application) -> None:
        if self.dialect == "atom":  # the others' engines free their KV themselves
            app.router.add_get("/kv/held", self._held)
            app.router.add_post("/kv/release", self._release)
        elif self.dialect == "vllm":
            app.router.add_post("/mock/vllm/read", self._vllm_read)
        elif self.dialect == "sglang":
            app.router.add_get("/mock/sglang/room/{room:[0-9]+}", self._sglang_room)

    async def _vllm_read(self, request: web.Request) -> web.Response:
        return await dialects.vllm_read(self, request)

    async def _sglang_room(self, request: web.Request) -> web.Response:
        return await dialects.sglang_room(self, request)

    def load(self) -> LoadReport:
        return LoadReport(in_flight=self.in_flight, held_transfers=len(self.holder),
                          free_blocks=self.holder.pool.free, num_blocks=self.holder.pool.num_blocks,
                          capabilities=self.capabilities)

    async def _held(self, request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return _error(400, "since must be an integer", "since")
        return _json(self.holder.listing(since).encode())

    async def _release(self, request: web.Request) -> web.Response:
        try:
            cmd = ReleaseCommand.decode(orjson.loads(await request.read()))
        except (ProtocolError, orjson.JSONDecodeError) as e:
            return _error(400, f"bad release: {e}", getattr(e, "param", None))
        return _json({"transfer_id": cmd.transfer_id, "released": self.holder.release(cmd.transfer_id, cmd.reason)})

    def record_stages(self) -> list[dict[str, Any]]:
        return [{"pp_rank": ch.pp_rank, "host": self.host, "kv_port": ch.port, "layers": list(self.layers_of(r))}
                for r, ch in enumerate(self.stages)]

    async def generate(self, request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if self.dialect == "sglang" and "bootstrap_room" in body:
            return await dialects.sglang_prefill(self, request, kind, body)
        if self.dialect == "vllm" and isinstance(kvp, dict) and not self.faults.no_kv_params:
            return await dialects.vllm_prefill(self, request, kind, body)
        if not (isinstance(kvp, dict) and kvp.get("do_remote_decode")) or self.faults.no_kv_params:
            return await super().generate(request, kind, body)
        try:
            want = KVRequestParams.decode(kvp, "kv_transfer_params")
        except ProtocolError as e:
            return _error(400, e.message, e.param)
        prompt = render_prompt(kind, body)  # type: ignore[arg-type]
        n_tok = _prompt_tokens(body, prompt)
        blocks = self.holder.pool.alloc(-(-n_tok // self.block_size))
        if blocks is None:
            return _error(503, f"KV pool exhausted: {self.holder.pool.free} blocks free", None, code="kv_exhausted")
        try:
            await asyncio.sleep(self.delay(self.timing.prefill_ms_per_token * n_tok))
        except asyncio.CancelledError:
            self.holder.pool.release(blocks)
            raise
        tid = f"{self.id}-{os.urandom(8).hex()}"
        rid = request.headers.get("X-Request-Id", "")
        self.holder.hold(tid, blocks, request_id=rid, mesh_id=str(want.extra.get("mesh_id", "")),
                         consumers=want.remote_tp_size)
        first = first_token(prompt)
        st0 = self.stages[0]
        params = KVHandoffParams(
            remote_engine_id=self.id, remote_host=self.host, remote_port=st0.port,
            remote_handshake_port=st0.port, remote_block_ids=blocks, remote_pp_size=self.pp_size,
            tp_size=1, dp_rank=0, transfer_id=tid, first_token_id=first,
            stages=tuple(StageAddr(pp_rank=ch.pp_rank, host=self.host, port=ch.port,
                                   layers=self.layers_of(r)) for r, ch in enumerate(self.stages)))
        return await self.answer(request, kind, {**body, "max_tokens": 1, "stream": False}, prompt, first,
                                 extra={"kv_transfer_params": params.encode()})


class MockDecode(_Worker):
    """A decode engine of `tp_size` ranks in one process; pulls KV before it answers."""

    role = "decode"

    def __init__(self, *, tp_size: int = 1, num_kv_heads: int = 8, pull_deadline_s: float = 10.0,
                 **kw: Any) -> None:
        super().__init__(**kw)
        if tp_size < 1 or num_kv_heads % tp_size:
            raise ValueError("tp_size must be >= 1 and divide num_kv_heads")
        self.tp_size, self.num_kv_heads = tp_size, num_kv_heads
        self.pull_deadline_s = pull_deadline_s
        self.channel: ConsumerChannel | None = None
        self.pulls_failed = 0
        self._http: aiohttp.ClientSession | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        """vllm / sglang: this engine's client to the prefill side (KV reads, bootstrap rooms)."""
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.pull_deadline_s + 5))
        return self._http

    async def start_kv(self) -> None:
        self.channel = ConsumerChannel(host=self.host)
        await self.channel.start()
        self.apply_faults()

    def apply_faults(self) -> None:
        if self.channel is not None:
            self.channel.faults = ChannelFaults(drop_release=self.faults.drop_release)

    async def close_kv(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self._http is not None:
            await self._http.close()

    def ranks(self) -> tuple[ConsumerRank, ...]:
        per = self.num_kv_heads // self.tp_size
        return tuple(ConsumerRank(tp_rank=r, segment=f"{self.id}/rank{r}", head_start=r * per,
                                  head_end=(r + 1) * per) for r in range(self.tp_size))

    async def generate(self, request: web.Request, kind: str, body: dict[str, Any]) -> web.StreamResponse:
        kvp = body.get("kv_transfer_params")
        if self.dialect == "sglang" and "bootstrap_room" in body:
            return await dialects.sglang_decode(self, request, kind, body)
        if self.dialect == "vllm" and isinstance(kvp, dict) and kvp.get("do_remote_prefill"):
            return await dialects.vllm_decode(self, request, kind, body)
        if not (isinstance(kvp, dict) and kvp.get("do_remote_prefill")):
            return await super().generate(request, kind, body)
        try:
            params = KVHandoffParams.decode(kvp, "kv_transfer_params")
        except ProtocolError as e:
            return _error(400, e.message, e.param)
        assert self.channel is not None
        rid = request.headers.get("X-Request-Id", "")
        if self.faults.crash_before_pull and self.rng.random() < self.faults.crash_before_pull:
            return _crash_response(request)
        t_pull = time.monotonic()
        try:
            await self.channel.pull(params, self.ranks(), params.remote_block_ids, request_id=rid,
                                    deadline_s=self.pull_deadline_s)
        except KVTransferError as e:
            self.pulls_failed += 1
            return _error(502, e.message, None, code="kv_transfer_failed")
        request[KV_PULL_MS] = (time.monotonic() - t_pull) * 1000
        if self.faults.crash_after_pull and self.rng.random() < self.faults.crash_after_pull:
            return _crash_response(request)
        for r in range(self.tp_size):
            await self.channel.release(params, r)
        prompt = render_prompt(kind, body)  # type: ignore[arg-type]
        return await self.answer(request, kind, body, prompt, params.first_token_id)


def _crash_response(request: web.Request) -> web.StreamResponse:
    """The connection dies with nothing sent (a crashed engine, as the mesh sees it)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)


def _prompt_tokens(body: dict[str, Any], prompt: str) -> int:
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], int):
        return len(p)
    return max(1, len(prompt.encode()))


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str, param: str | None, code: str | None = None) -> web.Response:
    type_ = "invalid_request_error" if status < 500 else "server_error"
    return web.Response(body=error_body(message, type_, param, code), status=status, content_type="application/json")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0             # 0: every worker on a free port
    model: str = "mock-model"
    pp_size: int = 1
    tp_size: int = 1
    block_size: int = 16
    num_blocks: int = 4096
    ttl_s: float = 120.0
    timing: MockTiming = MockTiming()
    faults: MockFaults = MockFaults()
    seed: int | None = None
    pull_deadline_s: float = 10.0
    id_prefix: str = "mock-"        # worker ids are <prefix>prefill-<i> / <prefix>decode-<i>
    dialect: str = "atom"           # atom | vllm | sglang: the PD protocol the workers speak

    def __post_init__(self) -> None:
        check_dialect(self.dialect)
        if self.prefill < 0 or self.decode < 0 or self.prefill + self.decode == 0:
            raise ValueError("prefill and decode must be >= 0, and not both 0")
        if not 0 <= self.base_port <= 65535:
            raise ValueError("base_port must be in 0..65535")


class MockFleet:
    """Every mock worker of a `FleetSpec`, served from this process's event loop."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.prefills: list[MockPrefill] = []
        self.decodes: list[MockDecode] = []
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        s = self.spec
        port = s.base_port
        common = dict(model=s.model, host=s.host, timing=s.timing, faults=s.faults, dialect=s.dialect)
        for i in range(s.prefill):
            w = MockPrefill(worker_id=f"{s.id_prefix}prefill-{i}", pp_size=s.pp_size, block_size=s.block_size,
                            num_blocks=s.num_blocks, ttl_s=s.ttl_s,
                            seed=None if s.seed is None else s.seed + i, **common)  # type: ignore[arg-type]
            await self._serve(w, port + i if port else 0)
            self.prefills.append(w)
        for i in range(s.decode):
            w2 = MockDecode(worker_id=f"{s.id_prefix}decode-{i}", tp_size=s.tp_size, pull_deadline_s=s.pull_deadline_s,
                            seed=None if s.seed is None else s.seed + 1000 + i, **common)  # type: ignore[arg-type]
            await self._serve(w2, port + s.prefill + i if port else 0)
            self.decodes.append(w2)

    async def _serve(self, w: _Worker, port: int) -> None:
        start = getattr(w, "start_kv", None)
        if start is not None:
            await start()
        runner = web.AppRunner(w.app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, w.host, port, reuse_address=True, backlog=1024)
        await site.start()
        w.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        w.url = f"http://{w.host}:{w.port}"
        self._runners.append(runner)

    async def close(self) -> None:
        for r in self._runners:
            await r.cleanup()
        for w in (*self.prefills, *self.decodes):
            await w.close_kv()
        self._runners.clear()

    def mesh_workers(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """Static mesh `Worker`s for this fleet: (prefill pipelines, decode engines)."""
        from mesh.config import make_worker

        pre = tuple(make_worker("prefill", {"url": w.url, "id": w.id, "model": w.model, "pp_size": w.pp_size,
                                            "block_size": w.block_size, "num_blocks": w.holder.pool.num_blocks,
                                            "stages": w.record_stages(), "dialect": w.dialect,
                                            "capabilities": list(w.capabilities),
                                            **({"bootstrap_port": w.port} if w.dialect == "sglang" else {})}, i)
                    for i, w in enumerate(self.prefills))
        dec = tuple(make_worker("decode", {"url": w.url, "id": w.id, "model": w.model, "tp_size": w.tp_size,
                                           "dialect": w.dialect, "capabilities": list(w.capabilities)}, i)
                    for i, w in enumerate(self.decodes))
        return pre, dec

    async def enroll(self, etcd: Any, ttl: int = 10) -> list[Any]:
        """Register every worker in etcd (each stage under its own lease); returns the enrollments."""
        from workers.register import EnrollConfig, Enrollment

        pre, dec = self.mesh_workers()
        out = []
        for w in (*pre, *dec):
            stages = w.record.stages if w.role == "prefill" else ()
            e = Enrollment(etcd=etcd, record=w.record, stages=stages, cfg=EnrollConfig(ttl=ttl))
            await e.start()
            out.append(e)
        return out
