"""`bench/overhead.py --anchors`: the mesh's CPU per PD request beside the Rust PD routers users
would otherwise run, in one run, against the zero-cost mock fleet speaking each router's dialect.

- sglang-router 0.3.2 (`sglang-router launch --pd-disaggregation`) against `mesh mock-fleet
  --dialect sglang`, and the mesh over the same fleet;
- vllm-router 0.1.17 (`vllm-router --vllm-pd-disaggregation`) against `--dialect vllm`, and the
  mesh over the same fleet;
- the mesh in `atom` (its ledger on) against `--dialect atom`;
- in each dialect, the direct baseline: this client runs both legs itself, in that dialect
  (`Client.direct`), so each proxy's added p50 is read against its own dialect's.

The routers are installed by this script into `.venv-anchors` (a bench-only venv, pinned; the
project never imports them). Every proxy runs pinned to the last core, the fleet and this client
on the others; a proxy's CPU is its process tree's user + system time over the requests it served.
The targets of a dialect run in rounds of alternating order after a warm run each
(`bench.overhead.rounds`), so none always meets the fleet first.
Every answer is checked: 16 tokens for JSON, 64 for SSE, each once (`check_tokens`). Policies:
round_robin for prefill and decode everywhere (the proxies' cost, not their policies', is measured).
Exits 1 when the mesh is above sglang-router at c >= 16 (JSON or SSE), as issue 20 asks.

`--upstream null`: every proxy (and the direct baseline) calls `bench/null_upstream.py` instead, the
fleet's own answers replayed at next to no CPU, so neither the fleet's CPU on the core beside the
proxy nor its pace is in the figures. It writes an SSE stream's events one a loop turn (the fleet at
zero timing sends them in bursts), and it has no holder API, so the mesh's atom flow is untracked.

`--prompt-bytes 1000,220000,1000000` with `--anchors`: long prompts instead, JSON at c=1 for each
size through every proxy and direct (the fleet's pools sized for the largest), so the mesh's CPU per
long-prompt request stands beside the Rust routers' on the same fleet, in the same run. (At c=1 a
request's CPU includes waking from idle: a 1 kB request that the fleet holds ~20 ms costs the mesh
about twice one it answers at once: `bench/overhead.py --prompt-bytes 1000 --fleet-args
"--prefill-ms-per-token 0.018"` beside the same without `--fleet-args`, 1.06 against 0.55 ms.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-anchors"
PINS = ("sglang-router==0.3.2", "vllm-router==0.1.17")
TOKEN = re.compile(rb'"text":" t\d+"')


def ensure_routers() -> Path:
    """The routers' venv, created and filled once (pip from the package index)."""
    bindir = VENV / "bin"
    if not (bindir / "sglang-router").exists() or not (bindir / "vllm-router").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(bindir / "pip"), "install", "-q", *PINS], check=True)
    return bindir


def check_tokens(raw: bytes, stream: bool, want: int) -> None:
    """The answer carries exactly `want` tokens (the mock's token t reads " t<t>")."""
    if stream:
        got = len(TOKEN.findall(raw))
        if b"data: [DONE]" not in raw:
            raise RuntimeError("the stream did not end with [DONE]")
    else:
        got = len(re.findall(r" t\d+", orjson.loads(raw)["choices"][0]["text"]))
    if got != want:
        raise RuntimeError(f"{got} tokens, not {want}")


