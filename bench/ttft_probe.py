"""Where PD's first token spends its time at c=1 (issue 19: TTFT with first token early vs the
monolithic engine). Starts the processes of bench/e2e.py (a PP=1 prefill, a TP=1 decode, a
monolithic `mesh decode`, a mesh with first-token-early) and times, request by request, in turns:

- `mono_stream_ttft`: a streamed completion's first chunk from the monolithic engine;
- `mono_one_token`: a non-streamed completion of one token from it (prefill plus one answer);
- `mesh_stream_ttft`: a streamed completion's first chunk through the mesh (PD, first token early);
- from the mesh's /metrics over those requests: its prefill leg (the mesh's request to the prefill
  worker until the answer is parsed) and its TTFT (the request's arrival to its first byte out).

    python3 bench/ttft_probe.py --device cuda --dtype bfloat16 --size large --kv-backend cuda-ipc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.e2e import _url  # noqa: E402
from bench.engine import SIZES  # noqa: E402
from bench.procs import MESH, start  # noqa: E402
from workers.engine.checkpoint import generate, tiny_config  # noqa: E402


def _hist(text: str, name: str, label: str) -> tuple[float, float]:
    """(sum, count) of a histogram's series with `label` in its labels."""
    out = []
    for suffix in ("_sum", "_count"):
        m = re.search(rf"^{name}{suffix}{{[^}}]*{label}[^}}]*}} ([0-9.e+-]+)$", text, re.M)
        out.append(float(m.group(1)) if m else 0.0)
    return out[0], out[1]


async def probe(mono: str, mesh: str, n: int, prompt_len: int) -> dict[str, Any]:
    times: dict[str, list[float]] = {"mono_stream_ttft": [], "mono_one_token": [], "mesh_stream_ttft": []}

    async def stream_ttft(s: aiohttp.ClientSession, url: str, i: int) -> float:
        body = {"model": "bench-llama", "prompt": (f"probe {i} " * prompt_len)[:prompt_len], "max_tokens": 4,
                "stream": True, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        first = None
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for _ in r.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
        assert first is not None
        return first

    async def one_token(s: aiohttp.ClientSession, url: str, i: int) -> float:
        body = {"model": "bench-llama", "prompt": (f"probe {i} " * prompt_len)[:prompt_len], "max_tokens": 1,
                "temperature": 0}
        t0 = time.perf_counter()
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        return time.perf_counter() - t0

    async with aiohttp.ClientSession() as s:
        for i in range(3):   # warm-up
            await stream_ttft(s, mono, i)
            await stream_ttft(s, mesh, i)
        async with s.get(mesh + "/metrics") as r:
            m0 = await r.text()
        for i in range(n):
            times["mono_stream_ttft"].append(await stream_ttft(s, mono, 100 + i))
            times["mono_one_token"].append(await one_token(s, mono, 100 + i))
            times["mesh_stream_ttft"].append(await stream_ttft(s, mesh, 100 + i))
        async with s.get(mesh + "/metrics") as r:
            m1 = await r.text()
    res: dict[str, Any] = {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()}
    for key, name, label in (("mesh_prefill_leg", "atomesh_leg_duration_seconds", 'leg="prefill"'),
                             ("mesh_ttft", "atomesh_ttft_seconds", 'route="completions"')):
        (s0, c0), (s1, c1) = _hist(m0, name, label), _hist(m1, name, label)
        res[key + "_mean"] = round((s1 - s0) / (c1 - c0) * 1e3, 3) if c1 > c0 else None
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--kv-backend", default="zmq", choices=["mooncake", "zmq", "cuda-ipc"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch

    d = Path(tempfile.mkdtemp(prefix="atomesh-ttft-")) / "bench-llama"
    generate(d, tiny_config(**SIZES[a.size]), seed=0, dtype=getattr(torch, a.dtype))
    common = ["--checkpoint", str(d), "--num-blocks", "2048", "--max-batch-tokens", "2048", "--dtype", a.dtype,
              "--kv-backend", a.kv_backend, "--device", a.device]
    procs = []
    urls = []
    try:   # the processes of bench/e2e.py, started as it does
        for cmd in (["prefill", *common, "--pp-size", "1"], ["decode", *common, "--tp-size", "1"],
                    ["decode", *common, "--tp-size", "1"]):
            p, (url,) = _url(start([*MESH, *cmd], cmd[0] + " "))
            procs.append(p)
            urls.append(url)
        pre, dec, mono = urls
        p, (mesh,) = _url(start([*MESH, "--log-level", "WARNING", "serve", "--port", "0", "--prefill", pre,
                                 "--decode", dec], "mesh "))
        procs.append(p)
        res = asyncio.run(probe(mono, mesh, a.requests, a.prompt_len))
        print(json.dumps(res), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps({"args": vars(a), **res}, indent=1))
    finally:
        for p in procs[::-1]:
            p.terminate()
        for p in procs:
            p.wait(30)


if __name__ == "__main__":
    main()
