"""Mesh overhead benchmark: the mesh in front of a zero-latency mock fleet vs. calling it directly.

Starts `mesh mock-fleet` (zero timing) and `mesh serve` as separate processes, then drives
them with a closed-loop asyncio client at each concurrency, for non-streaming JSON and for
64-token SSE, through the mesh and directly (the client runs the prefill leg, then the decode
leg itself, exactly as the mesh would). Reports req/s, p50/p99 latency, TTFT, and the mesh
process's own CPU time per request; writes JSON under bench/results/.

    .venv/bin/python bench/overhead.py [--seconds 5] [--concurrency 1,16,64] [--mesh-tree DIR]
    .venv/bin/python bench/overhead.py --prompt-bytes 1000,220000,1000000   # long prompts
    .venv/bin/python bench/overhead.py --anchors --seconds 4   # beside sglang-router and vllm-router
    .venv/bin/python bench/overhead.py --anchors --prompt-bytes 1000,220000,1000000   # long prompts, beside them
    .venv/bin/python bench/overhead.py --rss-minutes 10        # the mesh's RSS at its highest rate
    sudo .venv/bin/python bench/overhead.py --anchors --awake  # the CPUs kept out of halting (bench.procs.CpuAwake)
    .venv/bin/python bench/overhead.py --upstream null --prompt-bytes 1000,220000,1000000   # no fleet CPU beside

Before/after a change, in one run on one machine: check the old commit out in a worktree and let
this same script start the mesh and the mock fleet from each tree in turn (alternate a few rounds:
these machines are noisy):

    git worktree add /tmp/before <old-commit>
    for r in 1 2 3; do for t in /tmp/before .; do .venv/bin/python bench/overhead.py --mesh-tree $t; done; done
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import MESH, start  # noqa: E402
from contract.protocol import KVRequestParams, handoff_for_decode  # noqa: E402


@dataclass
class Result:
    target: str
    mode: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float
    mesh_cpu_ms_per_req: float | None
    mesh_sys_share: float | None = None   # of that CPU, the kernel's (system time): syscalls, copies
    # SSE: the median count of reads that brought this client bytes, per stream (a proxy that sends
    # each event as it comes gives about one per event; one that gathers events, fewer)
    reads_per_stream: float | None = None
    # the proxy's system calls per request by kind (`bench.procs.Syscalls`), where counted
    syscalls_per_req: dict[str, float] | None = None
    # the proxy's CPU ms per request in each round (`rounds`), in the order they ran
    cpu_ms_rounds: list[float] | None = None


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Client:
    def __init__(self, session: aiohttp.ClientSession, mesh: str, prefills: list[str], decodes: list[str],
                 prompt_bytes: int = 0) -> None:
        """`prompt_bytes`: prompts of this many bytes (ASCII), each one new from its first bytes (no
        prefix shared with another request: every chunk a cache-aware policy keys is new)."""
        self.s, self.mesh, self.prefills, self.decodes = session, mesh, prefills, decodes
        self.i = 0
        self.check = False   # read every answer whole and check its token count (bench/anchors.py)
        self.dialect = "atom"   # the fleet's, for `direct`
        self.reads: list[int] = []   # SSE: per stream, the reads that brought bytes
        # `direct` keeps each leg's answer here (bench/null_upstream.py's capture): "prefill", "decode"
        self.captured: dict[str, bytes] | None = None
        self.filler = "".join(chr(97 + (i * 7919) % 26) for i in range(prompt_bytes)) if prompt_bytes else ""

    def body(self, stream: bool) -> dict[str, Any]:
        self.i += 1
        if self.filler:
            head = f"request {self.i} "
            prompt = head + self.filler[len(head):]
        else:
            prompt = f"benchmark prompt {self.i % 97} " * 8
        b: dict[str, Any] = {"model": "mock-model", "prompt": prompt, "max_tokens": 64 if stream else 16}
        if stream:
            b["stream"] = True
        return b

    async def via_mesh(self, stream: bool) -> tuple[float, float]:
        t0 = time.perf_counter()
        body = self.body(stream)
        ttft = await self._answer(self.mesh, body, stream, t0, "mesh")
        return time.perf_counter() - t0, ttft

    async def _answer(self, url: str, body: dict[str, Any], stream: bool, t0: float, who: str) -> float:
        """POST `body` to `url`, read the answer whole; counts the SSE stream's reads and, with
        `check`, its tokens. Returns the time to its first bytes since `t0`."""
        async with self.s.post(url + "/v1/completions", data=orjson.dumps(body),
                               headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"{who} answered {r.status}")
            first = await r.content.readany()
            ttft = time.perf_counter() - t0
            got = [first]
            reads = 0
            while first:
                reads += 1
                first = await r.content.readany()
                if self.check:
                    got.append(first)
            if stream:
                self.reads.append(reads)
        if self.check:
            from bench.anchors import check_tokens

            check_tokens(b"".join(got), stream, body["max_tokens"])
            if self.captured is not None and who == "decode":
                self.captured["decode"] = b"".join(got)
        return ttft

    async def direct(self, stream: bool) -> tuple[float, float]:
        """The PD request without a proxy: this client runs both legs in the fleet's dialect, as
        the mesh (and each router) would. atom: prefill (one token, the decode named), then the
        decode with the prefill's params; vllm (the NIXL toy proxy's protocol): prefill with
        `do_remote_decode`, then the decode with the prefill's `kv_transfer_params` as they came;
        sglang (mini_lb's): both legs at once with the same `bootstrap_host/port/room`."""
        t0 = time.perf_counter()
        body = self.body(stream)
        p = self.prefills[self.i % len(self.prefills)]
        d = self.decodes[self.i % len(self.decodes)]
        json_h = {"Content-Type": "application/json"}
        if self.dialect == "sglang":
            host, port = p.split("://")[1].rsplit(":", 1)   # the mock's bootstrap server is its HTTP port
            boot = {"bootstrap_host": host, "bootstrap_port": int(port),
                    "bootstrap_room": int.from_bytes(os.urandom(8), "big") >> 1}
            pb = {**body, **boot, "stream": False}

            async def prefill() -> None:
                async with self.s.post(p + "/v1/completions", data=orjson.dumps(pb), headers=json_h) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"prefill answered {r.status}")
                if self.captured is not None:
                    self.captured["prefill"] = raw

            pre = asyncio.ensure_future(prefill())
            db = {**body, **boot}
        else:
            pre = None
            if self.dialect == "vllm":
                pb = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
                    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None}}
            else:
                host, port = d.split("://")[1].rsplit(":", 1)
                pb = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": KVRequestParams(
                    remote_engine_id="d", remote_host=host, remote_port=int(port), remote_handshake_port=0,
                    remote_tp_size=1).encode()}
            async with self.s.post(p + "/v1/completions", data=orjson.dumps(pb), headers=json_h) as r:
                raw = await r.read()
            if self.captured is not None:
                self.captured["prefill"] = raw
            kv = orjson.loads(raw)["kv_transfer_params"]
            db = {**body, "kv_transfer_params": kv if self.dialect == "vllm" else handoff_for_decode(kv)}
        try:
            ttft = await self._answer(d, db, stream, t0, "decode")
        except BaseException:
            if pre is not None:   # the decode failed: its prefill leg goes too
                pre.cancel()
            raise
        if pre is not None:
            await pre
        return time.perf_counter() - t0, ttft


