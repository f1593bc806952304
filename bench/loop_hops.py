"""CPU per hand-off on the event loop (issue 20: what a loop turn beyond the routers' costs).

The mesh turns its loop 4-6 times per JSON PD request where the Rust routers turn theirs 1.5-3
times (`bench/overhead.py --anchors`, "wake-ups"). The extra turns are hand-offs: a protocol
callback sets a future and the waiting task resumes on a later turn, or a leg starts as a new
task. This prints the CPU of each kind of hand-off, in microseconds, on uvloop (what `mesh serve`
runs) and on asyncio's own loop, beside the same await on a future that is already done:

    .venv/bin/python bench/loop_hops.py [--n 200000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Callable


async def hops(n: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    out: dict[str, float] = {}

    async def leg() -> None:
        return None

    t = time.process_time()
    for _ in range(n):          # a callback (as data_received) sets the future; the task resumes later
        f = loop.create_future()
        loop.call_soon(f.set_result, None)
        await f
    out["future set on a later turn"] = time.process_time() - t
    t = time.process_time()
    for _ in range(n):          # the same objects, no hand-off: the future is done before the await
        f = loop.create_future()
        f.set_result(None)
        await f
    out["future already done"] = time.process_time() - t
    t = time.process_time()
    for _ in range(n):          # a leg as its own task, awaited
        await loop.create_task(leg())
    out["new task, awaited"] = time.process_time() - t
    return {k: v / n * 1e6 for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200_000, help="hand-offs per kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runners: list[tuple[str, Callable[[Any], dict[str, float]]]] = [("asyncio", asyncio.run)]
    try:
        import uvloop
        runners.insert(0, ("uvloop", uvloop.run))
    except ImportError:
        pass
    for r in range(args.rounds):
        for name, run in runners:
            res = run(hops(args.n))
            print(f"round {r + 1} {name:8} " + "  ".join(f"{k} {v:.2f} us" for k, v in res.items()))


if __name__ == "__main__":
    main()
