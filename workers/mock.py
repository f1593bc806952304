"""Mock fleet: prefill pipelines and decode engines that speak docs/protocol.md, without a model.

A product feature for load tests and mesh tests at scale. Every mock worker is the real HTTP
adapter (`workers.prefill.PrefillServer`, `workers.decode.DecodeServer`, or their vLLM / SGLang
dialect variants in `workers.mock_dialects`) in front of a `workers.fake.FakeEngine`: the real
scheduler and block manager with a token model and a timing model in place of the model. The
holder API, its expiry, the side channels (one ROUTER per stage of a pipeline, all in this
process), the decode's pull and release, SSE and the answers are the code the real workers run.

Tokens are deterministic (`workers.fake`), so a PD answer equals the same mock's monolithic
answer. Timing: prefill ms per prompt token, decode ms per token, a jitter fraction; all 0 for
overhead benchmarks. Faults (`workers.faults.Faults`) can be set at start or at run time with
`POST /mock/faults`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from contract.dialects import ATOM, SGLANG, check_dialect
from contract.protocol import OWN_CAPABILITIES, PrefillRecord
from contract.snapshot import Worker, make_worker
from workers.decode import DecodeServer
from workers.fake import (
    VOCAB,
    FakeConsumerKV,
    FakeEngine,
    FakeProducerKV,
    MockTiming,
    first_token,
    next_token,
    token_ids,
    token_text,
)
from workers.faults import Faults as MockFaults
from workers.kv.sidechannel import WORKER_TOKEN_ENV
from workers.mock_dialects import DECODE, PREFILL
from workers.prefill import PrefillServer
from workers.server import EngineServer

__all__ = ["FleetSpec", "MockFleet", "MockFaults", "MockTiming", "VOCAB", "first_token", "next_token", "token_ids",
           "token_text"]

MockPrefill = PrefillServer
MockDecode = DecodeServer


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
    num_layers: int = 32            # split across a pipeline's stages
    worker_token: str | None = None  # the worker token (ATOMESH_WORKER_TOKEN must hold it where a mesh routes)
    dialect: str = ATOM             # atom | vllm | sglang: the PD protocol the workers speak

    def __post_init__(self) -> None:
        check_dialect(self.dialect)
        if self.prefill < 0 or self.decode < 0 or self.prefill + self.decode == 0:
            raise ValueError("prefill and decode must be >= 0, and not both 0")
        if not 0 <= self.base_port <= 65535:
            raise ValueError("base_port must be in 0..65535")
        if self.worker_token is not None and len(self.worker_token) < 16:
            raise ValueError("worker_token must be at least 16 characters")


class MockFleet:
    """Every mock worker of a `FleetSpec`, served from this process's event loop."""

    def __init__(self, spec: FleetSpec) -> None:
        self.spec = spec
        self.prefills: list[PrefillServer] = []
        self.decodes: list[DecodeServer] = []
        self._runners: list[web.AppRunner] = []

    def _engine(self, seed: int | None) -> FakeEngine:
        s = self.spec
        return FakeEngine(num_blocks=s.num_blocks, block_size=s.block_size, timing=s.timing, rng=random.Random(seed))

    async def start(self) -> None:
        s = self.spec
        port = s.base_port
        for i in range(s.prefill):
            seed = None if s.seed is None else s.seed + i
            eng = self._engine(seed)
            pkv = FakeProducerKV(s.pp_size, s.num_layers, s.timing, eng.delay)
            w = PREFILL[s.dialect](eng, s.model, f"{s.id_prefix}prefill-{i}", host=s.host, ttl_s=s.ttl_s, kv=pkv,
                                   fault_route=True, token=s.worker_token)
            # (type: ignore below) the default binds this adapter, not the loop's last one
            pkv.faults = lambda w=w: w.faults  # type: ignore[misc]
            await self._serve(w, port + i if port else 0, seed)
            self.prefills.append(w)
        for i in range(s.decode):
            seed = None if s.seed is None else s.seed + 1000 + i
            wid = f"{s.id_prefix}decode-{i}"
            w2 = DECODE[s.dialect](self._engine(seed), s.model, wid, host=s.host, pull_deadline_s=s.pull_deadline_s,
                                   kv=FakeConsumerKV(wid, s.tp_size), fault_route=True, token=s.worker_token)
            await self._serve(w2, port + s.prefill + i if port else 0, seed)
            self.decodes.append(w2)

    async def _serve(self, w: EngineServer, port: int, seed: int | None) -> None:
        w.rng = random.Random(seed)
        runner = web.AppRunner(w.app(), handler_cancellation=True, access_log=None)
        await runner.setup()   # the adapter's start: side channels, expiry, the engine loop
        w.faults = self.spec.faults
        site = web.TCPSite(runner, w.host, port, reuse_address=True, backlog=1024)
        await site.start()
        w.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]  # a started site has its server
        w.url = f"http://{w.host}:{w.port}"
        self._runners.append(runner)

    async def close(self) -> None:
        for r in self._runners:
            await r.cleanup()
        self._runners.clear()

    def mesh_workers(self) -> tuple[tuple[Worker, ...], tuple[Worker, ...]]:
        """Static mesh `Worker`s for this fleet: (prefill pipelines, decode engines)."""
        pre = tuple(make_worker("prefill", {"url": w.url, "id": w.id, "model": w.model, "pp_size": len(w.units),
                                            "block_size": w.engine.cfg.block_size,
                                            "num_blocks": w.engine.blocks.num_blocks,
                                            "stages": [{"pp_rank": a.pp_rank, "host": a.host, "kv_port": a.port,
                                                        "layers": list(a.layers)} for a in w.stage_addrs()],
                                            "dialect": w.dialect, "capabilities": list(capabilities(w)),
                                            **self._auth(),
                                            **({"bootstrap_port": w.port} if w.dialect == SGLANG else {})}, i)
                    for i, w in enumerate(self.prefills))
        dec = tuple(make_worker("decode", {"url": w.url, "id": w.id, "model": w.model,
                                           "tp_size": len(w.kv.ranks()), "dialect": w.dialect,
                                           "capabilities": list(capabilities(w)), **self._auth()}, i)
                    for i, w in enumerate(self.decodes))
        return pre, dec

    def _auth(self) -> dict[str, str]:
        """With a worker token, the records say the mesh sends it as `ATOMESH_WORKER_TOKEN`."""
        return {"api_key_env": WORKER_TOKEN_ENV} if self.spec.worker_token else {}

    async def enroll(self, etcd: Any, ttl: int = 10) -> list[Any]:
        """Register every worker in etcd (each stage under its own lease); returns the enrollments."""
        from workers.register import EnrollConfig, Enrollment

        pre, dec = self.mesh_workers()
        out = []
        for w in (*pre, *dec):
            stages = w.record.stages if isinstance(w.record, PrefillRecord) else ()
            e = Enrollment(etcd=etcd, record=w.record, stages=stages, cfg=EnrollConfig(ttl=ttl))
            await e.start()
            out.append(e)
        return out


def capabilities(w: EngineServer) -> tuple[str, ...]:
    """docs/protocol.md section 8: a mock speaking this project's protocol serves all three; one speaking
    vLLM's or SGLang's dialect serves none of them, as those engines do not."""
    return OWN_CAPABILITIES if w.dialect == ATOM else ()