PROFILE: str | None = None   # --profile: where py-spy's samples of the mesh go


@dataclass
class Raw:
    """What the runs of one target at one (mode, concurrency) measured, pooled over its rounds."""
    lat: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    reads: list[float] = field(default_factory=list)
    calls: dict[str, float] | None = None
    errors: int = 0
    seconds: float = 0.0
    user: float = 0.0
    system: float = 0.0
    per_round: list[float] = field(default_factory=list)   # CPU ms per request of each run pooled here


async def run_one(client: Client, target: str, stream: bool, conc: int, seconds: float,
                  mesh_proc: Any, count_syscalls: bool = False, raw: Raw | None = None) -> Result:
    """One closed-loop run. `count_syscalls`: the proxy's (`mesh_proc`'s tree's) system calls over
    the measured part, by `perf stat` (`bench.procs.Syscalls`; the caller checks that it is
    available). `raw`: add this run's measurements to it and answer for all it holds (`rounds`)."""
    fn = client.via_mesh if target == "mesh" else client.direct
    raw = raw if raw is not None else Raw()
    lat, ttft = raw.lat, raw.ttft
    for _ in range(min(50, conc * 5) if not client.filler else 3):  # warm-up: connections and caches
        await fn(stream)
    stop_at = time.perf_counter() + seconds
    spy = None
    if PROFILE and target == "mesh":
        mode = f"{'sse' if stream else 'json'}{len(client.filler) or ''}"
        spy = subprocess.Popen(["py-spy", "record", "-p", str(mesh_proc.p.pid), "-r", "500", "-d", str(int(seconds)),
                                "-f", "raw", "-o", str(Path(PROFILE) / f"spy-{mode}-c{conc}.txt")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def loop() -> None:
        while time.perf_counter() < stop_at:
            try:
                a, b = await fn(stream)
                lat.append(a)
                ttft.append(b)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                raw.errors += 1

    counter = None
    if count_syscalls:
        from bench.procs import Syscalls

        counter = Syscalls([q.pid for q in mesh_proc.procs()],
                           Path(tempfile.mkdtemp(prefix="atomesh-perf-")) / "stat.csv")
        counter.start()
    u0, s0 = mesh_proc.cpu_times()[:2]
    client.reads.clear()
    n0 = len(lat)
    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(conc)))
    raw.seconds += time.perf_counter() - t0
    u1, s1 = mesh_proc.cpu_times()[:2]
    raw.user += u1 - u0
    raw.system += s1 - s0
    if len(lat) > n0:
        raw.per_round.append(round((u1 - u0 + s1 - s0) / (len(lat) - n0) * 1e3, 4))
    raw.reads += [float(x) for x in client.reads]
    calls = counter.stop() if counter is not None else None
    if calls is not None:
        raw.calls = {k: (raw.calls or {}).get(k, 0.0) + v for k, v in calls.items()}
    if spy is not None:
        spy.wait(60)
    return pooled(raw, target, stream, conc)


