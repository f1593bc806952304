"""Shared fixtures: a mock fleet and a mesh on 127.0.0.1 free ports, in-process or as processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest

from mesh.app import STATE, bound_port, create_app, start_site
from mesh.config import MeshConfig, Timeouts
from workers.mock import FleetSpec, MockFleet

ROOT = Path(__file__).resolve().parent.parent
MESH_BIN = str(Path(sys.executable).parent / "mesh")


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """The real-vLLM modules run last, one after the other: their engines keep a core busy while
    they live, and each module's pair is stopped before the next one starts."""
    last = ("tests/test_vllm_real.py", "tests/test_vllm_mooncake.py")
    items.sort(key=lambda it: next((i + 1 for i, m in enumerate(last) if it.nodeid.startswith(m)), 0))


@dataclasses.dataclass
class PD:
    """A running in-process mock fleet and mesh."""
    fleet: MockFleet
    url: str
    app: Any
    runner: Any

    @property
    def state(self) -> Any:
        return self.app[STATE]

    async def held(self) -> int:
        return sum(len(p.holder) for p in self.fleet.prefills)

    async def wait_released(self, timeout: float = 5.0) -> int:
        """Wait until no prefill holds KV (background releases are asynchronous)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.held() == 0 and not self.state.background.tasks:
                return 0
            await asyncio.sleep(0.02)
        return await self.held()


@pytest.fixture
async def make_pd() -> AsyncIterator[Callable[..., Awaitable[PD]]]:
    made: list[PD] = []

    async def make(spec: FleetSpec | None = None, **cfg: Any) -> PD:
        fleet = MockFleet(spec or FleetSpec(prefill=1, decode=1))
        await fleet.start()
        pre, dec = fleet.mesh_workers()
        if cfg.pop("regular", False):
            cfg.setdefault("workers", tuple(dataclasses.replace(w, role="worker") for w in dec))
        else:
            cfg.setdefault("prefill", pre)
            cfg.setdefault("decode", dec)
        cfg.setdefault("timeouts", Timeouts(prefill=10, decode_first_byte=10, decode_idle=10, release=2))
        app = create_app(MeshConfig(host="127.0.0.1", port=0, **cfg))
        runner = await start_site(app, "127.0.0.1", 0)
        pd = PD(fleet, f"http://127.0.0.1:{bound_port(runner)}", app, runner)
        made.append(pd)
        return pd

    yield make
    for pd in made:
        await pd.runner.cleanup()
        await pd.fleet.close()


async def close_writer(w: asyncio.StreamWriter) -> None:
    """Close a raw test connection and wait for it, whatever state the server left it in."""
    w.close()
    try:
        await w.wait_closed()
    except ConnectionError:
        pass


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


class Proc:
    """A process we started; stopped by its pid only."""

    def __init__(self, args: list[str], until: str, env: dict[str, str] | None = None, timeout: float = 30) -> None:
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.p.stdout.readline()
            if not line:
                err = self.p.stderr.read() if self.p.stderr else ""
                raise RuntimeError(f"{args[:2]} exited ({self.p.wait()}): {self.lines} {err[-2000:]}")
            self.lines.append(line.rstrip("\n"))
            if line.startswith(until):
                return
        self.stop()
        raise RuntimeError(f"{args[:2]} not ready in {timeout}s")

    def stop(self) -> int:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(self.p.pid, signal.SIGKILL)
                self.p.wait(5)
        for f in (self.p.stdout, self.p.stderr):
            if f:
                f.close()
        return self.p.returncode


@pytest.fixture(scope="module")
def proc_pd() -> Iterator[dict[str, Any]]:
    """`mesh mock-fleet` and `mesh serve` as real processes (for the synchronous SDK)."""
    fleet = Proc([MESH_BIN, "mock-fleet", "--prefill", "2", "--decode", "2", "--pp-size", "2",
                  "--tp-size", "2"], "ready")
    pre = [x.split()[1] for x in fleet.lines if x.startswith("prefill ")]
    dec = [x.split()[1] for x in fleet.lines if x.startswith("decode ")]
    args = [MESH_BIN, "serve", "--port", "0"]
    for u in pre:
        args += ["--prefill", u]
    for u in dec:
        args += ["--decode", u]
    try:
        mesh = Proc(args, "mesh ")
    except Exception:
        fleet.stop()
        raise
    url = mesh.lines[-1].split()[1]
    yield {"url": url, "prefill": pre, "decode": dec, "mesh": mesh, "fleet": fleet}
    assert mesh.stop() == 0
    assert fleet.stop() == 0


@pytest.fixture
def etcd(tmp_path) -> Iterator[Any]:
    """A real etcd server (never skipped: `make test` installs it)."""
    from tests.etcd_server import EtcdServer

    server = EtcdServer(tmp_path / "etcd-data")
    server.start()
    yield server
    server.stop()
