"""A zero-cost upstream for the proxy benchmarks: the mock fleet's own answers, captured once and
replayed (`bench/overhead.py --upstream null`, with or without `--anchors`).

Why: the mock fleet (`mesh mock-fleet`, zero timing) runs the worker adapters' own code, and that
costs CPU: ~0.3 ms per 1 kB PD request, ~9 ms per 220 kB one (`bench/fleet_cpu.py`: block
accounting and the side channel for 13,750 blocks). It runs on the core beside the proxy's, and on
a 2-vCPU machine the two vCPUs are one physical core's hyperthreads, sharing its caches. Its pace
also leaves the proxy idle between requests, and an idle vCPU here halts: work after a gap costs
1.2-2.8x its back-to-back CPU (`bench/idle_penalty.py`). Both weigh on every proxy's CPU per
request, the Rust routers' too. This upstream costs next to nothing: it reads a request's bytes by
their Content-Length, never parses them, and writes the answer the fleet gave to a request like it.

- `capture(dialect, sizes)`: the mock fleet, in this process, in `dialect`; for each prompt size
  (0: the bench's short prompt), one PD request in JSON and one in 64-token SSE, run directly as
  `bench.overhead.Client.direct` runs them, each answer's tokens checked; each leg's answer kept as
  the fleet sent it. The fleet ends with every transfer released, nothing in flight and every
  pool whole (checked).
- `python bench/null_upstream.py ANSWERS --prefill N --decode M`: N prefill and M decode
  listeners on 127.0.0.1 (free ports), printed as the fleet prints them (`prefill URL`,
  `decode URL`, then `ready`). A POST gets its leg's capture for the largest prompt size not above
  the body's length; the decode's SSE capture where the body asks for a stream (`"stream":true`,
  as the compact JSON of the mesh and both routers writes it): JSON with a Content-Length; SSE
  chunked, one chunk per event, each event its own write a loop turn after the one before (an
  engine that makes its tokens with no time between them, each sent as it comes).
  GET /health: 200; GET /v1/models: the fleet's model. Anything else: 404, so the mesh finds no
  `/load` and no holder API (its atom flow is untracked here, as in front of ATOM itself). A
  request with a body it cannot delimit (no Content-Length, or chunked) gets 411 and the
  connection is closed.
- `--work-us-per-kb X` (default 0: off): before it answers a POST, the upstream spins X us of CPU
  per kB of the request's body. The mock fleet's own cost is ~17 us per kB of a long prompt's two
  legs; this puts CPU of that size beside the proxy (on the sibling hyperthread, with the gaps it
  leaves the proxy idle in), without the fleet's memory traffic, to show how much of a proxy's cost
  per request is its neighbour's (docs/benchmarks.md). With `bench/overhead.py --upstream null`,
  pass it as `--fleet-args "--work-us-per-kb X"`.

What it cannot show is anything of the workers or the engines: every request of a size gets the
same answer (the same transfer id, block ids and text), which the proxies pass on without looking.
The answers are the mock fleet's, so their fields are what `workers/mock_dialects.py` answers in
each dialect (with the sources it follows); nothing here is evidence of how vLLM, SGLang or ATOM
answer. It is for the proxies' own CPU and latency only.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "mock-model"


@dataclass(frozen=True, slots=True)
class Capture:
    """The fleet's answers to one prompt size: the prefill's (JSON), the decode's JSON and SSE."""
    size: int
    prefill: bytes
    decode_json: bytes
    decode_sse: bytes