def pooled(raw: Raw, target: str, stream: bool, conc: int) -> Result:
    n, cpu = len(raw.lat), raw.user + raw.system
    return Result(target, "sse64" if stream else "json", conc, n, raw.errors, round(raw.seconds, 3),
                  round(n / raw.seconds, 1) if raw.seconds else 0.0,
                  round(pct(raw.lat, 0.5) * 1e3, 3), round(pct(raw.lat, 0.99) * 1e3, 3),
                  round(pct(raw.ttft, 0.5) * 1e3, 3),
                  round(cpu / n * 1e3, 4) if target == "mesh" and n else None,
                  round(raw.system / cpu, 3) if target == "mesh" and cpu > 0 else None,
                  pct(raw.reads, 0.5) if raw.reads else None,
                  {k: round(v / n, 1) for k, v in raw.calls.items()} if raw.calls is not None and n else None,
                  list(raw.per_round) if target == "mesh" else None)


async def rounds(targets: list[tuple[Client, str, Any, bool]], stream: bool, conc: int, seconds: float,
                 n: int, warm: float = 1.0) -> list[Result]:
    """Each target (client, "mesh" | "direct", process tree, count syscalls) run `n` times,
    `seconds` each, the order reversed every other round (A B C, C B A, ...), after `warm` seconds
    of each unmeasured: whichever ran first after a change of mode met a colder fleet (vllm, JSON,
    c=1: vllm-router's p50 2.04 ms when it ran first, 1.67 ms after the mesh had run; the mesh's
    1.84 and 1.82 ms after it), and `--anchors` always ran the mesh first. Latencies, CPU and
    counts are pooled over the rounds."""
    for client, target, tree, _ in targets if warm > 0 else ():
        await run_one(client, target, stream, conc, warm, tree)
    raws = [Raw() for _ in targets]
    for r in range(n):
        order = list(range(len(targets)))[::(-1 if r % 2 else 1)]
        for i in order:
            client, target, tree, count = targets[i]
            await run_one(client, target, stream, conc, seconds, tree, count_syscalls=count, raw=raws[i])
    return [pooled(raw, t[1], stream, conc) for raw, t in zip(raws, targets)]


