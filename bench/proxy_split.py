"""Where a proxy's CPU goes, the mesh beside the dialect's Rust router (issue 20).

`bench/overhead.py --anchors` gives CPU ms per request; this splits it, for the mesh and the
router on the same mock fleet, each pinned to the last core (the fleet and this client on the
others), in alternating rounds:

- user and system CPU per request, and voluntary / involuntary context switches per request
  counted over every thread (`/proc/<pid>/task/*/status`: psutil's count is the main thread's
  only, which for a tokio router is the one that sleeps);
- `--rate R1,R2`: an open loop at a fixed offered rate (a request started every 1/R s, whatever
  the answers do) instead of the closed loop, so both proxies serve the same requests per second;
- `--perf DIR`: `perf record -e cpu-clock -g` of each proxy over one measured run, to
  DIR/<mode>-c<conc>-<proxy>.data (`perf report -i FILE --children --sort sym -g none`).

    .venv/bin/python bench/proxy_split.py [--dialect sglang] [--modes json16,sse16,json64,sse64]
    .venv/bin/python bench/proxy_split.py --rate 200,500 --modes json
    .venv/bin/python bench/proxy_split.py --modes sse16 --rounds 1 --perf /tmp/perf
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.anchors import Tree, ensure_routers, start_mesh, start_router, wait_serving  # noqa: E402
from bench.overhead import Client, rounds  # noqa: E402
from bench.procs import MESH, start  # noqa: E402


def switches(tree: Tree) -> tuple[int, int]:
    """Voluntary and involuntary context switches, summed over every thread of the tree."""
    v = n = 0
    for q in tree.procs():
        try:
            tids = os.listdir(f"/proc/{q.pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{q.pid}/task/{tid}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches"):
                            v += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches"):
                            n += int(line.split()[1])
            except OSError:
                continue
    return v, n


async def open_loop(client: Client, stream: bool, rate: float, seconds: float) -> tuple[int, int, float]:
    """Start a request every 1/rate s for `seconds`; wait for all. (requests, errors, p50 s)."""
    tasks: set[asyncio.Task[None]] = set()
    lat: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        try:
            lat.append((await client.via_mesh(stream))[0])
        except Exception:  # noqa: BLE001 - counted
            errors += 1

    started, t0 = 0, time.perf_counter()
    while (now := time.perf_counter() - t0) < seconds:
        while started < int(now * rate) + 1:
            t = asyncio.create_task(one())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
            started += 1
        await asyncio.sleep(0.001)
    await asyncio.gather(*tasks)
    lat.sort()
    return started, errors, lat[len(lat) // 2] if lat else 0.0


async def run(a: argparse.Namespace) -> int:
    bindir = ensure_routers()
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, rest = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    os.sched_setaffinity(0, rest)
    fleet, lines = start([*MESH, "mock-fleet", "--dialect", a.dialect, "--prefill", "1", "--decode", "1"], "ready")
    pre = [x.split()[1] for x in lines if x.startswith("prefill ")]
    dec = [x.split()[1] for x in lines if x.startswith("decode ")]
    Tree(fleet.pid).pin(rest)
    procs: list[tuple[str, Any, str]] = []
    errors = 0
    try:
        mp, murl = start_mesh(MESH, a.dialect, pre, dec, Path(tempfile.mkdtemp(prefix="atomesh-split-")))
        procs.append(("mesh", mp, murl))
        rp, rurl = start_router(bindir, f"{a.dialect}-router", pre, dec)
        procs.append(("router", rp, rurl))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for _, p, url in procs:
                await wait_serving(s, url, p)
                Tree(p.pid).pin(proxy_core)
            for mode in a.modes:
                stream = mode.startswith("sse")
                loads = [float(r) for r in a.rate] if a.rate else [float(mode.removeprefix("sse").removeprefix("json"))]
                for load in loads:
                    for r in range(a.rounds):
                        for name, p, url in procs if r % 2 == 0 else procs[::-1]:
                            client = Client(s, url, pre, dec)
                            client.check = True
                            client.dialect = a.dialect
                            tree = Tree(p.pid)
                            if a.rate:
                                await open_loop(client, stream, load, 0.5)   # warm
                            else:
                                await rounds([(client, "mesh", tree, False)], stream, int(load), 0.5, 1, 0)
                            perf = None
                            if a.perf:
                                Path(a.perf).mkdir(parents=True, exist_ok=True)
                                out = Path(a.perf) / f"{mode}-{'r' if a.rate else 'c'}{load:g}-{name}.data"
                                perf = subprocess.Popen(
                                    ["perf", "record", "-e", "cpu-clock", "-g", "-o", str(out), "-p",
                                     ",".join(str(q.pid) for q in tree.procs()), "--", "sleep", str(a.seconds)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                            u0, s0 = tree.cpu_times()
                            v0, n0 = switches(tree)
                            t0 = time.perf_counter()
                            if a.rate:
                                n, err, p50 = await open_loop(client, stream, load, a.seconds)
                            else:
                                res = (await rounds([(client, "mesh", tree, False)], stream, int(load),
                                                    a.seconds, 1, 0))[0]
                                n, err, p50 = res.requests, res.errors, res.p50_ms / 1e3
                            elapsed = time.perf_counter() - t0
                            u1, s1 = tree.cpu_times()
                            v1, n1 = switches(tree)
                            if perf is not None:
                                perf.wait()
                            errors += err
                            k = max(n, 1)
                            print(f"{name:6} {mode:6} {'rate' if a.rate else 'c'} {load:<5g} {n / elapsed:8.1f} req/s  "
                                  f"p50 {p50 * 1e3:7.2f} ms  errors {err}  cpu {(u1 - u0 + s1 - s0) / k * 1e3:.3f} ms/req  "
                                  f"user {(u1 - u0) / k * 1e3:.3f} sys {(s1 - s0) / k * 1e3:.3f}  "
                                  f"vcsw {(v1 - v0) / k:.2f} icsw {(n1 - n0) / k:.2f} per req", flush=True)
    finally:
        for _, p, _ in procs:
            p.terminate()
            p.wait(15)
        fleet.terminate()
        try:
            fleet.wait(15)
        except subprocess.TimeoutExpired:   # a fleet driven past what it can take: stop it hard
            fleet.kill()
            fleet.wait(15)
    print(f"errors (wrong token counts included): {errors}")
    return 1 if errors else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dialect", default="sglang", choices=("sglang", "vllm"))
    ap.add_argument("--modes", default="json16,sse16,json64,sse64",
                    help="json<c> / sse<c> (closed loop at concurrency c); with --rate, json / sse")
    ap.add_argument("--rate", default="", help="open loop at these offered rates, req/s (e.g. 200,500)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measured run")
    ap.add_argument("--rounds", type=int, default=2, help="runs per proxy, in alternating order")
    ap.add_argument("--perf", metavar="DIR", help="perf record each proxy over each measured run")
    a = ap.parse_args()
    a.modes = [m for m in a.modes.split(",") if m]
    a.rate = [r for r in a.rate.split(",") if r]
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    sys.exit(asyncio.run(run(a)))


if __name__ == "__main__":
    main()
