"""`mesh bench`: a load generator for any OpenAI endpoint (the mesh or a single engine).

Closed loop: `concurrency` clients send `requests` streamed completions in all; each stream is
timed per chunk: TTFT (first content chunk), TPOT (the time from it to the last content chunk over
the tokens after the first: the tokens are the stream's usage, asked for with
`stream_options.include_usage`, so a chunk carrying several tokens or an engine that sends none for
some does not skew it; as vLLM's benchmark_serving defines it), ITL (every gap between chunks). An
error event in the stream (`event: error`, or a data line with an `error` object) counts as an
error. Prints a progress line to stderr and a summary table; `--out FILE` writes the results as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str
    model: str
    requests: int = 100
    concurrency: int = 8
    prompt_len: int = 128
    max_tokens: int = 64
    api_key: str | None = None
    timeout: float = 120.0
    extra_body: dict[str, Any] = field(default_factory=dict)   # e.g. temperature, ignore_eos

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1 or self.prompt_len < 1 or self.max_tokens < 1:
            raise ValueError("requests, concurrency, prompt_len and max_tokens must be >= 1")


@dataclass(slots=True)
class Results:
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _one(s: aiohttp.ClientSession, cfg: BenchConfig, i: int, res: Results) -> None:
    body = {"model": cfg.model, "prompt": (f"request {i} " * cfg.prompt_len)[:cfg.prompt_len],
            "max_tokens": cfg.max_tokens, "stream": True, "stream_options": {"include_usage": True},
            **cfg.extra_body}
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: int | None = None
    try:
        async with s.post(cfg.url.rstrip("/") + "/v1/completions", json=body) as r:
            if r.status != 200:
                key = str(r.status)
                res.errors[key] = res.errors.get(key, 0) + 1
                await r.read()
                return
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    if ev.startswith(b"event: error"):
                        res.errors["stream_error"] = res.errors.get("stream_error", 0) + 1
                        return
                    if ev.startswith(b"data: {"):
                        d = orjson.loads(ev[6:])
                        if "error" in d:
                            res.errors["stream_error"] = res.errors.get("stream_error", 0) + 1
                            return
                        if any("text" in c for c in d.get("choices") or ()):   # a content chunk
                            stamps.append(time.perf_counter())
                        u = d.get("usage")
                        if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
                            usage = u["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as e:
        key = type(e).__name__
        res.errors[key] = res.errors.get(key, 0) + 1
        return
    res.ok += 1
    if stamps:
        res.ttft.append(stamps[0] - t0)
        n = usage if usage is not None else len(stamps)   # an endpoint without usage: one token a chunk
        res.tokens += n
        res.itl += [b - a for a, b in zip(stamps, stamps[1:])]
        if n > 1 and len(stamps) > 1:
            res.tpot.append((stamps[-1] - stamps[0]) / (n - 1))


async def run(cfg: BenchConfig, progress: bool = True) -> Results:
    res = Results()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    todo = iter(range(cfg.requests))
    done = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal done
        for i in todo:
            await _one(s, cfg, i, res)
            done += 1
            if progress:
                bar = "#" * (30 * done // cfg.requests)
                print(f"\r[{bar:<30}] {done}/{cfg.requests}", end="", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=cfg.timeout),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(worker(s) for _ in range(cfg.concurrency)))
    res.seconds = time.perf_counter() - t0
    if progress:
        print(file=sys.stderr)
    return res


def summary(cfg: BenchConfig, r: Results) -> dict[str, Any]:
    def ms(xs: list[float], q: float) -> float:
        return round(pct(xs, q) * 1e3, 2)

    return {"config": asdict(cfg) | {"api_key": "***" if cfg.api_key else None}, "ok": r.ok, "errors": r.errors,
            "seconds": round(r.seconds, 3), "req_per_s": round(r.ok / r.seconds, 2) if r.seconds else 0.0,
            "tokens_per_s": round(r.tokens / r.seconds, 1) if r.seconds else 0.0,
            "ttft_ms": {q: ms(r.ttft, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            "tpot_ms": {q: ms(r.tpot, p) for q, p in (("p50", 0.5), ("p99", 0.99))},
            "itl_ms": {q: ms(r.itl, p) for q, p in (("p50", 0.5), ("p99", 0.99))}}


def table(s: dict[str, Any]) -> str:
    rows = [("requests ok", s["ok"]), ("errors", json.dumps(s["errors"]) if s["errors"] else "0"),
            ("req/s", s["req_per_s"]), ("tokens/s", s["tokens_per_s"])]
    for name in ("ttft_ms", "tpot_ms", "itl_ms"):
        rows.append((name.replace("_ms", " ms"), "  ".join(f"{k} {v}" for k, v in s[name].items())))
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