async def paired(targets: list[tuple[Client, str]], stream: bool, seconds: float) -> list[dict[str, Any]]:
    """Added latency at c=1, paired: one request to each target in turn (the order rotated each
    turn, so each is first equally often), for `seconds`, after a turn unmeasured; the first
    target is the baseline (direct). Separate runs per target (`rounds`) compare p50s taken
    seconds apart, and this machine drifts by more than the difference between them (added p50 at
    c=1 read -0.20 to +0.30 ms for one router in three runs); here every request of a target has
    a baseline request beside it, in the same second. For each target: its p50, the p50 of the
    baseline over the same turns, and the median of the per-turn differences. Errors are counted;
    a turn with an error is dropped for every target."""
    n = len(targets)
    for client, target in targets:
        await (client.via_mesh if target == "mesh" else client.direct)(stream)
    lat: list[list[float]] = [[] for _ in targets]
    errors = [0] * n
    stop_at = time.perf_counter() + seconds
    turn = 0
    while time.perf_counter() < stop_at:
        got: list[float | None] = [None] * n
        for k in range(n):
            i = (turn + k) % n
            client, target = targets[i]
            try:
                got[i] = (await (client.via_mesh if target == "mesh" else client.direct)(stream))[0]
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors[i] += 1
        turn += 1
        if all(x is not None for x in got):
            for i in range(n):
                lat[i].append(got[i])  # type: ignore[arg-type]  # checked just above
    base = lat[0]
    out = []
    for i in range(n):
        diffs = [x - b for x, b in zip(lat[i], base)]
        out.append({"requests": len(lat[i]), "errors": errors[i],
                    "p50_ms": round(pct(lat[i], 0.5) * 1e3, 3) if lat[i] else None,
                    "base_p50_ms": round(pct(base, 0.5) * 1e3, 3) if base else None,
                    "added_p50_ms": round((pct(lat[i], 0.5) - pct(base, 0.5)) * 1e3, 3) if base else None,
                    "median_diff_ms": round(pct(diffs, 0.5) * 1e3, 3) if diffs else None})
    return out


async def main(a: argparse.Namespace) -> list[Result]:
    from bench.null_upstream import start_upstream

    fleet, lines = await start_upstream(a.upstream, "atom", a.prompt_bytes or [0], a.prefill, a.decode,
                                        a.fleet_args.split(), Path(tempfile.mkdtemp(prefix="atomesh-overhead-")))
    prefills = [line.split()[1] for line in lines if line.startswith("prefill ")]
    decodes = [line.split()[1] for line in lines if line.startswith("decode ")]
    cmd = [*MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill-policy", a.policy,
           "--decode-policy", "round_robin", *a.mesh_args.split()]
    for u in prefills:
        cmd += ["--prefill", u]
    for u in decodes:
        cmd += ["--decode", u]
    mesh, mlines = start(cmd, "mesh ")
    url = mlines[-1].split()[1]
    results: list[Result] = []
    try:
        proc = psutil.Process(mesh.pid)
        from bench.anchors import Tree

        tree = Tree(mesh.pid)   # `--mesh-args "--workers N"`: the processes it forked count too
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:
            for size in a.prompt_bytes:   # long prompts: JSON, one request at a time, each size in turn
                client = Client(s, url, prefills, decodes, prompt_bytes=size)
                both = await rounds([(client, "direct", tree, False), (client, "mesh", tree, False)], False, 1,
                                    a.seconds / a.rounds, a.rounds, a.warm)
                for target, r in zip(("direct", "mesh"), both):
                    r.mode = f"json {size}B"
                    results.append(r)
                    print(f"prompt {size:8} B {target:6} {r.rps:8.1f} req/s  p50 {r.p50_ms:7.2f} ms  errors {r.errors}"
                          + (f"  mesh cpu {r.mesh_cpu_ms_per_req:.3f} ms/req "
                             f"({r.mesh_cpu_ms_per_req / size * 1e6:.2f} us/kB, system {r.mesh_sys_share:.0%})"
                             if r.mesh_cpu_ms_per_req else ""),
                          flush=True)
            if a.prompt_bytes:
                return results
            if a.rss_minutes:
                await rss_run(Client(s, url, prefills, decodes), proc, a.rss_minutes, upstream=a.upstream)
                return results
            client = Client(s, url, prefills, decodes)
            for stream in (False, True):
                for conc in a.concurrency:
                    both = await rounds([(client, "direct", tree, False), (client, "mesh", tree, False)], stream, conc,
                                        a.seconds / a.rounds, a.rounds, a.warm)
                    for target, r in zip(("direct", "mesh"), both):
                        results.append(r)
                        print(f"{r.mode:5} c={conc:<3} {target:6} {r.rps:8.1f} req/s  p50 {r.p50_ms:7.2f} ms  "
                              f"p99 {r.p99_ms:7.2f} ms  ttft {r.ttft_p50_ms:7.2f} ms  errors {r.errors}"
                              + (f"  mesh cpu {r.mesh_cpu_ms_per_req:.3f} ms/req (system {r.mesh_sys_share:.0%})"
                                 if r.mesh_cpu_ms_per_req else ""),
                              flush=True)
    finally:
        for p in (mesh, fleet):
            p.terminate()
            p.wait(10)
    return results