async def capture(dialect: str, sizes: list[int]) -> dict[str, Any]:
    """The mock fleet's answers in `dialect` for each prompt size, as `serve` replays them."""
    import aiohttp

    from bench.overhead import Client
    from bench.procs import fleet_num_blocks
    from workers.mock import FleetSpec, MockFleet

    fleet = MockFleet(FleetSpec(prefill=1, decode=1, dialect=dialect, model=MODEL,
                                num_blocks=fleet_num_blocks(max(sizes))))
    await fleet.start()
    out = []
    try:
        async with aiohttp.ClientSession() as s:
            for size in sorted(set(sizes)):
                c = Client(s, "", [w.url for w in fleet.prefills], [w.url for w in fleet.decodes], prompt_bytes=size)
                c.check, c.dialect = True, dialect
                legs = {}
                for stream in (False, True):
                    c.captured = {}
                    await c.direct(stream)
                    legs["decode_sse" if stream else "decode_json"] = c.captured["decode"]
                    legs.setdefault("prefill", c.captured["prefill"])
                out.append({"size": size, **{k: v.decode() for k, v in legs.items()}})
        workers = [*fleet.prefills, *fleet.decodes]

        def settled() -> bool:   # every transfer released, nothing in flight, every pool whole again
            return (not any(len(p.holder) for p in fleet.prefills) and not any(w.in_flight for w in workers)
                    and all(w.engine.blocks.free == w.engine.blocks.num_blocks for w in workers))

        for _ in range(250):
            if settled():
                break
            await asyncio.sleep(0.02)
        else:
            raise RuntimeError("the mock fleet still holds KV blocks or requests after the capture")
    finally:
        await fleet.close()
    return {"dialect": dialect, "model": MODEL, "captures": out}


async def start_upstream(kind: str, dialect: str, sizes: list[int], prefill: int, decode: int,
                         fleet_args: list[str], tmp: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """The benchmarks' upstream, started: `fleet` (`mesh mock-fleet`, zero timing, its pools sized
    for the largest prompt) or `null` (this file, replaying that fleet's answers, captured first).
    `fleet_args`: extra arguments to whichever it is (the null upstream's: `--work-us-per-kb`).
    Returns the process and its lines (`prefill URL` / `decode URL` ... `ready`)."""
    from bench.procs import MESH, fleet_blocks, start

    if kind == "fleet":
        return start([*MESH, "mock-fleet", "--dialect", dialect, "--prefill", str(prefill), "--decode", str(decode),
                      *fleet_blocks(max(sizes)), *fleet_args], "ready")
    if kind != "null":
        raise ValueError(f"upstream must be fleet or null, not {kind!r}")
    path = tmp / f"null-{dialect}.json"
    path.write_bytes(orjson.dumps(await capture(dialect, sizes)))
    # `fleet_args` are this upstream's own here (`--work-us-per-kb`); anything else fails its parser
    return start([sys.executable, str(Path(__file__).resolve()), str(path), "--prefill", str(prefill),
                  "--decode", str(decode), *fleet_args], "ready")


def _chunks(events: bytes) -> list[bytes]:
    """An SSE body as HTTP/1.1 chunks, one per event; the last one carries the terminating chunk."""
    parts = [e + b"\n\n" for e in events.split(b"\n\n") if e]
    out = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts]
    out[-1] += b"0\r\n\r\n"
    return out


def spin(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU (a busy wait: the core is kept running, not sleeping)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Answers:
    """Each capture's whole HTTP answers, built once. `work_us_per_kb`: the CPU spun per kB of a
    POST's body before its answer (`--work-us-per-kb`)."""

    def __init__(self, doc: dict[str, Any], work_us_per_kb: float = 0.0) -> None:
        if work_us_per_kb < 0:
            raise ValueError("--work-us-per-kb must be 0 or more")
        self.work_s_per_byte = work_us_per_kb / 1e9   # us per kB (1000 bytes) as seconds per byte
        caps = sorted((Capture(int(c["size"]), c["prefill"].encode(), c["decode_json"].encode(),
                               c["decode_sse"].encode()) for c in doc["captures"]), key=lambda c: c.size)
        if not caps:
            raise ValueError("no captures")
        self.sizes = [c.size for c in caps]
        self.prefill = [self.json(c.prefill) for c in caps]
        self.decode_json = [self.json(c.decode_json) for c in caps]
        self.decode_sse = [self.sse(_chunks(c.decode_sse)) for c in caps]
        self.health = self.json(b"{}")
        self.models = self.json(orjson.dumps({"object": "list", "data": [{"id": doc.get("model", MODEL),
                                                                           "object": "model"}]}))
        self.missing = self.json(b'{"error":{"message":"not found","type":"not_found"}}', b"404 Not Found")
        self.no_length = self.json(b'{"error":{"message":"a body needs a Content-Length","type":"invalid_request"}}',
                                   b"411 Length Required")

    @staticmethod
    def json(body: bytes, status: bytes = b"200 OK") -> list[bytes]:
        return [b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            status, len(body), body)]

    @staticmethod
    def sse(chunks: list[bytes]) -> list[bytes]:
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        return [head + chunks[0], *chunks[1:]]

    def at(self, length: int) -> int:
        """The capture for a body of `length` bytes: the largest prompt size not above it."""
        return max(0, bisect.bisect_right(self.sizes, length) - 1)


