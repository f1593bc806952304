"""The mock fleet's own CPU per PD request, this tree beside another (issue 15: the mock fleet is a
fake engine behind the real adapters, and must stay cheap enough that `bench/overhead.py`
measures the mesh, not the mock).

Starts `mesh mock-fleet` (zero timing) from this tree and, with `--before DIR`, from another tree
(a worktree of an older commit), then drives each directly, as `bench/overhead.py`'s direct
target does (prefill leg, then decode leg), alternating the fleets round by round in one run,
and reports the fleet process's CPU ms per request and the ratio this/before.

    git worktree add /tmp/before <old-commit>
    .venv/bin/python bench/fleet_cpu.py --before /tmp/before [--seconds 4] [--rounds 3]
    .venv/bin/python bench/fleet_cpu.py --before /tmp/before --prompt-bytes 220000   # long prompts: JSON, c=1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.overhead import Client  # noqa: E402
from bench.procs import MESH, fleet_blocks, start  # noqa: E402


def start_fleet(tree: Path, prompt_bytes: int = 0) -> tuple[Any, list[str], list[str]]:
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        p, lines = start([*MESH, "mock-fleet", "--prefill", "1", "--decode", "1", *fleet_blocks(prompt_bytes)], "ready")
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return (p, [x.split()[1] for x in lines if x.startswith("prefill ")],
            [x.split()[1] for x in lines if x.startswith("decode ")])


async def drive(client: Client, stream: bool, conc: int, seconds: float, proc: psutil.Process) -> tuple[int, float]:
    for _ in range(min(50, conc * 5)):
        await client.direct(stream)
    stop_at = time.perf_counter() + seconds
    n = 0

    async def loop() -> None:
        nonlocal n
        while time.perf_counter() < stop_at:
            await client.direct(stream)
            n += 1

    cpu0 = sum(proc.cpu_times()[:2])
    await asyncio.gather(*(loop() for _ in range(conc)))
    return n, (sum(proc.cpu_times()[:2]) - cpu0) / max(n, 1) * 1e3


async def main(a: argparse.Namespace) -> dict[str, Any]:
    trees = {"this": ROOT}
    if a.before:
        trees["before"] = Path(a.before).resolve()
    fleets = {k: start_fleet(t, a.prompt_bytes) for k, t in trees.items()}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # the fleets on one core, this client on another: less noise between them
        for p, _, _ in fleets.values():
            os.sched_setaffinity(p.pid, {cores[-1]})
        os.sched_setaffinity(0, set(cores[:-1]))
    cpu: dict[tuple[str, str, int], list[float]] = {}
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            for r in range(a.rounds):
                for stream in (False,) if a.prompt_bytes else (False, True):
                    for conc in (1,) if a.prompt_bytes else a.concurrency:
                        for name, (p, pre, dec) in fleets.items():
                            n, ms = await drive(Client(s, "", pre, dec, prompt_bytes=a.prompt_bytes), stream, conc,
                                                a.seconds, psutil.Process(p.pid))
                            mode = f"json {a.prompt_bytes}B" if a.prompt_bytes else "sse64" if stream else "json"
                            cpu.setdefault((mode, name, conc), []).append(ms)
                            print(f"round {r} {mode:5} c={conc:<3} {name:6} {n:6d} req  fleet cpu {ms:.3f} ms/req",
                                  flush=True)
    finally:
        for p, _, _ in fleets.values():
            p.terminate()
            p.wait(10)
    out: dict[str, Any] = {}
    print("\nfleet CPU ms per PD request (median of rounds), this tree vs before:")
    for (mode, name, conc), xs in sorted(cpu.items()):
        out.setdefault(f"{mode} c={conc}", {})[name] = round(sorted(xs)[len(xs) // 2], 4)
    for key, v in out.items():
        ratio = round(v["this"] / v["before"], 3) if "before" in v else None
        v["ratio_this_over_before"] = ratio
        print(f"  {key:12} " + "  ".join(f"{k} {x}" for k, x in v.items()))
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="a source tree (worktree of an older commit) to run beside this one")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prompt-bytes", type=int, default=0,
                    help="prompts of this many bytes, each new (bench/overhead.py's long prompts): JSON at c=1 only")
    args = ap.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    res = asyncio.run(main(args))
    dst = ROOT / "bench" / "results" / f"fleet-cpu-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dst.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "results": res}, indent=2))
    print(f"wrote {dst}")