async def rss_run(client: Client, proc: psutil.Process, minutes: float, conc: int = 64,
                  upstream: str = "fleet") -> None:
    """`--rss-minutes`: the mesh at its highest rate (closed loop, `conc` at once, JSON and SSE in
    turn, every answer's token count checked) for `minutes`; its RSS sampled every 5 s, the growth
    from the end of the first minute (warm-up) to the end."""
    client.check = True
    stop_at = time.monotonic() + minutes * 60
    done = errors = 0
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()

    async def loop(k: int) -> None:
        nonlocal done, errors
        while time.monotonic() < stop_at:
            try:
                await client.via_mesh(stream=(done + k) % 2 == 1)
                done += 1
            except Exception:  # noqa: BLE001 - counted
                errors += 1

    async def sample() -> None:
        while time.monotonic() < stop_at:
            samples.append((time.monotonic() - t0, proc.memory_info().rss))
            await asyncio.sleep(5)

    await asyncio.gather(sample(), *(loop(k) for k in range(conc)))
    samples.append((time.monotonic() - t0, proc.memory_info().rss))
    warm = next(r for t, r in samples if t >= 60) if minutes > 1 else samples[0][1]
    end = samples[-1][1]
    res = {"minutes": minutes, "concurrency": conc, "upstream": upstream, "requests": done, "errors": errors,
           "rps": round(done / (minutes * 60), 1), "rss_start_mb": round(samples[0][1] / 2**20, 1),
           "rss_after_warmup_mb": round(warm / 2**20, 1), "rss_end_mb": round(end / 2**20, 1),
           "growth_after_warmup_pct": round((end / warm - 1) * 100, 2),
           "samples": [(round(t, 1), round(r / 2**20, 2)) for t, r in samples]}
    print(f"{done} requests ({res['rps']} req/s), {errors} errors; mesh RSS {res['rss_start_mb']} MB at start, "
          f"{res['rss_after_warmup_mb']} MB after 1 min, {res['rss_end_mb']} MB at the end: "
          f"{res['growth_after_warmup_pct']:+.2f}% after warm-up", flush=True)
    out = ROOT / "bench" / "results" / f"rss-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