class Conn(asyncio.Protocol):
    """One keep-alive connection: requests delimited by their head and Content-Length, answered in
    order (pipelined ones too)."""

    def __init__(self, answers: Answers, role: str) -> None:
        self.a, self.role = answers, role
        self.buf = bytearray()
        self.need = -1        # the body bytes still to come of the request being read; -1: in its head
        self.method = b""
        self.path = b""
        self.transport: asyncio.Transport | None = None
        self.out: deque[bytes] = deque()   # answer pieces not yet written, in order
        self.pumping = False
        self.closing = False   # a 411 is queued: nothing more is read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.buf += data
        while not self.closing:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).split(b"\r\n")
                del self.buf[:end + 4]
                self.method, self.path = (head[0].split(b" ") + [b"", b""])[:2]
                length, chunked = 0 if self.method == b"GET" else -1, False
                for line in head[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length" and value.strip().isdigit():
                        length = int(value)
                    elif name == b"transfer-encoding":
                        chunked = True
                if length < 0 or chunked:
                    self.send(self.a.no_length, close=True)
                    return
                self.need = length
            if len(self.buf) < self.need:
                return
            n, self.need = self.need, -1
            if self.a.work_s_per_byte and self.method == b"POST":
                spin(n * self.a.work_s_per_byte)
            self.send(self.answer(n))
            del self.buf[:n]

    def send(self, pieces: list[bytes], close: bool = False) -> None:
        """Queue an answer: its first piece goes out now if nothing is ahead of it, each further one
        a loop turn after the one before (an SSE stream's events, one write each)."""
        self.out.extend(pieces)
        if close:
            self.out.append(b"")   # the end of the connection, after what is queued
            self.closing = True
            self.buf.clear()
        if not self.pumping:
            self.pump()

    def pump(self) -> None:
        t = self.transport
        if t is None or not self.out:
            self.pumping = False
            return
        piece = self.out.popleft()
        if not piece:
            t.close()
            self.transport = None
            self.pumping = False
            return
        t.write(piece)
        self.pumping = bool(self.out)
        if self.pumping:
            asyncio.get_running_loop().call_soon(self.pump)

    def answer(self, n: int) -> list[bytes]:
        a = self.a
        if self.method == b"GET":
            return a.health if self.path == b"/health" else a.models if self.path == b"/v1/models" else a.missing
        if self.method != b"POST" or self.path not in (b"/v1/completions", b"/v1/chat/completions"):
            return a.missing
        i = a.at(n)
        if self.role == "prefill":
            return a.prefill[i]
        return a.decode_sse[i] if self.buf.find(b'"stream":true', 0, n) >= 0 else a.decode_json[i]

    def eof_received(self) -> bool:
        """The client wrote all it will: answer what came, then close."""
        self.send([b""])
        return True   # keep the transport open for the answers still queued

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(answers: Answers, prefill: int, decode: int, host: str = "127.0.0.1") -> list[asyncio.Server]:
    loop = asyncio.get_running_loop()
    servers = []
    for role, n in (("prefill", prefill), ("decode", decode)):
        for _ in range(n):
            srv = await loop.create_server(lambda r=role: Conn(answers, r), host, 0)  # type: ignore[misc]
            servers.append(srv)
            print(f"{role} http://{host}:{srv.sockets[0].getsockname()[1]}", flush=True)
    return servers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", type=Path, help="a JSON file written from `capture`")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--work-us-per-kb", type=float, default=0.0,
                    help="CPU spun per kB of a POST's body before its answer (a busy neighbour; 0: off)")
    a = ap.parse_args()
    answers = Answers(orjson.loads(a.answers.read_bytes()), a.work_us_per_kb)

    async def run(stop: asyncio.Event) -> None:
        await serve(answers, a.prefill, a.decode, a.host)
        print("ready", flush=True)
        await stop.wait()

    from contract.clikit import run_until_stopped

    run_until_stopped(run)


if __name__ == "__main__":
    main()
