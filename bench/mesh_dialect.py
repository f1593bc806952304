"""The mesh alone in one dialect, as `bench/overhead.py --anchors` runs it, for before/after runs.

`--anchors` installs and runs both Rust routers and all three dialects (~7 minutes). To compare two
trees of the mesh on one dialect's path (SGLang's concurrent legs, vLLM's rendezvous, ATOM's
ledger), this starts the zero-cost mock fleet in that dialect and the mesh from `--mesh-tree`,
pins the mesh to the last core and the rest to the others (as `--anchors` does), drives JSON and
64-token SSE at each concurrency with every answer's token count checked, and prints the mesh's
CPU ms per request:

    git worktree add /tmp/before <old-commit>
    for r in 1 2 3 4; do for t in /tmp/before .; do
        .venv/bin/python bench/mesh_dialect.py --dialect sglang --mesh-tree $t --concurrency 16 --seconds 3
    done; done

(alternate the trees a few rounds: these machines are noisy). `--profile DIR` samples the mesh
with py-spy (on PATH) as `bench/overhead.py --profile` does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

import bench.overhead as overhead  # noqa: E402
from bench.anchors import Tree, start_mesh, wait_serving  # noqa: E402
from bench.procs import MESH, Syscalls  # noqa: E402


async def paced_seconds(s: aiohttp.ClientSession, url: str) -> float:
    """The mesh's `atomesh_loop_paced_seconds_total`: how long its loop has slept while pacing."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("atomesh_loop_paced_seconds_total "):
            return float(line.split()[1])
    return 0.0


async def run(a: argparse.Namespace) -> int:
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, rest = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    os.sched_setaffinity(0, rest)
    tmp = Path(tempfile.mkdtemp(prefix="atomesh-dialect-"))
    from bench.null_upstream import start_upstream

    fleet, lines = await start_upstream(a.upstream, a.dialect, [0], 1, 1, a.fleet_args.split(), tmp)
    pre = [x.split()[1] for x in lines if x.startswith("prefill ")]
    dec = [x.split()[1] for x in lines if x.startswith("decode ")]
    Tree(fleet.pid).pin(rest)
    mp, url = start_mesh(MESH, a.dialect, pre, dec, tmp, tuple(a.mesh_args.split()))
    errors = 0
    count = Syscalls.available()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await wait_serving(s, url, mp)
            Tree(mp.pid).pin(proxy_core)
            for stream in (False, True):
                for conc in a.concurrency:
                    client = overhead.Client(s, url, pre, dec)
                    client.check = True
                    slept, t0 = await paced_seconds(s, url), time.perf_counter()
                    r = await overhead.run_one(client, "mesh", stream, conc, a.seconds, Tree(mp.pid),
                                               count_syscalls=count)
                    paced = (await paced_seconds(s, url) - slept) / (time.perf_counter() - t0)
                    errors += r.errors
                    sc = r.syscalls_per_req
                    calls = (f"  reads {sc['reads']:.1f} writes {sc['writes']:.1f} wake-ups {sc['waits']:.1f}"
                             if sc else "")
                    print(f"{a.dialect:6} {r.mode:5} c={conc:<3} {r.rps:8.1f} req/s  p50 {r.p50_ms:7.2f} ms  "
                          f"errors {r.errors}  mesh cpu {r.mesh_cpu_ms_per_req:.3f} ms/req{calls}  "
                          f"slept pacing {paced:.0%}", flush=True)
    finally:
        mp.terminate()
        mp.wait(15)
        fleet.terminate()
        fleet.wait(15)
    return 1 if errors else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dialect", choices=("atom", "vllm", "sglang"), default="sglang")
    ap.add_argument("--concurrency", default="16", help="comma-separated, e.g. 1,16,64")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--mesh-tree", help="run the mesh and the mock fleet from this source tree")
    ap.add_argument("--upstream", choices=("fleet", "null"), default="fleet",
                    help="the mock fleet, or the null upstream replaying its answers (bench/null_upstream.py)")
    ap.add_argument("--mesh-args", default="", help="extra `mesh serve` arguments, e.g. '--pace-us 0'")
    ap.add_argument("--fleet-args", default="", help="extra arguments to the upstream: `mesh mock-fleet`'s, e.g. "
                    "'--decode-ms-per-token 0.5' (tokens paced: one upstream read each); with --upstream null, "
                    "bench/null_upstream.py's, e.g. '--work-us-per-kb 17'")
    ap.add_argument("--profile", metavar="DIR", help="py-spy (on PATH) samples the mesh during each run")
    a = ap.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if a.mesh_tree:  # the processes started here import the mesh from there
        os.environ["PYTHONPATH"] = str(Path(a.mesh_tree).resolve())
    if a.profile:
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        overhead.PROFILE = a.profile
    sys.exit(asyncio.run(run(a)))


if __name__ == "__main__":
    main()