def summary(results: list[Result]) -> list[dict[str, Any]]:
    out = []
    by = {(r.target, r.mode, r.concurrency): r for r in results}
    for (t, mode, c), r in by.items():
        if t != "mesh":
            continue
        d = by[("direct", mode, c)]
        out.append({"mode": mode, "concurrency": c, "mesh_cpu_ms_per_req": r.mesh_cpu_ms_per_req,
                    **({"mesh_cpu_us_per_kB": round(r.mesh_cpu_ms_per_req / int(mode.split()[1][:-1]) * 1e6, 3)}
                       if mode.startswith("json ") and r.mesh_cpu_ms_per_req else {}),
                    "added_p50_ms": round(r.p50_ms - d.p50_ms, 3),
                    "rps_ratio_mesh_over_direct": round(r.rps / d.rps, 3) if d.rps else None,
                    "p50_ratio_mesh_over_direct": round(r.p50_ms / d.p50_ms, 3) if d.p50_ms else None})
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="per target and (mode, concurrency), over all rounds")
    ap.add_argument("--rounds", type=int, default=2, help="runs per target, in alternating order (see `rounds`)")
    ap.add_argument("--warm", type=float, default=1.0, help="seconds each target runs unmeasured before the rounds")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--policy", default="cache_aware", help="prefill policy of the mesh")
    ap.add_argument("--mesh-args", default="", help="extra `mesh serve` arguments, e.g. '--ledger-interval 1'")
    ap.add_argument("--fleet-args", default="", help="extra arguments to the upstream: `mesh mock-fleet`'s, e.g. "
                    "'--prefill-ms-per-token 0.015' (the mesh idle between requests, as it is beside a real engine); "
                    "with --upstream null, bench/null_upstream.py's, e.g. '--work-us-per-kb 17' (a busy neighbour)")
    ap.add_argument("--upstream", choices=("fleet", "null"), default="fleet", help="what the proxies call: the mock "
                    "fleet, or the null upstream that replays its answers at next to no cost (bench/null_upstream.py: "
                    "the fleet's own CPU and pace out of every proxy's figures)")
    ap.add_argument("--mesh-tree", help="run `mesh serve` and `mesh mock-fleet` from this source tree (a worktree "
                    "of another commit) instead of this one")
    ap.add_argument("--prompt-bytes", default="", help="long prompts instead: these sizes in bytes (e.g. "
                    "1000,220000,1000000), JSON at concurrency 1, the mesh's CPU per request and per kB "
                    "(with --anchors: beside the routers)")
    ap.add_argument("--anchors", action="store_true", help="instead: the mesh beside sglang-router and vllm-router "
                    "(installed into .venv-anchors) and the direct baseline, each in its dialect (bench/anchors.py)")
    ap.add_argument("--paired-seconds", type=float, default=4.0, help="with --anchors: after the c=1 runs, this "
                    "long of requests to each proxy in turn with direct ones, for the added p50 (0: none)")
    ap.add_argument("--profile", metavar="DIR", help="py-spy (on PATH) samples the mesh during each of its runs: "
                    "raw stacks to DIR/spy-<mode>-c<concurrency>.txt")
    ap.add_argument("--awake", action="store_true", help="hold the CPUs out of their halting idle state for the "
                    "whole run (a PM QoS request of 0 us, as tuned's latency-performance profile makes; needs root): "
                    "on a VM whose idle vCPU halts, the work after each halt runs slower (bench/idle_penalty.py)")
    ap.add_argument("--rss-minutes", type=float, default=0.0, help="instead: the mesh at its highest rate for this "
                    "many minutes, its RSS sampled (growth after the first minute)")
    args = ap.parse_args()
    args.prompt_bytes = [int(x) for x in args.prompt_bytes.split(",") if x]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        PROFILE = args.profile
    if args.mesh_tree:  # the processes this script starts import the mesh from there
        os.environ["PYTHONPATH"] = str(Path(args.mesh_tree).resolve())
    args.concurrency = [int(x) for x in args.concurrency.split(",")]
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    from bench.procs import CpuAwake, cpu_idle

    awake = CpuAwake() if args.awake else None   # held until this process exits (its file closes)
    if awake is not None and not awake.__enter__().held:
        sys.exit(f"--awake: cannot hold the CPUs out of halting: {awake.why}")
    idle = {**cpu_idle(), "held_awake": args.awake}
    print(f"idle CPUs: {'kept polling (PM QoS 0 us)' if args.awake else 'as configured'} {idle}", flush=True)
    if args.anchors:
        from bench.anchors import run as run_anchors

        sys.exit(asyncio.run(run_anchors(args, idle)))
    res = asyncio.run(main(args))
    if args.rss_minutes:
        sys.exit(0)
    summ = summary(res)
    print(f"\nsummary (mesh vs direct, same run; upstream: {args.upstream}):")
    for s in summ:
        print(f"  {s['mode']:5} c={s['concurrency']:<3} mesh cpu {s['mesh_cpu_ms_per_req']} ms/req  "
              f"added p50 {s['added_p50_ms']:+.3f} ms  rps ratio {s['rps_ratio_mesh_over_direct']}")
    out = ROOT / "bench" / "results" / f"overhead-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "host": os.uname().nodename,
                               "cpus": os.cpu_count(), "cpu_idle": idle, "results": [asdict(r) for r in res],
                               "summary": summ}, indent=2))
    print(f"wrote {out}")
