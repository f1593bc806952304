"""The client side's server alone: aiohttp's vs `mesh.h1server`'s, CPU per request.

One server process per kind (pinned to core 0 where the machine has two), the same handler
behind the mesh's `Client` interface (`mesh.downstream`): read the body, answer a fixed JSON
body or a 64-event SSE stream. A closed-loop aiohttp client at each concurrency; the server
process's CPU time per request. Rounds alternate the two servers (these machines are noisy).

    .venv/bin/python bench/server_side.py [--seconds 3] [--concurrency 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODY = b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"hello"}]}'
EVENTS = [b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i for i in range(64)] + [b"data: [DONE]\n\n"]


async def handle(kind: str, client: Any) -> Any:
    raw = await client.body(1 << 20)
    if b'"stream": true' in raw:
        out = await client.open_stream(200, {"Content-Type": "text/event-stream", "X-Request-Id": "r"})
        for ev in EVENTS:
            await out.write(ev)
        await out.write_eof()
        return out
    return client.reply(BODY, 200, {"Content-Type": "application/json", "X-Request-Id": "r"})


async def serve(kind: str, port: int) -> None:
    from aiohttp import web

    from mesh.downstream import AioClient
    from mesh.h1server import FastServer

    async def route(request: web.Request) -> web.StreamResponse:
        resp: web.StreamResponse = await handle("completions", AioClient(request))
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", route)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    if kind == "aiohttp":
        await web.TCPSite(runner, "127.0.0.1", port).start()
    else:
        assert runner.server is not None
        fast = FastServer(handle, runner.server, 75.0, 1 << 20)
        await asyncio.get_running_loop().create_server(fast, "127.0.0.1", port)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def drive(port: int, stream: bool, conc: int, seconds: float, pid: int) -> tuple[float, int]:
    import aiohttp
    import psutil

    body = b'{"model": "m", "prompt": "hi", "stream": true}' if stream else b'{"model": "m", "prompt": "hi"}'
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker(end: float) -> None:
            nonlocal done
            while time.perf_counter() < end:
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=body) as r:
                    got = await r.read()
                    assert r.status == 200 and (got.endswith(b"[DONE]\n\n") if stream else got == BODY)
                done += 1
        await asyncio.gather(*(worker(time.perf_counter() + 0.5) for _ in range(conc)))   # warm-up
        proc = psutil.Process(pid)
        c0 = sum(proc.cpu_times()[:2])
        done = 0
        await asyncio.gather(*(worker(time.perf_counter() + seconds) for _ in range(conc)))
        return (sum(proc.cpu_times()[:2]) - c0) * 1000 / done, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--concurrency", default="16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        import uvloop

        uvloop.run(serve(a.serve, a.port))
        return
    from workers.engine.group import free_port

    res: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(a.rounds):
        for kind in ("aiohttp", "h1server"):
            port = free_port()
            p = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)],
                                 stdout=subprocess.PIPE, text=True)
            try:
                assert p.stdout is not None and p.stdout.readline().startswith("ready")
                if (os.cpu_count() or 1) > 1:
                    os.sched_setaffinity(p.pid, {0})
                for stream in (False, True):
                    for c in (int(x) for x in a.concurrency.split(",")):
                        ms, n = asyncio.run(drive(port, stream, c, a.seconds, p.pid))
                        mode = "sse64" if stream else "json"
                        res.setdefault((kind, mode, c), []).append(ms)
                        print(f"{kind:8} {mode:5} c={c:<3} server cpu {ms:.4f} ms/req ({n} requests)", flush=True)
            finally:
                p.terminate()
                p.wait(10)
    print("median over rounds, h1server / aiohttp:")
    for (kind, mode, c), v in sorted(res.items()):
        if kind == "h1server":
            base = statistics.median(res[("aiohttp", mode, c)])
            print(f"  {mode:5} c={c:<3} aiohttp {base:.4f}  h1server {statistics.median(v):.4f} ms/req  "
                  f"ratio {statistics.median(v) / base:.2f}")


if __name__ == "__main__":
    main()