class Tree:
    """A process and its children: CPU times summed (a router's launcher and its server)."""

    def __init__(self, pid: int) -> None:
        self.p = psutil.Process(pid)

    def procs(self) -> list[psutil.Process]:
        try:
            return [self.p, *self.p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu_times(self) -> tuple[float, float]:
        u = s = 0.0
        for q in self.procs():
            try:
                t = q.cpu_times()
            except psutil.NoSuchProcess:
                continue
            u, s = u + t.user, s + t.system
        return u, s

    def pin(self, cores: set[int]) -> None:
        for q in self.procs():
            try:
                os.sched_setaffinity(q.pid, cores)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass


async def wait_serving(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes],
                       timeout: float = 90) -> None:
    """Until a completion through `url` answers 200 (the router found and checked its workers)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the proxy exited ({proc.returncode})")
        try:
            async with session.post(url + "/v1/completions", json={"model": "mock-model", "prompt": "ready?",
                                                                    "max_tokens": 2}) as r:
                if r.status == 200:
                    return
                last = f"{r.status} {(await r.read())[:200]!r}"
        except aiohttp.ClientError as e:
            last = type(e).__name__
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not serving within {timeout:.0f}s: {last}")


def start_router(bindir: Path, kind: str, prefills: list[str],
                 decodes: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    from workers.engine.group import free_port  # (imports torch: only here, not for Tree's users)

    port, prom = free_port(), free_port()
    if kind == "sglang-router":
        cmd = [str(bindir / "sglang-router"), "launch", "--pd-disaggregation"]
        for u in prefills:   # the mock SGLang prefill's bootstrap server is its HTTP port
            cmd += ["--prefill", u, u.rsplit(":", 1)[1]]
    else:
        cmd = [str(bindir / "vllm-router"), "--vllm-pd-disaggregation"]
        for u in prefills:
            cmd += ["--prefill", u]
    for u in decodes:
        cmd += ["--decode", u]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(prom), "--log-level", "error" if kind == "vllm-router" else "warn"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p, f"http://127.0.0.1:{port}"


def start_mesh(mesh_cmd: list[str], dialect: str, prefills: list[str], decodes: list[str],
               tmp: Path, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], str]:
    from bench.procs import start

    toml = tmp / f"mesh-{dialect}.toml"
    lines = []
    for i, u in enumerate(prefills):
        lines += ["[[prefill]]", f'url = "{u}"', f'id = "{dialect}-p{i}"', 'model = "mock-model"',
                  f'dialect = "{dialect}"']
        if dialect == "sglang":   # the mock SGLang prefill's bootstrap server is its HTTP port
            lines.append(f"bootstrap_port = {u.rsplit(':', 1)[1]}")
    for i, u in enumerate(decodes):
        lines += ["[[decode]]", f'url = "{u}"', f'id = "{dialect}-d{i}"', 'model = "mock-model"',
                  f'dialect = "{dialect}"']
    toml.write_text("\n".join(lines) + "\n")
    p, out = start([*mesh_cmd, "--log-level", "WARNING", "serve", "--port", "0", "--config", str(toml),
                    "--prefill-policy", "round_robin", "--decode-policy", "round_robin", *extra], "mesh ")
    return p, out[-1].split()[1]


async def run(a: argparse.Namespace, idle: dict[str, Any] | None = None) -> int:
    """`idle`: what idle CPUs did during the run (`bench.procs.cpu_idle`), for the results file."""
    from bench.null_upstream import start_upstream
    from bench.overhead import Client, paired, rounds
    from bench.procs import MESH, Syscalls

    bindir = ensure_routers()
    cores = sorted(os.sched_getaffinity(0))
    proxy_core, rest = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    os.sched_setaffinity(0, rest)
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="atomesh-anchors-"))
    count = Syscalls.available()
    if not count:
        print("(perf stat cannot count system calls here: the proxies' reads, writes and wake-ups are not shown)")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for dialect, router in (("sglang", "sglang-router"), ("vllm", "vllm-router"), ("atom", None)):
            fleet, lines = await start_upstream(a.upstream, dialect, a.prompt_bytes or [0], a.prefill, a.decode,
                                                a.fleet_args.split(), tmp)
            pre = [x.split()[1] for x in lines if x.startswith("prefill ")]
            dec = [x.split()[1] for x in lines if x.startswith("decode ")]
            Tree(fleet.pid).pin(rest)
            procs: list[tuple[str, Any, str]] = []
            try:
                mp, murl = start_mesh(MESH, dialect, pre, dec, tmp)
                procs.append((f"mesh ({dialect})", mp, murl))
                if router is not None:
                    rp, rurl = start_router(bindir, router, pre, dec)
                    procs.append((router, rp, rurl))
                for _, p, url in procs:
                    await wait_serving(s, url, p)
                    Tree(p.pid).pin(proxy_core)
                named = [*procs, (f"direct ({dialect})", None, "")]
                # (stream, concurrency, prompt bytes) in turn; `--prompt-bytes`: JSON at c=1 for each size
                runs = ([(False, 1, size) for size in a.prompt_bytes] if a.prompt_bytes else
                        [(stream, conc, 0) for stream in (False, True) for conc in a.concurrency])
                for stream, conc, size in runs:
                    targets = []
                    for name, p, url in named:
                        client = Client(s, url, pre, dec, prompt_bytes=size)
                        client.check = True
                        client.dialect = dialect
                        targets.append((client, "direct" if p is None else "mesh",
                                        Tree(p.pid) if p is not None else Tree(os.getpid()), count and p is not None))
                    results = await rounds(targets, stream, conc, a.seconds / a.rounds, a.rounds, a.warm)
                    for (name, p, _), r in zip(named, results):
                        if size:
                            r.mode = f"json{size}B"
                        row = {"dialect": dialect, "proxy": name, "mode": r.mode, "c": conc, "rps": r.rps,
                               "p50_ms": r.p50_ms, "errors": r.errors, "requests": r.requests,
                               "cpu_ms_per_req": r.mesh_cpu_ms_per_req if p is not None else None,
                               "client_reads_per_stream": r.reads_per_stream, "syscalls_per_req": r.syscalls_per_req,
                               "cpu_ms_rounds": r.cpu_ms_rounds if p is not None else None}
                        rows.append(row)
                        cpu = f"  cpu {row['cpu_ms_per_req']:.3f} ms/req" if row["cpu_ms_per_req"] else ""
                        sc = r.syscalls_per_req
                        calls = (f"  reads {sc['reads']:.1f} writes {sc['writes']:.1f} wake-ups {sc['waits']:.1f}"
                                 if sc else "")
                        got = f"  client reads/stream {r.reads_per_stream:.0f}" if r.reads_per_stream else ""
                        print(f"{dialect:6} {name:14} {r.mode:5} c={conc:<3} {r.rps:8.1f} req/s  "
                              f"p50 {r.p50_ms:7.2f} ms  errors {r.errors}{cpu}{calls}{got}", flush=True)
                    if conc == 1 and not size and a.paired_seconds > 0:
                        # the added latency, paired: direct first (the baseline), then each proxy
                        order = [len(named) - 1, *range(len(named) - 1)]
                        pairs = await paired([(targets[i][0], targets[i][1]) for i in order], stream,
                                             a.paired_seconds)
                        mode = "sse64" if stream else "json"
                        for i, res in zip(order, pairs):
                            name = named[i][0]
                            next(x for x in rows if x["proxy"] == name and x["mode"] == mode and x["c"] == 1)[
                                "paired"] = res
                            if i == order[0]:
                                continue
                            print(f"{dialect:6} {name:14} {mode:5} c=1   paired: p50 {res['p50_ms']:.3f} ms beside "
                                  f"direct {res['base_p50_ms']:.3f} ms, added {res['added_p50_ms']:+.3f} ms "
                                  f"(median of differences {res['median_diff_ms']:+.3f}), {res['requests']} turns, "
                                  f"errors {res['errors']}", flush=True)
            finally:
                for _, p, _ in procs:
                    p.terminate()
                    p.wait(15)
                fleet.terminate()
                fleet.wait(15)
    return report(rows, idle, a.upstream)


def round_ratios(mesh: list[float] | None, router: list[float] | None) -> str:
    """The mesh's ratio to a router round by round (`bench.overhead.rounds` runs them next to each
    other in every round, the order reversed each time), where there are three rounds or more: the
    median ratio, its range and how many rounds read at or below 1. The pooled ratio weighs every
    request alike, so a round in which the machine ran slow moves it; the rounds' own ratios show
    whether the verdict holds round by round."""
    if not mesh or not router or len(mesh) != len(router) or len(mesh) < 3:
        return ""
    rs = sorted(m / x for m, x in zip(mesh, router))
    return (f"; by round: median x{statistics.median(rs):.2f}, x{rs[0]:.2f}-{rs[-1]:.2f}, "
            f"{sum(r <= 1 for r in rs)}/{len(rs)} at or below")


def report(rows: list[dict[str, Any]], idle: dict[str, Any] | None = None, upstream: str = "fleet") -> int:
    by = {(r["proxy"], r["mode"], r["c"]): r for r in rows}
    print("\nCPU ms per PD request (proxy pinned to its own core), the mesh's ratio to each router; upstream: "
          + ("the mock fleet" if upstream == "fleet" else "null (the mock fleet's answers replayed, bench/null_upstream.py;"
             " no holder API, so the mesh's atom flow is untracked)") + ":")
    bad = []
    modes = list(dict.fromkeys(r["mode"] for r in rows))   # json, sse64; or json<bytes>B (`--prompt-bytes`)
    for mode in modes:
        for c in sorted({r["c"] for r in rows}):
            cells = []
            for mesh, router in (("mesh (sglang)", "sglang-router"), ("mesh (vllm)", "vllm-router")):
                m, x = by.get((mesh, mode, c)), by.get((router, mode, c))
                if m and x and m["cpu_ms_per_req"] and x["cpu_ms_per_req"]:
                    ratio = m["cpu_ms_per_req"] / x["cpu_ms_per_req"]
                    cells.append(f"{mesh} {m['cpu_ms_per_req']:.3f} vs {router} {x['cpu_ms_per_req']:.3f} "
                                 f"(x{ratio:.2f}{round_ratios(m.get('cpu_ms_rounds'), x.get('cpu_ms_rounds'))})")
                    if router == "sglang-router" and c >= 16 and mode in ("json", "sse64") and ratio > 1:
                        bad.append(f"{mode} c={c} x{ratio:.2f}")
            atom = by.get(("mesh (atom)", mode, c))
            if atom:
                cells.append(f"mesh (atom) {atom['cpu_ms_per_req']:.3f}")
            if cells:
                print(f"  {mode:5} c={c:<3} " + " | ".join(cells))
    print("\np50 added over the direct baseline of the same dialect (this client runs both legs itself):")
    for mode in modes:
        for c in sorted({r["c"] for r in rows}):
            cells = []
            for dialect, names in (("sglang", ("mesh (sglang)", "sglang-router")),
                                   ("vllm", ("mesh (vllm)", "vllm-router")), ("atom", ("mesh (atom)",))):
                d = by.get((f"direct ({dialect})", mode, c))
                for name in names:
                    x = by.get((name, mode, c))
                    if d and x:
                        cells.append(f"{name} {x['p50_ms'] - d['p50_ms']:+.3f} ms")
            if cells:
                print(f"  {mode:5} c={c:<3} " + " | ".join(cells))
    paired = [r for r in rows if r.get("paired") and not r["proxy"].startswith("direct")]
    if paired:
        print("\np50 added at c=1, paired (each proxy's requests in turn with direct ones, `overhead.paired`):")
        for r in paired:
            x = r["paired"]
            print(f"  {r['mode']:5} {r['proxy']:14} {x['added_p50_ms']:+.3f} ms (p50 {x['p50_ms']:.3f} beside "
                  f"{x['base_p50_ms']:.3f}; median of differences {x['median_diff_ms']:+.3f}; {x['requests']} turns)")
    errors = sum(r["errors"] + (r["paired"]["errors"] if r.get("paired") else 0) for r in rows)
    print(f"errors (wrong token counts included): {errors}")
    out = ROOT / "bench" / "results" / f"anchors-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(orjson.dumps({"pins": PINS, "cpu_idle": idle, "upstream": upstream, "rows": rows},
                                option=orjson.OPT_INDENT_2).decode())
    print(f"wrote {out}")
    if bad:
        print("the mesh is above sglang-router at: " + ", ".join(bad))
    return 1 if bad or errors else 0
