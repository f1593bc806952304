"""Soak and overload (a benchmark, not a CI test).

    .venv/bin/python bench/soak.py [--minutes 10] [--concurrency 64] [--overload-seconds 60]
    .venv/bin/python bench/soak.py --real [--minutes 3] [--concurrency 8]

The mock fleet (4 PP=2 pipelines, 4 TP=2 decode engines, realistic timings) and the mesh run as
processes; the mesh admits `--concurrency` requests at once and queues as many. A closed-loop
client runs `--concurrency` streams for `--minutes` with a fault injected every `--fault-every`
seconds (decode crashes after its pull, a prefill answering 500, lost releases, a slow stage; each
for 10 s), then twice the concurrency for `--overload-seconds`. Every request ends as completed,
failed with a clear error (an OpenAI error body or SSE error event), or lost (no answer at all:
must be 0). Afterwards: KV transfers still held on any pipeline (must be 0), admitted p50/p99 per
phase, and the mesh's RSS at start and end. Results also go to bench/results/soak-*.json.

`--real`: the real workers instead (a PP=2 prefill pipeline and a TP=2 decode engine on a generated
tiny Llama, Mooncake TCP), faults being clients that leave at random points (during the prefill,
between the legs, mid-stream) and one decode rank stopped (SIGSTOP) for 5 s every `--fault-every`
seconds. Afterwards every pool must be back where it started: nothing held, free == total, and the
block census (free + held + running) adding up on both workers; the mesh's ledger empty.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.procs import MESH, start  # noqa: E402

FAULTS = [{"crash_after_pull": 0.5}, {"status": 500}, {"drop_release": 0.5}, {"slow_stage": 1, "slow_stage_ms": 300},
          {"crash_before_pull": 0.5}]


def pct(xs: list[float], q: float) -> float:
    return round(sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3, 2) if xs else float("nan")


def real_fleet(tmp: Path) -> tuple[list, list[str], list[str], list[int]]:
    """A PP=2 prefill and a TP=2 decode on a generated checkpoint; (procs, prefill, decode, decode rank pids)."""
    from workers.engine.checkpoint import generate, tiny_config

    ckpt = generate(tmp / "soak-llama", tiny_config(num_hidden_layers=4), seed=2)
    common = ["--checkpoint", str(ckpt), "--block-size", "16", "--num-blocks", str(REAL_BLOCKS), "--kv-backend",
              "mooncake", "--max-batch-tokens", "256"]
    pre, pl = start([*MESH, "prefill", *common, "--pp-size", "2"], "ready")
    dec, dl = start([*MESH, "decode", *common, "--tp-size", "2"], "ready")
    ranks = [c.pid for c in psutil.Process(dec.pid).children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
    return [pre, dec], [pl[-2].split()[1]], [dl[-2].split()[1]], ranks


REAL_BLOCKS = 512


async def settled_real(pre: list[str], dec: list[str], url: str) -> dict:
    """Wait (up to 30 s) for every pool to be back; what each worker and the ledger say then."""
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while True:
            out = {}
            for u in pre + dec:
                async with s.get(u + "/load") as r:
                    out[u] = await r.json()
            async with s.get(url + "/kv/ledger") as r:
                ledger_open = len((await r.json())["open"])
            done = all(x["free_blocks"] == x["num_blocks"] and not x["held_transfers"] for x in out.values())
            if (done and not ledger_open) or time.monotonic() > deadline:
                return {"workers": out, "ledger_open": ledger_open,
                        "census_adds_up": all(x["free_blocks"] + x["held_blocks"] + x["running_blocks"]
                                              == x["num_blocks"] for x in out.values())}
            await asyncio.sleep(0.5)


async def main(a: argparse.Namespace) -> dict:
    if a.real:
        return await main_real(a)
    fleet, lines = start([*MESH, "mock-fleet", "--prefill", "4", "--decode", "4", "--pp-size", "2", "--tp-size", "2",
                          "--prefill-ms-per-token", "0.05", "--decode-ms-per-token", "5", "--jitter", "0.2",
                          "--kv-ttl", "60"], "ready")
    pre = [x.split()[1] for x in lines if x.startswith("prefill ")]
    dec = [x.split()[1] for x in lines if x.startswith("decode ")]
    args = [*MESH, "--log-level", "ERROR", "serve", "--port", "0", "--max-concurrency", str(a.concurrency),
            "--max-queue", str(a.concurrency), "--queue-timeout", "2", "--ledger-grace", "2", "--health-interval", "1"]
    for u in pre:
        args += ["--prefill", u]
    for u in dec:
        args += ["--decode", u]
    mesh, mlines = start(args, "mesh ")
    url = mlines[-1].split()[1]
    proc = psutil.Process(mesh.pid)
    rss0 = proc.memory_info().rss
    counts = {"completed": 0, "failed_clear": 0, "lost": 0}
    lat: dict[str, list[float]] = {"steady": [], "overload": []}
    rejected = {"steady": 0, "overload": 0}
    rng = random.Random(1)
    phase = "steady"

    async def one(s: aiohttp.ClientSession) -> None:
        stream = rng.random() < 0.5
        body = {"model": "mock-model", "prompt": "soak " * rng.randint(20, 80), "max_tokens": rng.randint(8, 48),
                "stream": stream}
        t0 = time.perf_counter()
        try:
            async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
                raw = await r.read()
            if r.status == 200 and (not stream or raw.endswith(b"data: [DONE]\n\n")):
                counts["completed"] += 1
                lat[phase].append(time.perf_counter() - t0)
            elif (r.status >= 400 and b'"error"' in raw) or (r.status == 200 and b"event: error" in raw):
                counts["failed_clear"] += 1
                if r.status == 429:
                    rejected[phase] += 1
            else:
                counts["lost"] += 1
        except (aiohttp.ClientError, TimeoutError):
            counts["lost"] += 1

    async def client(s: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            await one(s)

    warm: list[int] = []

    async def sample_warm_rss() -> None:  # after a minute of traffic: pools, caches and rings are full
        await asyncio.sleep(min(60.0, a.minutes * 30))
        warm.append(proc.memory_info().rss)

    async def faults(until: float) -> None:
        async with aiohttp.ClientSession() as s:
            i = 0
            while time.monotonic() + a.fault_every < until:
                await asyncio.sleep(a.fault_every)
                f = FAULTS[i % len(FAULTS)]
                target = (dec if "pull" in str(f) or "release" in str(f) else pre)[i % 4]
                await s.post(target + "/mock/faults", json=f)
                await asyncio.sleep(10)
                await s.post(target + "/mock/faults", json={})
                i += 1

    t_start = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            steady_end = t_start + a.minutes * 60
            await asyncio.gather(faults(steady_end), sample_warm_rss(),
                                 *(client(s, steady_end) for _ in range(a.concurrency)))
            phase = "overload"
            await asyncio.gather(*(client(s, time.monotonic() + a.overload_seconds) for _ in range(2 * a.concurrency)))
        await asyncio.sleep(6)  # the ledger's grace, then count what is still held
        async with aiohttp.ClientSession() as s:
            leaked = 0
            for u in pre:
                async with s.get(u + "/kv/held") as r:
                    leaked += len((await r.json())["transfers"])
        rss1 = proc.memory_info().rss
    finally:
        for p in (mesh, fleet):
            p.terminate()
            p.wait(30)
    return {"args": vars(a), "counts": counts, "kv_leaked": leaked, "rejected_429": rejected,
            "steady_p50_ms": pct(lat["steady"], 0.5), "steady_p99_ms": pct(lat["steady"], 0.99),
            "overload_p50_ms": pct(lat["overload"], 0.5), "overload_p99_ms": pct(lat["overload"], 0.99),
            "rss_start_mb": round(rss0 / 2**20, 1), "rss_warm_mb": round(warm[0] / 2**20, 1),
            "rss_end_mb": round(rss1 / 2**20, 1), "rss_growth_from_start": round(rss1 / rss0 - 1, 4),
            "rss_growth_after_warmup": round(rss1 / warm[0] - 1, 4), "seconds": round(time.monotonic() - t_start, 1)}


async def main_real(a: argparse.Namespace) -> dict:
    import os
    import signal
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    procs, pre, dec, ranks = real_fleet(tmp)
    mesh, mlines = start([*MESH, "--log-level", "ERROR", "serve", "--port", "0", "--prefill", pre[0], "--decode",
                          dec[0], "--ledger-grace", "2", "--health-interval", "1"], "mesh ")
    url = mlines[-1].split()[1]
    proc = psutil.Process(mesh.pid)
    rss0 = proc.memory_info().rss
    counts = {"completed": 0, "failed_clear": 0, "left_by_client": 0, "lost": 0}
    lat: list[float] = []
    rng = random.Random(1)

    async def one(s: aiohttp.ClientSession) -> None:
        stream = rng.random() < 0.5
        leave = rng.random() < 0.3   # a client that leaves at a random point
        body = {"model": "soak-llama", "prompt": "soak " * rng.randint(5, 120), "max_tokens": rng.randint(4, 40),
                "stream": stream, "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(
                    total=rng.uniform(0.01, 0.6) if leave else 120)) as r:
                raw = await r.read()
            if r.status == 200 and (not stream or raw.endswith(b"data: [DONE]\n\n")):
                counts["completed"] += 1
                lat.append(time.perf_counter() - t0)
            elif (r.status >= 400 and b'"error"' in raw) or (r.status == 200 and b"event: error" in raw):
                counts["failed_clear"] += 1
            else:
                counts["lost"] += 1
        except (aiohttp.ClientError, TimeoutError):
            counts["left_by_client" if leave else "lost"] += 1

    async def client(s: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            await one(s)

    async def stop_a_rank(until: float) -> None:
        while time.monotonic() + a.fault_every < until:
            await asyncio.sleep(a.fault_every)
            os.kill(ranks[-1], signal.SIGSTOP)
            await asyncio.sleep(5)
            os.kill(ranks[-1], signal.SIGCONT)

    warm: list[int] = []

    async def sample_warm_rss() -> None:
        await asyncio.sleep(min(60.0, a.minutes * 30))
        warm.append(proc.memory_info().rss)

    t_start = time.monotonic()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            end = t_start + a.minutes * 60
            await asyncio.gather(stop_a_rank(end), sample_warm_rss(), *(client(s, end) for _ in range(a.concurrency)))
        after = await settled_real(pre, dec, url)
        rss1 = proc.memory_info().rss
    finally:
        for p in (mesh, *procs[::-1]):
            p.terminate()
            p.wait(30)
    return {"args": vars(a), "counts": counts, **after, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99),
            "rss_start_mb": round(rss0 / 2**20, 1), "rss_warm_mb": round(warm[0] / 2**20, 1),
            "rss_end_mb": round(rss1 / 2**20, 1), "rss_growth_after_warmup": round(rss1 / warm[0] - 1, 4),
            "seconds": round(time.monotonic() - t_start, 1)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--overload-seconds", type=float, default=60.0)
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--real", action="store_true", help="real PP=2 prefill and TP=2 decode workers (see above)")
    res = asyncio.run(main(ap.parse_args()))
    print(json.dumps(res, indent=2))
    out = ROOT / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")
