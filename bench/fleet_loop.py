"""Event-loop iterations per PD request of the mock fleet, this tree beside another (issue 15:
where the mock fleet's CPU per request goes).

Runs `MockFleet` of a tree in-process on asyncio's own loop with `BaseEventLoop._run_once`
counted, drives it with `bench/overhead.py`'s direct client (prefill leg, then decode leg) from a
subprocess at concurrency 1, and prints iterations per request, JSON and SSE.

    .venv/bin/python bench/fleet_loop.py [--tree /tmp/before] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events as base_events
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DRIVE = """
import asyncio, sys, time, aiohttp
sys.path.insert(0, {root!r})
from bench.overhead import Client
async def main(pre, dec, stream, secs):
    async with aiohttp.ClientSession() as s:
        c, n, end = Client(s, "", [pre], [dec]), 0, time.perf_counter() + secs
        while time.perf_counter() < end:
            await c.direct(stream)
            n += 1
        print(n)
asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", float(sys.argv[4])))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", default=str(ROOT), help="the source tree whose mock fleet runs here")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.tree).resolve()))
    count = [0]
    orig = base_events.BaseEventLoop._run_once

    def counted(self: base_events.BaseEventLoop) -> None:
        count[0] += 1
        orig(self)  # type: ignore[func-returns-value]

    base_events.BaseEventLoop._run_once = counted  # type: ignore[method-assign]
    from workers.mock import FleetSpec, MockFleet

    async def run() -> None:
        fleet = MockFleet(FleetSpec(prefill=1, decode=1))
        await fleet.start()
        try:
            for stream in ("0", "1"):
                c0 = count[0]
                p = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", DRIVE.format(root=str(ROOT)), fleet.prefills[0].url, fleet.decodes[0].url,
                    stream, str(a.seconds), stdout=subprocess.PIPE)
                out, _ = await p.communicate()
                n = int(out.split()[-1])
                print(f"{a.tree} {'sse64' if stream == '1' else 'json':5} {n} requests, "
                      f"{(count[0] - c0) / n:.1f} loop iterations per request", flush=True)
        finally:
            await fleet.close()

    asyncio.run(run())


if __name__ == "__main__":
    main()
